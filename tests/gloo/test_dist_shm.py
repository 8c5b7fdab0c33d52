"""The shared-memory lane on real gloo ranks (``transport.shm``): payloads of ranks on one
host never reach the wire, kept batches never change, a killed peer fails the others and
leaves ``/dev/shm`` as it was."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import dp_tp_mesh, model_step
from subprocs import run_ranks
from taps import WireTap, tapped

import tensorcast as tc
from tensorcast.transport import shm
from tensorcast.transport.shm import SHM_DIR

_BIG = 300_000  # float32s: 1.2 MB, over the lane's smallest payload


def _mine() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("tensorcast-")}


@pytest.fixture(autouse=True)
def shm_left_as_it_was() -> Iterator[None]:
    before = _mine()
    yield
    assert _mine() <= before, f"left in {SHM_DIR}: {sorted(_mine() - before)}"


@contextlib.contextmanager
def lane(limit: int = 1 << 30, host: str | None = None) -> Iterator[None]:
    """The lane on in this rank (the pool turns it off: ``rankpool._ENV``), within ``limit``
    bytes, on the host ``host`` (None: the real one)."""
    saved = {k: os.environ.get(k) for k in ("TENSORCAST_SHM_LIMIT", "TENSORCAST_HOST_ID")}
    os.environ["TENSORCAST_SHM_LIMIT"] = str(limit)
    shm._wire_warned.clear()  # said once a process: each test is one here
    if host is not None:
        os.environ["TENSORCAST_HOST_ID"] = host
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _batch(step: int, n: int = _BIG) -> dict[str, Any]:
    return {"x": torch.arange(n, dtype=torch.float32) + step, "step": step}


@tapped
def _rank_one_host(rank: int, world: int, tap: WireTap, shm: bool | None) -> dict[str, Any]:
    moved = [0]

    def count(wire: Any, tensor: torch.Tensor, root: int) -> None:
        moved[0] += tensor.numel()

    kept = []
    with lane(), tap.hook("payload", before=count):
        loader = tc.BroadcastingDataLoader(
            [_batch(i) for i in range(6)] if rank == 0 else None,
            group=dist.group.WORLD, src=0, shm=shm, timeout=20,
        )  # fmt: skip
        for i, batch in enumerate(loader):
            _written_in_place(rank, batch, i)
            if i % 2:
                kept.append(batch)  # the others' slots are written again
    for batch in kept:  # every batch kept is as it was sent, and as this rank wrote it
        assert torch.equal(batch["x"], _batch(batch["step"])["x"] + rank + 1)
    return {"wire": moved[0], "stats": loader.stats()}


def _written_in_place(rank: int, batch: dict[str, Any], step: int) -> None:
    """Each rank writes into its batch in place (``x += rank + 1``), after the others
    looked at theirs, and sees its own write alone: a rank's batch is its own memory,
    the source's too, whether the slot is new or written again."""
    assert torch.equal(batch["x"], _batch(step)["x"]) and batch["step"] == step
    dist.barrier()
    time.sleep(0.01 * rank)
    batch["x"].add_(rank + 1)
    dist.barrier()
    assert torch.equal(batch["x"], _batch(step)["x"] + rank + 1), f"rank {rank}, step {step}"


@pytest.mark.parametrize("shm", [None, False])
def test_the_lane_keeps_payloads_off_the_wire(pool2: Any, shm: bool | None) -> None:
    results = pool2.run(_rank_one_host, shm, timeout=60)
    for r in results:
        if shm is None:
            assert r["wire"] == 0
            assert r["stats"].shm_bytes == r["stats"].bytes > 0
        else:
            assert r["wire"] >= 6 * 4 * _BIG
            assert r["stats"].shm_bytes == 0


def _loader(rank: int, n: int, **kw: Any) -> tc.BroadcastingDataLoader:
    source = [_batch(i) for i in range(n)] if rank == 0 else None
    return tc.BroadcastingDataLoader(source, group=dist.group.WORLD, src=0, **kw)


def _rank_keeps_and_shares(rank: int, world: int) -> list[str]:
    """A receiver that keeps every batch, or moves it into shared memory as a
    ``torch.multiprocessing`` queue does, never sees it change."""
    import torch.multiprocessing as tmp

    queue = tmp.get_context("spawn").Queue()
    kept, queued = [], []
    with lane():
        for i, batch in enumerate(_loader(rank, 10, timeout=20)):
            if i % 2:  # into another process's reach: the queue moves it to shared memory
                queue.put((batch["step"], batch["x"]))
                queued.append(i)
            else:
                kept.append(batch)
    bad = [b["step"] for b in kept if not torch.equal(b["x"], _batch(b["step"])["x"])]
    for _ in queued:
        step, x = queue.get(timeout=20)
        if not torch.equal(x, _batch(step)["x"]):
            bad.append(step)
    return [f"step {s} changed" for s in bad]


def test_kept_or_queued_batches_never_change(pool2: Any) -> None:
    assert pool2.run(_rank_keeps_and_shares, timeout=60) == [[], []]


def _rank_under_a_model(rank: int, world: int) -> list[str]:
    """A (dp=2, tp=2) mesh with the lane on: each slot's loader at prefetch 0 and 2, the
    model's own collectives on the TP group after each batch (at moments that differ per
    rank), and a tc.broadcast through the lane on that group between. Half the batches
    are kept, some as their storage object alone: none ever changes."""
    mesh = dp_tp_mesh(world)
    tp = mesh.get_group("tp")
    dp, _ = tc.dp_rank_and_size(mesh, ("tp",))
    tp_root = dist.get_process_group_ranks(tp)[0]
    mine = tc.is_dp_source_rank(mesh, ("tp",))
    kept: list[tuple[int, Any]] = []
    bad: list[str] = []
    with lane():
        for prefetch in (0, 2):
            source = [_batch(1000 * dp + s) for s in range(6)] if mine else None
            loader = tc.BroadcastingDataLoader(
                source, mesh, axes=("tp",), prefetch=prefetch, timeout=20
            )
            for step, batch in enumerate(loader):
                want = _batch(1000 * dp + step)
                if not torch.equal(batch["x"], want["x"]):
                    bad.append(f"prefetch={prefetch} step {step}: wrong batch")
                model_step(rank, step, tp)
                got = tc.broadcast(_batch(500 + step) if rank == tp_root else None, tp_root, tp)
                if not torch.equal(got["x"], _batch(500 + step)["x"]):
                    bad.append(f"prefetch={prefetch} step {step}: wrong tc.broadcast")
                if step % 2:
                    kept.append((1000 * dp + step, batch["x"].untyped_storage()))
                else:
                    kept.append((1000 * dp + step, batch["x"]))
            if loader.stats().shm_bytes == 0:
                bad.append(f"prefetch={prefetch}: nothing went through shared memory")
    for step, held in kept:
        x = held if isinstance(held, torch.Tensor) else torch.empty(0).set_(held)[:_BIG]
        if not torch.equal(x, _batch(step)["x"]):
            bad.append(f"kept batch {step} changed")
    return bad


def test_the_lane_under_a_model_with_its_own_collectives(pool4: Any) -> None:
    assert pool4.run(_rank_under_a_model, timeout=90) == [[], [], [], []]


_KILL_TIMEOUT = 5.0


def _rank_dies(rank: int, world: int, victim: int, hosts: int = 1) -> dict[str, Any]:
    """Every rank iterates an endless lane, on ``hosts`` simulated hosts; ``victim``
    SIGKILLs itself mid-pass."""

    def endless() -> Iterator[dict[str, Any]]:
        step = 0
        while True:
            yield _batch(step % 3)
            step += 1

    received, last = 0, time.monotonic()
    with lane(host=f"host-{rank * hosts // world}"):
        loader = tc.BroadcastingDataLoader(
            endless() if rank == 0 else None, group=dist.group.WORLD, src=0,
            timeout=_KILL_TIMEOUT,
        )  # fmt: skip
        try:
            for batch in loader:
                assert torch.equal(batch["x"], _batch(received % 3)["x"])
                received += 1
                last = time.monotonic()
                if rank == victim and received == 4:
                    os.kill(os.getpid(), signal.SIGKILL)
                if received > 10_000:
                    raise AssertionError("the loader kept going after a peer died")
        except tc.TensorcastError as e:
            return {"error": type(e).__name__, "waited": time.monotonic() - last}
    raise AssertionError("the pass ended without an error")


@pytest.mark.parametrize(
    ("victim", "hosts"), [(0, 1), (3, 1), (2, 2)], ids=["writer", "reader", "leader"]
)
def test_a_killed_writer_or_reader_fails_the_others_and_leaves_nothing(
    pool4: Any, victim: int, hosts: int
) -> None:
    results = pool4.run(_rank_dies, victim, hosts, timeout=60, allow_death=True)
    for r, res in enumerate(results):
        if r != victim:
            assert res["error"] == "PeerError", (r, res)
            assert res["waited"] < _KILL_TIMEOUT + 10, (r, res)


def _rank_small_cap(rank: int, world: int) -> list[str]:
    with lane(limit=1 << 20), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = _loader(rank, 4, timeout=20)
        steps = [b["step"] for b in loader]
    assert steps == [0, 1, 2, 3]
    assert loader.stats().shm_bytes == 0
    return [str(w.message) for w in caught if "tensorcast" in str(w.message)]


def test_a_small_cap_falls_back_to_the_wire_with_one_warning(pool2: Any) -> None:
    source, receiver = pool2.run(_rank_small_cap, timeout=60)
    assert len(source) == 1 and "--shm-size" in source[0] and "TENSORCAST_SHM_LIMIT" in source[0]
    assert receiver == []


def _rank_two_groups(rank: int, world: int) -> list[int]:
    """Two channels on one host: each its own arena (its segments' names), bytes intact."""
    with lane():
        one = _loader(rank, 3, timeout=20)
        two = _loader(rank, 3, timeout=20, verify=True)  # the CRC32 of the slot's bytes
        steps = []
        for a, b in zip(one, two):
            a_x, b_x = a["x"], b["x"]
            assert a_x.data_ptr() != b_x.data_ptr()
            assert torch.equal(a_x, b_x)
            steps.append(a["step"])
        assert one.stats().shm_bytes > 0 and two.stats().shm_bytes > 0
    return steps


def test_two_channels_on_one_host_do_not_share_slots(pool2: Any) -> None:
    assert pool2.run(_rank_two_groups, timeout=60) == [[0, 1, 2]] * 2


def _rank_required(rank: int, world: int) -> str:
    with lane(host=f"host-{rank}"):
        try:
            _loader(rank, 2, timeout=20, shm=True)
        except ValueError as e:
            return str(e)
    return "no error"


def test_shm_true_where_it_cannot_be_raises_at_setup_saying_why(pool2: Any) -> None:
    for message in pool2.run(_rank_required, timeout=60):
        assert "shm=True" in message and "not on the source rank 0's host" in message


def _rank_bad_limit(rank: int, world: int, hosts: list[int]) -> tuple[str, float]:
    """``TENSORCAST_SHM_LIMIT`` that rank 1 alone cannot read ("1G"): whether or not its
    role reads it (a reader does not, nor a rank alone on its host), every rank says so at
    once, naming it (it was ignored there, and a host's leader raised alone)."""
    with lane(host=f"host-{hosts[rank]}"):
        if rank == 1:
            os.environ["TENSORCAST_SHM_LIMIT"] = "1G"
        started = time.monotonic()
        try:
            _loader(rank, 2, timeout=20)
        except ValueError as e:
            return str(e), time.monotonic() - started
    return "no error", 0.0


@pytest.mark.parametrize("hosts", [[0, 0], [0, 1]], ids=["one-host", "two-hosts"])
def test_a_limit_one_rank_cannot_read_fails_every_rank_at_setup(
    pool2: Any, hosts: list[int]
) -> None:
    for message, waited in pool2.run(_rank_bad_limit, hosts, timeout=60):
        assert "on rank 1" in message and "TENSORCAST_SHM_LIMIT" in message, message
        assert waited < 10, waited


@tapped
def _rank_hosts(rank: int, world: int, tap: WireTap, hosts: list[int]) -> dict[str, Any]:
    """Ranks on the simulated hosts ``hosts[rank]``: every rank gets every batch bit for
    bit; no payload is broadcast (each crosses the wire to one rank per remote host)."""
    broadcast = [0]

    def count(wire: Any, tensor: torch.Tensor, root: int) -> None:
        broadcast[0] += tensor.numel()

    with lane(host=f"host-{hosts[rank]}"), tap.hook("payload", before=count):
        loader = _loader(rank, 4, timeout=20)
        steps = []
        for batch in loader:
            _written_in_place(rank, batch, batch["step"])
            steps.append(batch["step"])
        # a broadcast on the same channel, kept: the leader's slot is not written again
        kept = tc.broadcast(_batch(7) if rank == 0 else None, 0, timeout=20)
        again = tc.broadcast(_batch(8) if rank == 0 else None, 0, timeout=20)
        assert torch.equal(kept["x"], _batch(7)["x"]) and torch.equal(again["x"], _batch(8)["x"])
    stats = loader.stats()
    return {"steps": steps, "shm": stats.shm_bytes, "wire": stats.wire_bytes, "bcast": broadcast[0]}


# by layout, the ranks that read the payload from the wire (rank 0, the source, writes it)
_LAYOUTS = {"2x2": ([0, 0, 1, 1], {2}), "1+2+1": ([0, 1, 1, 2], {1, 3})}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_several_hosts_take_the_payload_once_per_remote_host(pool4: Any, layout: str) -> None:
    hosts, wired = _LAYOUTS[layout]
    results = pool4.run(_rank_hosts, hosts, timeout=60)
    nbytes = 4 * _BIG * 4  # 4 batches of _BIG float32s (and a small int)
    for rank, r in enumerate(results):
        assert r["steps"] == [0, 1, 2, 3] and r["bcast"] == 0, (rank, r)
        if rank == 0:
            assert r["shm"] >= nbytes if hosts.count(0) > 1 else r["shm"] == 0, r
        elif rank in wired:  # a leader: the payload crossed the wire to it alone
            assert r["shm"] == 0 and r["wire"] >= nbytes, (rank, r)
        else:  # on the source's host, or following its host's leader: an arena
            assert r["wire"] == 0 and r["shm"] >= nbytes, (rank, r)


_ROWS, _SAMPLES = 8, 120_000  # 3.8 MB of audio, half of 7 rows padding: trimmed on a wire


def _rank_trims(rank: int, world: int, hosts: list[int]) -> int:
    """The payload bytes of 4 padded batches, on ranks of the simulated hosts ``hosts``."""

    def padded(step: int) -> dict[str, Any]:
        audio = torch.full((_ROWS, _SAMPLES), float(step + 1))
        audio[1:, _SAMPLES // 2 :] = 0.0
        return {"audio": audio}

    with lane(host=f"host-{hosts[rank]}"):
        source = [padded(i) for i in range(4)] if rank == 0 else None
        loader = tc.BroadcastingDataLoader(source, group=dist.group.WORLD, src=0, timeout=20)
        for i, batch in enumerate(loader):
            assert torch.equal(batch["audio"], padded(i)["audio"])
    return loader.stats().bytes


def test_trimming_is_skipped_only_where_every_receiver_reads_the_arena(
    pool2: Any, pool4: Any
) -> None:
    whole = _ROWS * _SAMPLES * 4
    # one host: the first batch is trimmed, then every receiver reads the source's slot
    for nbytes in pool2.run(_rank_trims, [0, 0], timeout=60):
        assert 3 * whole < nbytes < 4 * whole
    # two hosts: the wire carries every payload to the other host, trimmed
    for nbytes in pool4.run(_rank_trims, [0, 0, 1, 1], timeout=60):
        assert nbytes < 4 * 0.7 * whole


_ENDS_AT_ONCE = """
os.environ["TENSORCAST_SHM_LIMIT"] = str(1 << 30)
import torch
import tensorcast as tc

want = {"x": torch.arange(300_000.0)}  # over the lane's smallest payload: through the arena
if RANK == 0:  # the reader maps the slot a second after its first message came (descheduled)
    from tensorcast.transport import shm

    mapping = shm.Reader.payload

    def late(self, ref, nbytes):
        time.sleep(1.0)
        return mapping(self, ref, nbytes)

    shm.Reader.payload = late
got = tc.broadcast(want if RANK == 1 else None, src=1, timeout=TIMEOUT_S)
assert torch.equal(got["x"], want["x"])
print("EQUAL", flush=True)
"""


def test_a_source_that_ends_its_program_at_once_leaves_its_payload_to_its_readers(
    tmp_path: Any,
) -> None:
    # Its arena's segments were unlinked at its exit, before a reader had mapped the last:
    # that reader raised PeerError ("the source rank 1's shared-memory segment is gone").
    # Rank 0 hosts the store, so the source is rank 1.
    outs = run_ranks(_ENDS_AT_ONCE, 2, tmp_path, timeout=60, pg_timeout=20)
    for rank, (code, out, err) in enumerate(outs):
        assert code == 0 and "EQUAL" in out, f"rank {rank}: {err[-3000:]}"
