"""The loader inside a training step: one ordered lane per group, atomic frames, agreement.

Each rank function puts a "model" around the loader: its own collectives on the
sub-mesh's groups (the very TP group included) at rank-dependent moments, as a training
step would, and checks that neither side ever sees the other's data and nothing hangs.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from models import dp_tp_mesh, model_step
from taps import WireTap, tapped
from torch.distributed.device_mesh import init_device_mesh

import tensorcast as tc
from tensorcast.transport import groups as _groups

TIMEOUT = 120.0
#: the loader's timeout where a rank ends up waiting it out: a receiver whose source broke
#: its channel (its peers' waits are not cut short on every torch), a rank whose peer
#: raised before it came; ample for a frame or a setup on a loaded machine
SHORT = 5.0
N = 5  # batches per pass


def batch(i: int, tag: int, nbytes: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"i": torch.tensor([i, tag]), "name": f"{tag}-{i}"}
    if nbytes:
        out["audio"] = torch.full((nbytes // 4,), float(i + 100 * tag))
    return out


class Source:
    """A sized source of ``n`` batches tagged ``tag``, with ``nbytes`` of audio in each
    (or ``nbytes[i]`` in batch ``i``)."""

    def __init__(self, n: int, tag: int, nbytes: int | list[int] = 0) -> None:
        self.n, self.tag = n, tag
        self.nbytes = nbytes if isinstance(nbytes, list) else [nbytes] * n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        return (batch(i, self.tag, self.nbytes[i]) for i in range(self.n))


def names(batches: list[Any]) -> list[str]:
    return [b["name"] for b in batches]


def _rank_model_on_the_tp_group(rank: int, world: int) -> dict[str, Any]:
    mesh = dp_tp_mesh(world)
    tp = mesh.get_group("tp")
    dp, _ = tc.dp_rank_and_size(mesh, ("tp",))
    out: dict[str, Any] = {}
    for prefetch in (0, 1, 2):
        for nbytes in (0, 300_000):
            src = Source(N, dp, nbytes) if tc.is_dp_source_rank(mesh, ("tp",)) else None
            loader = tc.BroadcastingDataLoader(src, mesh, axes=("tp",), prefetch=prefetch)
            got = []
            for step, b in enumerate(loader):
                model_step(rank, step, tp)
                got.append(b)
            want = [f"{dp}-{i}" for i in range(N)]
            if names(got) != want or (nbytes and float(got[-1]["audio"][0]) != N - 1 + 100 * dp):
                raise AssertionError(f"prefetch={prefetch}: got {names(got)}, want {want}")
            out[(prefetch, nbytes)] = len(loader)
    return out


def test_the_models_collectives_on_the_tp_group_never_meet_the_loaders(pool4: Any) -> None:
    results = pool4.run(_rank_model_on_the_tp_group, timeout=TIMEOUT)
    assert all(set(r.values()) == {N} for r in results)


def _rank_zipped_loaders(rank: int, world: int) -> list[list[str]]:
    """Two loaders and tc.broadcast on one group, payloads promised and not: ``a``'s
    fixed size from its third batch on (its END breaks the promise), ``b``'s sizes kept
    and then broken, the broadcasts' across passes; small batches for the first pass."""
    group = dist.group.WORLD
    is_src = rank == 0
    out = []
    for k, (pa, pb) in enumerate(((0, 1), (1, 3), (2, 0))):
        big = k > 0
        sizes_b = [200_000, 200_000, 200_000, 100_000, 100_000] if big else 0
        a = tc.BroadcastingDataLoader(
            Source(N, 1, 300_000 if big else 0) if is_src else None, group=group, src=0, prefetch=pa
        )
        b = tc.BroadcastingDataLoader(
            Source(N, 2, sizes_b) if is_src else None, group=group, src=0, prefetch=pb
        )
        got = []
        for step, (x, y) in enumerate(zip(a, b)):
            # tc.broadcast on the same ranks between steps, and the model on the world group
            sent = {"step": step, "x": torch.full((75_000,), float(step))}
            z = tc.broadcast(sent if is_src else None, 0)
            dist.all_reduce(torch.ones(1))
            if not torch.equal(z["x"], sent["x"]):
                raise AssertionError(f"tc.broadcast at step {step} got other bytes")
            for tree, tag in ((x, 1), (y, 2)):
                if "audio" in tree and float(tree["audio"][-1]) != step + 100 * tag:
                    raise AssertionError(f"loader {tag} step {step}: other audio")
            got.append(f"{x['name']}|{y['name']}|{z['step']}")
        out.append(got)
    return out


def test_zipped_loaders_with_mixed_prefetch_and_broadcasts_keep_their_batches(pool2: Any) -> None:
    results = pool2.run(_rank_zipped_loaders, timeout=TIMEOUT)
    want = [f"1-{i}|2-{i}|{i}" for i in range(N)]
    for r in results:
        assert r == [want] * 3


def _plain(t: torch.Tensor) -> bool:
    return not t.requires_grad and t.grad_fn is None and not t.is_inference()


def _rank_grad_and_inference(rank: int, world: int) -> list[str]:
    seen = []
    for nbytes in (64, 300_000, 3 << 20):  # inline, its own message, a large leaf
        w = torch.randn(nbytes // 4, requires_grad=True)
        tree = {"w": w, "small": torch.ones(3, requires_grad=True), "x": torch.arange(4.0)}
        got = tc.broadcast(tree if rank == 0 else None, 0)
        if not all(_plain(t) for t in got.values()):
            raise AssertionError(f"{nbytes}: a tensor came back with grad state")
        with torch.inference_mode():
            inf = {"x": torch.arange(float(nbytes // 4))}
            got_inf = tc.broadcast(inf if rank == 0 else None, 0)
            packed = tc.pack(inf)
            got_packed = tc.broadcast(packed if rank == 0 else None, 0)
        for t in (got_inf["x"], got_packed["x"]):
            if not _plain(t):
                raise AssertionError(f"{nbytes}: an inference tensor came back")
            p = torch.ones_like(t, requires_grad=True)
            (t * p).sum().backward()  # usable by autograd outside inference mode
        # The next training batch after an eval step in inference mode.
        after = tc.broadcast({"y": torch.ones(nbytes // 4)} if rank == 0 else None, 0)
        if not _plain(after["y"]):
            raise AssertionError("a batch after inference mode is not plain")
        seen.append(f"{nbytes}:{float(got['w'].sum()) if rank else float(w.sum())}")
    return seen


def test_grad_and_inference_tensors_travel_as_plain_tensors(pool2: Any) -> None:
    a, b = pool2.run(_rank_grad_and_inference, timeout=TIMEOUT)
    assert [x.split(":")[0] for x in a] == [x.split(":")[0] for x in b]


class Interrupted(Exception):
    pass


def _wait_until_waiting_for_a_job(ident: int, limit_s: float = 10.0) -> None:
    """Return once the thread ``ident`` waits in ``Job.result`` (a loader's ``next()``)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(ident)
        while frame is not None:
            if frame.f_code.co_name == "result" and frame.f_code.co_filename.endswith(
                "transport/lane.py"
            ):
                return
            frame = frame.f_back
        time.sleep(0.001)
    raise AssertionError("the caller never waited for the frame's job")


@tapped
def _rank_signal_mid_frame(rank: int, world: int, tap: WireTap) -> dict[int, list[str]]:
    """A signal handler raises on the source's main thread while its frame is on the wire.

    With prefetch the frame is on the lane's worker: the signal interrupts only the
    caller's wait, and waiting again hands out the same batch. Without prefetch the frame
    runs on the caller's thread: the exception breaks the channel, loudly, on every rank.
    """
    fired: list[int] = []

    def payload(wire: Any, tensor: Any, root: int) -> None:
        if rank == 0 and not fired and float(tensor[-4:].view(torch.float32)[0]) == 702.0:
            fired.append(1)
            main = threading.main_thread()
            if threading.current_thread() is not main:
                # On the worker the frame may be posted before the caller asks for it (a
                # promised payload comes first): the signal is meant to hit that wait.
                _wait_until_waiting_for_a_job(main.ident)  # type: ignore[arg-type]
            signal.pthread_kill(main.ident, signal.SIGUSR1)  # type: ignore[arg-type]
            time.sleep(0.05)  # the handler runs on the main thread meanwhile

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted

    old = signal.signal(signal.SIGUSR1, handler)
    out: dict[int, list[str]] = {}
    try:
        with tap.hook("payload", before=payload):
            for prefetch in (1, 0):
                fired.clear()
                got = out[prefetch] = []
                loader = tc.BroadcastingDataLoader(
                    Source(N, 7, 300_000) if rank == 0 else None,
                    group=dist.group.WORLD,
                    src=0,
                    prefetch=prefetch,
                    timeout=SHORT,
                )
                it = iter(loader)
                while True:
                    try:
                        b = next(it)
                    except Interrupted:  # caught, as a training script's handler would be
                        got.append("interrupted")
                        continue
                    except tc.PeerError:
                        got.append("broken")
                        break
                    except StopIteration:
                        break
                    got.append(f"{b['name']}:{int(b['audio'][0])}")
    finally:
        signal.signal(signal.SIGUSR1, old)
    return out


def test_a_signal_mid_frame_never_shifts_the_stream(pool2: Any) -> None:
    src, receiver = pool2.run(_rank_signal_mid_frame, timeout=TIMEOUT)
    want = [f"7-{i}:{700 + i}" for i in range(N)]
    assert src[1] == [*want[:2], "interrupted", *want[2:]], src[1]
    assert receiver[1] == want
    assert src[0] == [*want[:2], "interrupted", "broken"], src[0]
    assert receiver[0] == [*want[:2], "broken"], receiver[0]


def _rank_disagreeing_setups(rank: int, world: int) -> list[str]:
    out = []
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    short = SHORT
    cases = {
        "prefetch": dict(prefetch=rank % 2),
        "axes": dict(axes=("tp",) if rank == 3 else ("cp", "tp")),
    }
    for what, kwargs in cases.items():
        src = Source(N, 0) if rank == 0 else None
        start = time.monotonic()
        with pytest.raises(tc.DesyncError) as info:
            tc.BroadcastingDataLoader(
                src if "axes" not in kwargs or rank == 0 else None, mesh, timeout=short, **kwargs
            )
        if time.monotonic() - start > short + 5:
            raise AssertionError(f"{what}: the DesyncError took {time.monotonic() - start:.1f} s")
        out.append(f"{what}: {info.value}")
    # The ranks are still in step: a loader with one setup works.
    loader = tc.BroadcastingDataLoader(Source(N, 0) if rank == 0 else None, mesh)
    if names(list(loader)) != [f"0-{i}" for i in range(N)]:
        raise AssertionError("a loader after the disagreement did not work")
    return out


def test_disagreeing_prefetch_and_axes_raise_desync_on_every_rank(pool4: Any) -> None:
    results = pool4.run(_rank_disagreeing_setups, timeout=TIMEOUT)
    for r in results:
        assert "prefetch" in r[0] and "rank" in r[0], r[0]
        assert "axes" in r[1], r[1]


class Slow:
    """A source whose first batch takes ``delay`` seconds (a DataLoader starting workers)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __iter__(self) -> Any:
        time.sleep(self.delay)
        yield batch(0, 0)


def _rank_short_default_timeout(rank: int, world: int, path: str) -> str:
    """``timeout=None`` is init_process_group's timeout, for tensorcast's groups too; a
    receiver that times out says the source is alive but busy."""
    # Together into the new group: its rendezvous has the same 2 s, and a rank that comes
    # to it late (the pool's ranks start a test at their own moment) would miss it.
    dist.barrier()
    dist.destroy_process_group()
    store = dist.FileStore(path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=2)
    )
    try:
        assert _groups.world().timeout == datetime.timedelta(seconds=2)
        loader = tc.BroadcastingDataLoader(
            Slow(5.0) if rank == 0 else None, group=dist.group.WORLD, src=0, prefetch=0
        )
        start = time.monotonic()
        with pytest.raises(tc.PeerError) as info:
            list(loader)
        took = time.monotonic() - start
        if took > 8.0:
            raise AssertionError(f"the PeerError took {took:.1f} s with a 2 s timeout")
        return str(info.value)
    finally:
        dist.destroy_process_group()  # the pool's next call makes a fresh group


def test_timeout_none_is_the_init_timeout_and_a_slow_source_is_told_apart(pool2: Any) -> None:
    path = os.path.join(tempfile.mkdtemp(prefix="tensorcast-short-"), "store")
    src, receiver = pool2.run(_rank_short_default_timeout, path, timeout=TIMEOUT)
    assert "alive but slow" in receiver and "next(source)" in receiver, receiver
    assert "sending a frame failed" in src, src


def _rank_no_leak_and_break(rank: int, world: int) -> dict[str, int]:
    group = dist.group.WORLD
    before = threading.active_count()
    for k in range(12):
        loader = tc.BroadcastingDataLoader(
            Source(N, k) if rank == 0 else None, group=group, src=0, prefetch=k % 3
        )
        for step, b in enumerate(loader):
            if b["name"] != f"{k}-{step}":
                raise AssertionError(f"loader {k}: got {b['name']} at step {step}")
            if step == 1:
                break  # on every rank after the same batch
    groups = len(_groups.world()._groups)
    # A break leaves nothing pending: the world group carries other traffic at once.
    x = torch.ones(2)
    dist.all_reduce(x)
    return {"threads": threading.active_count() - before, "groups": groups, "sum": int(x[0])}


def test_loaders_built_per_epoch_leak_no_thread_or_group(pool2: Any) -> None:
    for r in pool2.run(_rank_no_leak_and_break, timeout=TIMEOUT):
        # At most one world's threads, whatever the number of loaders: its watch, the
        # source's heartbeat, and the lane's worker (the steps the breaks left run on it).
        assert r["threads"] <= 3 and r["groups"] == 1 and r["sum"] == 2, r


@tapped
def _rank_deferred_failure(rank: int, world: int, tap: WireTap) -> str:
    """A step left queued by a break fails (it runs after the break: NOTE [ Where a pass
    ends ]): the loader's next use says so, on every rank, naming the failure."""
    calls = [0]

    def payload(wire: Any, tensor: Any, root: int) -> None:
        calls[0] += 1
        if rank == 1 and calls[0] == 3:
            raise RuntimeError("connection reset by peer (injected)")

    with tap.hook("payload", before=payload):
        loader = tc.BroadcastingDataLoader(
            Source(N, 3, 300_000) if rank == 0 else None,
            group=dist.group.WORLD,
            src=0,
            prefetch=2,
            timeout=5.0,
        )
        for step, _ in enumerate(loader):
            if step == 0:
                break  # steps 1 and 2 are still queued; step 2's payload fails on rank 1
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:  # the source learns at a send to the aborted peer
            try:
                list(loader)
            except tc.PeerError as e:
                return str(e)
            time.sleep(0.05)
        raise AssertionError("the failure after the break was never raised")


def test_a_failure_after_a_break_is_raised_not_swallowed(pool2: Any) -> None:
    source, receiver = pool2.run(_rank_deferred_failure, timeout=TIMEOUT)
    assert "connection reset by peer (injected)" in receiver, receiver
    assert "failed" in source, source


class Counter:
    """A stateful source whose load_state_dict consumes its argument, as lhotse's do."""

    def __init__(self, n: int) -> None:
        self.n, self.pos, self.iters = n, 0, 0

    def __iter__(self) -> Any:
        self.iters += 1
        while self.pos < self.n:
            self.pos += 1
            yield batch(self.pos - 1, 5)

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state.pop("pos")


def _rank_dropped_iterator_and_state_copies(rank: int, world: int) -> dict[str, Any]:
    source = Counter(N) if rank == 0 else None
    loader = tc.BroadcastingDataLoader(source, group=dist.group.WORLD, src=0, prefetch=2)
    it = iter(loader)  # a framework checking that an iterator can be made, then dropping it
    del it
    got = []
    for step, b in enumerate(loader):
        got.append(b["name"])
        if step == 1:
            break
    state = loader.state_dict()
    fresh = Counter(N) if rank == 0 else None
    again = tc.BroadcastingDataLoader(fresh, group=dist.group.WORLD, src=0, prefetch=2)
    again.load_state_dict(state)  # empties what it is given, on the source
    got += names(list(again))
    return {
        "got": got,
        "iters": source.iters if source else None,
        "state after": loader.state_dict(),
        "state given": state,
    }


def test_a_dropped_iterator_pulls_nothing_and_state_dicts_are_copies(pool2: Any) -> None:
    src, receiver = pool2.run(_rank_dropped_iterator_and_state_copies, timeout=TIMEOUT)
    want = [f"5-{i}" for i in range(N)]
    assert src["got"] == receiver["got"] == want
    assert src["iters"] == 1, "iter() without next() must not start the source"
    assert src["state after"] == src["state given"] == {"pos": 2}
    assert receiver["state after"] == {}


def _rank_short_loader_timeout(rank: int, world: int) -> str:
    """A loader's own timeout, far below the process group's: the source still beats
    often enough for a receiver to tell that it is alive."""
    try:
        loader = tc.BroadcastingDataLoader(
            Slow(3.0) if rank == 0 else None,
            group=dist.group.WORLD,
            src=0,
            prefetch=0,
            timeout=1.0,
        )
        with pytest.raises(tc.PeerError) as info:
            list(loader)
        return str(info.value)
    finally:
        dist.destroy_process_group()  # the broken channel goes with it; the pool makes anew


def test_a_slow_source_is_alive_whatever_the_loaders_timeout(pool2: Any) -> None:
    _, receiver = pool2.run(_rank_short_loader_timeout, timeout=TIMEOUT)
    assert "alive but slow" in receiver and "next(source)" in receiver, receiver


def _rank_late_arrival(rank: int, world: int) -> tuple[str, float]:
    """Rank 1 builds its loader after rank 0 gave up waiting: both raise DesyncError, and
    the late one does so at once instead of waiting in group creation."""
    if rank == 1:
        time.sleep(3.0)
    start = time.monotonic()
    with pytest.raises(tc.DesyncError) as info:
        tc.BroadcastingDataLoader(
            Source(N, 0) if rank == 0 else None, group=dist.group.WORLD, src=0, timeout=1.5
        )
    return str(info.value), time.monotonic() - start


def test_a_rank_that_comes_after_the_others_gave_up_is_told_at_once(pool2: Any) -> None:
    (first, _), (late, took) = pool2.run(_rank_late_arrival, timeout=TIMEOUT)
    assert "did not set up" in first, first
    assert "gave up waiting" in late and took < 1.0, (late, took)
