"""Multi-process tests of ``BroadcastingDataLoader``: every item of the contract's
"BroadcastingDataLoader" section.

Each rank function checks one item for prefetch 0 and prefetch >= 1 on the same group, so
the number of pool calls (and group set-ups) stays small. Every rank builds the expected
batches itself and compares what the loader yielded against them.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from taps import WireTap, tapped
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, Dataset, default_collate

import tensorcast as tc
from tensorcast.transport import groups as _groups

TIMEOUT = 120.0
# Loaders whose ranks could fall out of step get a collective timeout, so a desync fails
# every rank with PeerError in bounded time instead of hanging the whole pool call.
HANG = 30.0
N = 6  # batches per pass
# Floats of audio in every batch() while _with_audio runs: 0 means none, and the batch
# travels inline in the first message; with audio (over 256 KiB), a payload follows it.
_AUDIO = [0]


def batch(i: int, tag: int = 0) -> dict[str, Any]:
    """Batch ``i`` of the data set ``tag``; every field depends on both."""
    out = {
        "x": torch.arange(4, dtype=torch.float32) + 100 * tag + i,
        "ids": [i, tag, -(2**70)],
        "name": f"batch-{tag}-{i}",
    }
    if _AUDIO[0]:
        out["audio"] = torch.full((_AUDIO[0],), float(100 * tag + i))
    return out


def same(got: Any, want: Any) -> bool:
    """Structure, types and tensor bytes equal (tensors compared with their dtype)."""
    if type(got) is not type(want):
        return False
    if isinstance(want, torch.Tensor):
        return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    if isinstance(want, dict):
        return list(got) == list(want) and all(same(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want, strict=True))
    return bool(got == want)


def check(got: list[Any], want: list[Any], what: str) -> None:
    names = [b.get("name") if isinstance(b, dict) else b for b in got]
    if len(got) != len(want) or not all(same(a, b) for a, b in zip(got, want, strict=False)):
        raise AssertionError(f"{what}: got {names}, want {[b['name'] for b in want]}")


def cp_tp_mesh() -> Any:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))


# -- sources --------------------------------------------------------------------------------


class Stream:
    """An iterable without ``__len__``: a new generator per pass."""

    def __init__(self, n: int, tag: int = 0) -> None:
        self.n = n
        self.tag = tag

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (batch(i, self.tag) for i in range(self.n))


class Untouchable:
    """Handed to receivers, which must never iterate it."""

    def __iter__(self) -> Iterator[Any]:
        raise AssertionError("a receiver iterated its source")

    def __len__(self) -> int:
        return 99


class Failing:
    """Yields ``fail_at`` batches, then raises ``error``, on the first pass only."""

    def __init__(self, n: int, fail_at: int, error: BaseException) -> None:
        self.n = n
        self.fail_at = fail_at
        self.error = error
        self.failed = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            if i == self.fail_at and not self.failed:
                self.failed = True
                raise self.error
            yield batch(i)


class WontStart:
    """A source whose ``iter()`` raises, like a DataLoader whose workers cannot start."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __iter__(self) -> Iterator[Any]:
        raise self.error


class Slow:
    """A source that takes a while per batch, like a real loader reading from disk."""

    def __init__(self, n: int, delay: float) -> None:
        self.n = n
        self.delay = delay

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            time.sleep(self.delay)
            yield batch(i)


class Stateful:
    """A resumable source: its state is the index of the next batch to yield."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.pos < self.n:
            i = self.pos
            self.pos += 1
            yield batch(i)

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = state["pos"]


class Opaque:
    def __repr__(self) -> str:
        return "Opaque()"


class Samples(Dataset[dict[str, Any]]):
    """Samples of mixed fields, as a real map-style data set hands them to ``collate``."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "audio": torch.full((3, 5), float(i)),
            "label": i,
            "text": f"utt-{i}",
            "mask": torch.arange(5) < i,
        }


# -- rank functions -------------------------------------------------------------------------


def _rank_lockstep(rank: int, world: int) -> None:
    """Items 2, 3 and 7: same batches everywhere, one end for all, ``len`` on every rank;
    mesh and group forms; loaders built one after another share one group."""
    mesh = cp_tp_mesh()
    source = tc.is_dp_source_rank(mesh)
    want = [batch(i) for i in range(N)]
    groups: set[tuple[int, ...]] | None = None
    for prefetch in (0, 1, 3):
        sized = tc.BroadcastingDataLoader(
            want if source else Untouchable(), mesh, prefetch=prefetch
        )
        assert sized.is_source == source
        check(list(sized), want, f"list source, prefetch={prefetch}")
        check(list(sized), want, f"second pass, prefetch={prefetch}")

        stream = tc.BroadcastingDataLoader(Stream(N) if source else None, mesh, prefetch=prefetch)
        check(list(stream), want, f"stream source, prefetch={prefetch}")
        check(list(stream), want, f"stream, second pass, prefetch={prefetch}")

        generator = (batch(i) for i in range(N))  # one pass only, then empty
        once = tc.BroadcastingDataLoader(generator if source else None, mesh, prefetch=prefetch)
        check(list(once), want, f"generator, prefetch={prefetch}")
        check(list(once), [], f"exhausted generator, prefetch={prefetch}")

        empty = tc.BroadcastingDataLoader([] if source else None, mesh, prefetch=prefetch)
        check(list(empty), [], f"empty source, prefetch={prefetch}")

        packed = [tc.pack(b) for b in want]  # pre-packed batches arrive as trees
        pre = tc.BroadcastingDataLoader(packed if source else None, mesh, prefetch=prefetch)
        check(list(pre), want, f"pre-packed source, prefetch={prefetch}")

        # Item 7: every rank learns the source's length when the loader is built (what a
        # receiver was handed, here Untouchable with its 99, does not count), and a source
        # without one is a TypeError on every rank.
        assert len(sized) == N and len(empty) == 0 and len(pre) == N
        for loader in (stream, once):
            with pytest.raises(TypeError, match="no len"):
                len(loader)

        # Every loader on the mesh travels on the one group over its ranks, made once.
        made = set(_groups.world()._groups)
        assert groups is None or made == groups, f"new groups: {made} after {groups}"
        groups = made
    assert groups is not None and (0, 1, 2, 3) in groups

    # The group= / src= form, with a source that is not rank 0 (src is a global rank).
    for prefetch in (0, 2):
        loader = tc.BroadcastingDataLoader(
            Stream(N, tag=2) if rank == 2 else None,
            group=dist.group.WORLD,
            src=2,
            prefetch=prefetch,
        )
        check(list(loader), [batch(i, 2) for i in range(N)], f"group form, prefetch={prefetch}")
        with pytest.raises(TypeError, match="no len"):
            len(loader)
        sized = tc.BroadcastingDataLoader(
            want if rank == 2 else None, group=dist.group.WORLD, src=2, prefetch=prefetch
        )
        assert len(sized) == N
        check(list(sized), want, f"group form, list source, prefetch={prefetch}")
    assert set(_groups.world()._groups) == groups, "the group form made a group of its own"

    # Item 2: a source rank whose source is None is a ValueError on every rank of its
    # group, not on the source alone (its receivers would wait for batches forever).
    for prefetch in (0, 1):
        with pytest.raises(ValueError, match="source is None"):
            tc.BroadcastingDataLoader(None, mesh, prefetch=prefetch)
        with pytest.raises(ValueError, match="source is None"):
            tc.BroadcastingDataLoader(None, group=dist.group.WORLD, src=2, prefetch=prefetch)
    # ... and the ranks are still in step: the next loader works everywhere.
    loader = tc.BroadcastingDataLoader(want if source else None, mesh)
    check(list(loader), want, "a loader after the ValueErrors")


_RAISED: dict[str, BaseException] = {}


def _rank_source_failures(rank: int, world: int) -> dict[str, list[str]]:
    """Items 4, 5 and 9: a failing iterator and an unencodable batch, on every rank."""
    mesh = cp_tp_mesh()
    source = tc.is_dp_source_rank(mesh)
    want = [batch(i) for i in range(N)]
    messages: dict[str, list[str]] = {}
    for prefetch in (0, 1, 2):
        # The source's iterator raises after 3 batches: the source re-raises that very object.
        _RAISED["error"] = ValueError(f"shard 7 is corrupt (prefetch={prefetch})")
        loader = tc.BroadcastingDataLoader(
            Failing(N, 3, _RAISED["error"]) if source else None, mesh, prefetch=prefetch
        )
        got: list[Any] = []
        try:
            for b in loader:
                got.append(b)
        except ValueError as e:
            assert source, f"receiver rank {rank} raised {e!r}"
            assert e is _RAISED["error"], "the source must re-raise the very same exception"
        except tc.SourceError as e:
            assert not source, f"source rank {rank} raised {e!r}"
            assert isinstance(e, tc.TensorcastError) and isinstance(e, RuntimeError)
            messages.setdefault("iterator", []).append(str(e))
        else:
            raise AssertionError(f"rank {rank}: the failure did not reach this rank")
        check(got, want[:3], f"batches before the failure, prefetch={prefetch}")
        # The group is still usable: the next pass runs to the end everywhere.
        check(list(loader), want, f"pass after a failure, prefetch={prefetch}")

        # The source's iter() itself raises: nothing was yielded, the same reporting.
        _RAISED["start"] = OSError(f"no such shard (prefetch={prefetch})")
        loader = tc.BroadcastingDataLoader(
            WontStart(_RAISED["start"]) if source else None, mesh, prefetch=prefetch
        )
        try:
            list(loader)
        except OSError as e:
            assert source, f"receiver rank {rank} raised {e!r}"
            assert e is _RAISED["start"], "the source must re-raise the very same exception"
        except tc.SourceError as e:
            assert not source, f"source rank {rank} raised {e!r}"
            messages.setdefault("start", []).append(str(e))
        else:
            raise AssertionError(f"rank {rank}: the failure to start did not reach this rank")

        # Batch 2 cannot be encoded: the source raises why, receivers learn it.
        items: list[Any] = [*want[:2], {"x": torch.ones(1), "meta": [Opaque()]}, *want[3:]]
        loader = tc.BroadcastingDataLoader(items if source else None, mesh, prefetch=prefetch)
        got = []
        try:
            for b in loader:
                got.append(b)
        except tc.UnsupportedLeafError as e:
            assert source, f"receiver rank {rank} raised {e!r}"
            assert isinstance(e, TypeError)
            messages.setdefault("encode_source", []).append(str(e))
        except tc.SourceError as e:
            assert not source, f"source rank {rank} raised {e!r}"
            messages.setdefault("encode", []).append(str(e))
        else:
            raise AssertionError(f"rank {rank}: the encoding failure did not reach this rank")
        check(got, want[:2], f"batches before the unencodable one, prefetch={prefetch}")
        check(
            list(tc.BroadcastingDataLoader(want if source else None, mesh, prefetch=prefetch)),
            want,
            f"a new loader after an unencodable batch, prefetch={prefetch}",
        )
    return messages


def _rank_break(rank: int, world: int, prefetch: int) -> list[str]:
    """Item 6: break on every rank after the same batch; re-iterate; then tear the group down."""
    mesh = cp_tp_mesh()
    source = tc.is_dp_source_rank(mesh)
    want = [batch(i) for i in range(N)]
    # A slow source: when the loop breaks, the lookahead is still being produced.
    loader = tc.BroadcastingDataLoader(
        Slow(N, 0.05) if source else None, mesh, prefetch=prefetch, timeout=HANG
    )
    got = []
    for b in loader:
        got.append(b)
        if len(got) == 2:
            break
    check(got, want[:2], "before the break")
    # Ranks never leave a loop at the same instant: receivers linger, so their lookahead
    # threads get to run before the next pass starts, while the source's may not.
    time.sleep(0.1 * rank)
    again = []  # a new iter() starts a new pass from the first batch
    for b in loader:
        again.append(b)
        if len(again) == 4:
            break
    check(again, want[:4], "new pass after a break")
    check(list(loader), want, "full pass after two breaks")
    last = []
    for b in loader:
        last.append(b["name"])
        break
    dist.destroy_process_group()  # nothing may still be pending on the group
    return last


def _rank_traffic_after_break(rank: int, world: int) -> None:
    """Item 6, "no collective pending": right after a break the group carries other traffic,
    and so it does in the middle of a pass."""
    mesh = cp_tp_mesh()
    source = tc.is_dp_source_rank(mesh)
    want = [batch(i) for i in range(N)]
    for prefetch in (0, 1, 2):
        loader = tc.BroadcastingDataLoader(
            Slow(N, 0.05) if source else None, mesh, prefetch=prefetch, timeout=HANG
        )
        for b in loader:
            if b["name"] == want[1]["name"]:
                break
        extra = batch(0, tag=9)
        out = tc.broadcast_batch(extra if source else None, mesh)
        check([out], [extra], f"broadcast_batch right after a break, prefetch={prefetch}")
        fresh = tc.BroadcastingDataLoader(
            Stream(N) if source else None, mesh, prefetch=prefetch, timeout=HANG
        )
        check(list(fresh), want, f"a fresh loader right after a break, prefetch={prefetch}")
    # Other traffic on the group in the middle of prefetching passes: a broadcast pauses
    # them (they finish what they owe first) and each goes on at its next batch.
    for prefetch in (1, 2):
        loaders = [
            tc.BroadcastingDataLoader(
                Stream(N, tag) if source else None, mesh, prefetch=prefetch, timeout=HANG
            )
            for tag in (1, 2)
        ]
        for i, (one, two) in enumerate(zip(*loaders, strict=True)):
            extra = batch(i, tag=9)
            out = tc.broadcast_batch(extra if source else None, mesh)
            check([one, two, out], [batch(i, 1), batch(i, 2), extra], f"interleaved, {prefetch=}")


def _rank_resume(rank: int, world: int) -> list[tuple[int, int, Any]]:
    """Item 8: k steps, save, restore into a fresh loader: the halves make one whole pass."""
    mesh = cp_tp_mesh()
    source = tc.is_dp_source_rank(mesh)
    states = []
    for prefetch in (0, 1, 2):
        full = list(
            tc.BroadcastingDataLoader(
                Stateful(N) if source else None, mesh, prefetch=prefetch, timeout=HANG
            )
        )
        check(full, [batch(i) for i in range(N)], f"uninterrupted pass, prefetch={prefetch}")
        for k in (0, 1, 2, N - 1, N):
            first = tc.BroadcastingDataLoader(
                Stateful(N) if source else None, mesh, prefetch=prefetch, timeout=HANG
            )
            it = iter(first)
            head = [next(it) for _ in range(k)]
            state = first.state_dict()
            states.append((prefetch, k, state))

            fresh = tc.BroadcastingDataLoader(
                Stateful(N) if source else None, mesh, prefetch=prefetch, timeout=HANG
            )
            fresh.load_state_dict(state)
            tail = list(fresh)
            check(head + tail, full, f"resume after {k} steps, prefetch={prefetch}")
    # Delegation without iterating: the source's own state, {} on receivers.
    loader = tc.BroadcastingDataLoader(Stateful(N) if source else None, mesh)
    loader.load_state_dict({"pos": 4})
    assert loader.state_dict() == ({"pos": 4} if source else {})
    plain = tc.BroadcastingDataLoader(Stream(N) if source else None, mesh)
    assert plain.state_dict() == {}
    plain.load_state_dict({"pos": 1})  # a source without state: nothing to restore
    check(list(plain), [batch(i) for i in range(N)], "stateless source after load_state_dict")
    return states


def _rank_no_op(rank: int, world: int) -> None:
    """Item 1: the cases where there is nobody to broadcast to iterate the source directly."""
    items = [batch(i) for i in range(3)]
    alone = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    meshes = [
        None,
        init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)),
        init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "cp")),
        init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("dp", "cp", "tp")),
    ]
    for mesh in meshes:
        assert tc.is_dp_source_rank(mesh)
        for prefetch in (0, 2):
            loader = tc.BroadcastingDataLoader(items, mesh, prefetch=prefetch)
            assert all(a is b for a, b in zip(loader, items, strict=True))
            assert len(loader) == len(items)
            assert list(tc.BroadcastingDataLoader(None, mesh, prefetch=prefetch)) == []
            stream = tc.BroadcastingDataLoader(Stream(2), mesh, prefetch=prefetch)
            check(list(stream), [batch(0), batch(1)], "no-op stream")
            packed = tc.BroadcastingDataLoader([tc.pack(b) for b in items], mesh)
            check(list(packed), items, "no-op with pre-packed batches")
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))
    # axes that miss a mesh with a CP dim of size 2: still a no-op, but it warns (once)
    with pytest.warns(UserWarning, match=r"none of axes=\('tp',\) is a dimension"):
        loader = tc.BroadcastingDataLoader(items, mesh, axes=("tp",))
    assert all(a is b for a, b in zip(loader, items, strict=True))
    # A group of one rank.
    loader = tc.BroadcastingDataLoader(items, group=alone[rank], src=rank)
    assert all(a is b for a, b in zip(loader, items, strict=True))


def _rank_packed_collate(rank: int, world: int) -> None:
    """A real DataLoader with worker processes, packing in the workers, as the source."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    source = tc.is_dp_source_rank(mesh)
    plain = list(DataLoader(Samples(), batch_size=4, collate_fn=default_collate))
    assert len(plain) == 3
    for prefetch in (0, 1):
        real = DataLoader(
            Samples(), batch_size=4, num_workers=2, collate_fn=tc.packed_collate(default_collate)
        )
        loader = tc.BroadcastingDataLoader(real if source else None, mesh, prefetch=prefetch)
        if source:
            assert len(loader) == 3
            # The pool's ranks are daemon processes (so a hung test leaves no orphans), and
            # daemons may not start children; the DataLoader joins its workers itself.
            config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
            daemon = config.get("daemon")
            config["daemon"] = False
            try:
                got = list(loader)
            finally:
                config["daemon"] = daemon
        else:
            got = list(loader)
        assert len(got) == len(plain)
        for a, b in zip(got, plain, strict=True):
            assert same(a, b), f"rank {rank}, prefetch={prefetch}: {a} != {b}"


def _rank_lets_go(rank: int, world: int) -> list[str]:
    """A batch the caller dropped is freed right then: the loader keeps no reference to a
    batch it has handed out (else its pooled buffer could not be reused, and it would be
    freed inside the next ``next()``, on the clock of the next step)."""
    held = []
    for prefetch in (0, 1):
        source = [batch(i) for i in range(N)] if rank == 0 else None
        loader = tc.BroadcastingDataLoader(source, group=dist.group.WORLD, src=0, prefetch=prefetch)
        it = iter(loader)  # not enumerate(): it keeps its last item for reuse
        for i in range(N):
            got = next(it)
            check([got], [batch(i)], f"rank {rank}, prefetch={prefetch}")
            leaf = weakref.ref(got["x"])
            del got
            if leaf() is not None:
                held.append(f"prefetch={prefetch} batch {i}")
        assert list(it) == []
    return held


def _rank_dp_slots(rank: int, world: int) -> list[list[tuple[int, int]]]:
    """Every DP slot of a (dp, cp, tp) mesh iterates its own data."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    dp = mesh.get_local_rank("dp")
    source = tc.is_dp_source_rank(mesh)
    assert source == (rank in (0, 4))
    passes = []
    for prefetch in (0, 2):
        loader = tc.BroadcastingDataLoader(
            Stream(N - dp, tag=dp) if source else None, mesh, prefetch=prefetch
        )
        got = list(loader)
        check(got, [batch(i, dp) for i in range(N - dp)], f"dp slot {dp}, prefetch={prefetch}")
        passes.append([(int(b["ids"][1]), int(b["ids"][0])) for b in got])
    return passes


def _rank_agreements_leave_no_keys(rank: int, world: int) -> int:
    """Loaders built again and again do not grow the store: the last rank through each
    agreement deletes its keys. Returns how many keys the store gained."""
    store = dist.distributed_c10d._get_default_store()
    group = dist.group.WORLD

    def build_and_run() -> None:
        loader = tc.BroadcastingDataLoader(
            [{"step": s} for s in range(3)] if rank == 0 else None, group=group, src=0
        )
        assert [b["step"] for b in loader] == [0, 1, 2]
        assert tc.broadcast({"x": 1} if rank == world - 1 else None, world - 1) == {"x": 1}

    build_and_run()  # makes the groups and starts the heartbeats: keys that stay
    dist.barrier()
    before = store.num_keys()
    for _ in range(4):
        build_and_run()
    dist.barrier()
    return store.num_keys() - before


@tapped
def _with_audio(
    rank: int, world: int, tap: WireTap, floats: int, calls: list[tuple[Any, tuple[Any, ...]]]
) -> list[tuple[Any, int]]:
    """Each ``fn(rank, world, *args)`` of ``calls`` in turn, with ``floats`` of audio in
    every batch: a payload that follows the first message, one after another of the same
    layout. Returns, for each, what ``fn`` returned and how many payload messages this
    rank took part in while it ran."""
    payloads = [0]

    def payload(wire: Any, tensor: Any, root: int) -> None:
        payloads[-1] += 1

    out = []
    _AUDIO[0] = floats
    try:
        with tap.hook("payload", before=payload):
            for fn, args in calls:
                out.append((fn(rank, world, *args), payloads[-1]))
                payloads.append(0)
    finally:
        _AUDIO[0] = 0
    return out


# -- tests ----------------------------------------------------------------------------------


def test_every_rank_yields_the_same_batches_and_stops_together(pool4: Any) -> None:
    pool4.run(_rank_lockstep, timeout=TIMEOUT)


def test_source_failures_reach_every_rank(pool4: Any) -> None:
    results = pool4.run(_rank_source_failures, timeout=TIMEOUT)
    receivers = results[1:]
    for messages in receivers:
        assert len(messages["iterator"]) == 3
        for prefetch, text in zip((0, 1, 2), messages["iterator"], strict=True):
            assert "source iterator failed" in text
            assert "ValueError" in text
            assert f"shard 7 is corrupt (prefetch={prefetch})" in text
        for prefetch, text in zip((0, 1, 2), messages["start"], strict=True):
            assert "source iterator failed" in text
            assert f"OSError: no such shard (prefetch={prefetch})" in text
        assert len(messages["encode"]) == 3
        for original, text in zip(results[0]["encode_source"], messages["encode"], strict=True):
            assert "batch serialization failed" in text
            assert original in text
    assert all("batch['meta'][0]" in m for m in results[0]["encode_source"])


def test_resume_repeats_no_batch_and_skips_none(pool4: Any) -> None:
    states = pool4.run(_rank_resume, timeout=TIMEOUT)
    for prefetch, k, state in states[0]:
        assert state == {"pos": k}, f"source state after {k} steps with prefetch={prefetch}"
    for receiver in states[1:]:
        assert all(state == {} for _, _, state in receiver)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_break_leaves_nothing_pending(pool4: Any, prefetch: int) -> None:
    last = pool4.run(_rank_break, prefetch, timeout=TIMEOUT)
    assert last == [["batch-0-0"]] * 4


@pytest.mark.parametrize("floats", [75_000, 600_000], ids=["300KB", "2.4MB"])
def test_batches_with_payloads_end_fail_break_and_resume_cleanly(pool4: Any, floats: int) -> None:
    """Batches whose payload follows the first message: every way a pass can turn out (the
    end of a pass, a failing or unencodable batch, a break, a resumed or new pass) keeps
    the ranks in step, as it does with batches that travel in one message."""
    calls = [
        (_rank_lockstep, ()),
        (_rank_source_failures, ()),
        (_rank_resume, ()),
        (_rank_break, (1,)),  # last: it tears the process group down
    ]
    every_rank = pool4.run(_with_audio, floats, calls, timeout=TIMEOUT)
    for (fn, _), results in zip(calls, zip(*every_rank, strict=True), strict=True):
        for rank, (_, payloads) in enumerate(results):
            assert payloads > 0, f"{fn.__name__}: no payload message on rank {rank}"
        if fn is _rank_source_failures:
            assert all(len(messages["iterator"]) == 3 for messages, _ in results[1:])
        if fn is _rank_break:
            assert [last for last, _ in results] == [["batch-0-0"]] * 4


def test_group_carries_other_traffic_right_after_a_break(pool4: Any) -> None:
    pool4.run(_rank_traffic_after_break, timeout=TIMEOUT)


def test_no_op_modes_iterate_the_source_directly(pool2: Any) -> None:
    pool2.run(_rank_no_op, timeout=TIMEOUT)


def test_packed_collate_with_worker_processes_as_the_source(pool2: Any) -> None:
    pool2.run(_rank_packed_collate, timeout=TIMEOUT)


def test_a_dropped_batch_is_freed_at_once(pool2: Any) -> None:
    for rank, held in enumerate(pool2.run(_rank_lets_go, timeout=TIMEOUT)):
        assert held == [], f"rank {rank} kept {held} alive after the caller dropped them"


def test_agreements_leave_no_keys_in_the_store(pool2: Any) -> None:
    # Keys that earlier checks left behind may go meanwhile; none may come.
    growth = pool2.run(_rank_agreements_leave_no_keys, timeout=TIMEOUT)
    assert all(n <= 0 for n in growth), growth


def test_every_dp_slot_iterates_its_own_data(pool8: Any) -> None:
    passes = pool8.run(_rank_dp_slots, timeout=TIMEOUT)
    for rank, got in enumerate(passes):
        dp = rank // 4
        assert got == [[(dp, i) for i in range(N - dp)]] * 2, f"rank {rank}"


def _rank_hand_out_waits_for_no_later_step(rank: int, world: int) -> dict[str, Any]:
    """prefetch=2 on a CPU group: the source's batch 1 comes only once the caller holds
    batch 0. A hand-out that waited for the next step's job (as a device pass does, to
    post its device work ahead) would wait for batch 1, and batch 1 for the hand-out."""
    handed = threading.Event()
    waited: list[bool] = []

    class Gated:
        def __iter__(self) -> Iterator[dict[str, Any]]:
            for i in range(4):
                if i == 1:
                    waited.append(handed.wait(5.0))
                yield {"i": torch.tensor(i)}

    loader = tc.BroadcastingDataLoader(
        Gated() if rank == 0 else None, group=dist.group.WORLD, src=0, prefetch=2, timeout=20
    )
    model = dist.new_group(backend="gloo")
    got = []
    for step, batch in enumerate(loader):
        handed.set()
        got.append(int(batch["i"]))
        if (rank + step) % 2:
            torch.ones(20_000).sum()  # the model's step takes longer on some ranks
        dist.all_reduce(torch.ones(1), group=model)
    return {"got": got, "waited": waited}


def test_a_cpu_hand_out_does_not_wait_for_the_next_step(pool2: Any) -> None:
    source, receiver = pool2.run(_rank_hand_out_waits_for_no_later_step, timeout=TIMEOUT)
    assert source["waited"] == [True], source  # batch 1 came once batch 0 was handed out
    assert source["got"] == receiver["got"] == [0, 1, 2, 3]


ALIGN_LEAVES = 20_000


def _rank_align(rank: int, world: int) -> dict[str, Any]:
    """Many tiny leaves of 16 bytes each (issue 33: 100,000 of them, 1.6 MB of data, travel
    as 6.4 MB at ``align=64``; 20,000 here, the packing is per leaf). ``align=1`` on the
    source packs them tight; a receiver's ``align`` is not used (it reads every offset
    from the header), so it may differ from the source's."""
    leaves = ALIGN_LEAVES
    tree = [torch.full((4,), float(i)) for i in range(leaves)]
    want = torch.stack(tree)
    out: dict[str, Any] = {}
    for name, kwargs in (("default", {}), ("tight", {"align": 1 if rank == 0 else 256})):
        loader = tc.BroadcastingDataLoader(
            [tree] if rank == 0 else None, group=dist.group.WORLD, src=0, prefetch=0, **kwargs
        )
        (got,) = list(loader)
        if len(got) != leaves or not torch.equal(torch.stack(got), want):
            raise AssertionError(f"{name}: the leaves differ from the source's")
        out[name] = loader.stats().bytes
    return out


def test_align_packs_tiny_leaves_tighter(pool2: Any) -> None:
    for rank, nbytes in enumerate(pool2.run(_rank_align, timeout=TIMEOUT)):
        # one 64-byte slot a leaf, but the last one's 16 bytes end the buffer
        assert nbytes["default"] == (ALIGN_LEAVES - 1) * 64 + 16, (rank, nbytes)
        assert nbytes["tight"] == ALIGN_LEAVES * 16, (rank, nbytes)
