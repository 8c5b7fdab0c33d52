"""Setting up on real gloo ranks: every wait bounded by the call's timeout, a mesh's
setups that differ anywhere caught on every rank of the mesh, within seconds rather than
at the timeout; a store whose host exited is a PeerError naming it; waits print only
tensorcast's lines; a destroyed default group leaves nothing of tensorcast running.

Each scenario runs on a new default group (a new store), so the agreements of earlier
calls on the pool do not number this one's, and nothing it leaves behind reaches the next.
"""

from __future__ import annotations

import datetime
import gc
import itertools
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rankpool import RankPool, in_a_new_process_group
from subprocs import run_ranks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import tensorcast as tc

TIMEOUT = 3.0  # the call's timeout where a rank never comes, seconds
MARGIN = 20.0  # slack for a loaded 2-core machine
CALL_TIMEOUT = 180.0


def _timed(build: Callable[[], Any]) -> tuple[str, float]:
    """What ``build`` raised (its type and message, or "ok") and how long it took."""
    began = time.monotonic()
    try:
        build()
        said = "ok"
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    return said, time.monotonic() - began


@in_a_new_process_group
def _a_rank_never_calls(rank: int, world: int) -> dict[str, Any]:
    """Rank 3 never calls: tc.broadcast(timeout=3) on every rank, and broadcast_batch
    (timeout=3) on a (2, 2) mesh, raise on the ranks that called, within about 3 s."""
    out: dict[str, Any] = {}
    batch = {"x": torch.arange(6.0)}
    if rank != 3:
        out["broadcast"] = _timed(lambda: tc.broadcast(batch if rank == 0 else None, 0, timeout=3))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    if rank != 3:
        mine = batch if tc.is_dp_source_rank(mesh) else None
        out["batch"] = _timed(lambda: tc.broadcast_batch(mine, mesh, axes="tp", timeout=3))
    dist.barrier()
    return out


def test_a_rank_that_never_calls_fails_the_others_within_the_timeout(pool4: RankPool) -> None:
    results = pool4.run(_a_rank_never_calls, timeout=CALL_TIMEOUT)
    for rank in (0, 1, 2):
        said, took = results[rank]["broadcast"]
        assert "DesyncError" in said and "rank(s) [3] did not set up" in said, said
        assert TIMEOUT - 0.5 < took < TIMEOUT + MARGIN, (rank, took)
    # broadcast_batch: rank 3's sub-mesh [2, 3] is short of it, and the mesh is set up by
    # all of its ranks together: [0, 1] are told too, within the timeout.
    said, took = results[2]["batch"]
    assert "rank(s) [3] did not set up tensorcast.broadcast_batch" in said, said
    assert took < TIMEOUT + MARGIN, took
    for rank in (0, 1):
        said, took = results[rank]["batch"]
        assert "DesyncError" in said and "rank 2 gave up waiting for rank 3" in said, said
        assert took < TIMEOUT + MARGIN, took


@in_a_new_process_group
def _layouts_that_differ(rank: int, world: int) -> tuple[str, float]:
    """Same names, same shape, other rank layouts: ranks 0 and 2 see [[0, 1], [2, 3]],
    ranks 1 and 3 see [[0, 2], [1, 3]] (no process group is made for the mesh)."""
    layout = [[0, 1], [2, 3]] if rank % 2 == 0 else [[0, 2], [1, 3]]
    mesh = DeviceMesh("cpu", layout, mesh_dim_names=("dp", "tp"), _init_backend=False)
    source = [{"x": torch.arange(3)}] if tc.is_dp_source_rank(mesh) else None
    return _timed(lambda: tc.BroadcastingDataLoader(source, mesh, timeout=60))


def test_meshes_with_other_rank_layouts_are_a_desync_error(pool4: RankPool) -> None:
    results = pool4.run(_layouts_that_differ, timeout=CALL_TIMEOUT)
    for rank, (said, took) in enumerate(results):
        assert "DesyncError" in said and "layout=" in said, (rank, said)
        assert took < MARGIN, (rank, took)  # at once, not at the 60 s timeout


@in_a_new_process_group
def _other_axes_on_eight_ranks(rank: int, world: int) -> tuple[str, float, Any]:
    """Rank 5 asks for ("tp",) on a (2, 2, 2) mesh; the others for ("cp", "tp"). The
    sub-mesh [4, 5, 6, 7] holds it and raises at once; [0, 1, 2, 3] does not meet it but
    raises with them: had it gone on, the model's next collective across the DP slots
    would hang."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    axes = ("tp",) if rank == 5 else ("cp", "tp")
    want = [{"step": torch.tensor([s])} for s in range(3)]
    source = want if tc.is_dp_source_rank(mesh, axes) else None
    loader: list[Any] = []
    said, took = _timed(
        lambda: loader.append(tc.BroadcastingDataLoader(source, mesh, axes=axes, timeout=60))
    )
    got = None
    if loader:
        model = mesh["tp"].get_group()
        got = []
        for batch in loader[0]:
            dist.all_reduce(torch.ones(1), group=model)
            got.append(int(batch["step"]))
    return said, took, got


def test_a_rank_with_other_axes_is_caught_within_seconds(pool8: RankPool) -> None:
    results = pool8.run(_other_axes_on_eight_ranks, timeout=CALL_TIMEOUT)
    for rank, (said, took, got) in enumerate(results):
        assert "DesyncError" in said and "axes=" in said and "rank 5" in said, (rank, said)
        assert took < MARGIN and got is None, (rank, took, got)  # not the 60 s timeout


@pytest.mark.parametrize("timeout", [0, -1.0, "5"])
def test_broadcast_batch_refuses_a_bad_timeout(timeout: Any) -> None:
    mesh = None  # the check comes first, whatever the mesh
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        tc.broadcast_batch({"x": 1}, mesh, timeout=timeout)


@in_a_new_process_group
def _slots_that_disagree(rank: int, world: int, late: float) -> tuple[str, float]:
    """A (2, 2) ("dp", "tp") mesh whose slot [0, 1] builds its loader with prefetch=1 and
    slot [2, 3] with prefetch=2, ``late`` seconds after the first."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, _ = tc.dp_rank_and_size(mesh, "tp")
    if dp == 1:
        time.sleep(late)
    source = [{"x": torch.arange(3)}] * 3 if tc.is_dp_source_rank(mesh, "tp") else None
    loader: list[Any] = []

    def build() -> None:
        loader.append(
            tc.BroadcastingDataLoader(source, mesh, axes="tp", prefetch=1 + dp, timeout=60)
        )
        list(loader[0])  # on today's main ranks 0, 1 iterate; the next cross-slot collective hangs

    return _timed(build)


@pytest.mark.parametrize("late", [0.0, 2.0])
def test_a_dp_slot_that_disagrees_fails_every_rank_of_the_mesh(
    pool4: RankPool, late: float
) -> None:
    results = pool4.run(_slots_that_disagree, late, timeout=CALL_TIMEOUT)
    for rank, (said, took) in enumerate(results):
        assert said.startswith("DesyncError") and "prefetch=" in said, (rank, said)
        assert "did not set up" not in said, (rank, said)
        # names the ranks that disagree: one of slot [2, 3], and rank 0 (the mesh's first)
        assert "rank 2 and rank 0" in said or "rank 3 and rank 0" in said, (rank, said)
        assert took < late + MARGIN, (rank, took)  # not the 60 s timeout


@in_a_new_process_group
def _layouts_that_differ_late(rank: int, world: int) -> tuple[str, float]:
    """Ranks 0 and 1 see [[0, 1], [2, 3]]; ranks 2 and 3 see [[0, 2], [1, 3]] and come
    2 s after them: by then ranks 0 and 1 have agreed among themselves."""
    layout = [[0, 1], [2, 3]] if rank < 2 else [[0, 2], [1, 3]]
    mesh = DeviceMesh("cpu", layout, mesh_dim_names=("dp", "tp"), _init_backend=False)
    if rank >= 2:
        time.sleep(2.0)
    source = [{"x": torch.arange(3)}] if tc.is_dp_source_rank(mesh) else None
    return _timed(lambda: tc.BroadcastingDataLoader(source, mesh, timeout=20))


def test_late_ranks_with_other_layouts_fail_every_rank_at_once(pool4: RankPool) -> None:
    """Every rank raises, naming the layouts; none is told that a rank which came did not
    set up (today: "rank(s) [0] did not set up ... every rank of [0, 2, 0]", at 20 s)."""
    results = pool4.run(_layouts_that_differ_late, timeout=CALL_TIMEOUT)
    for rank, (said, took) in enumerate(results):
        assert said.startswith("DesyncError") and "layout=" in said, (rank, said)
        assert "did not set up" not in said, (rank, said)
        assert took < 2.0 + MARGIN, (rank, took)


_STORE_HOST_EXITS = """
import tensorcast as tc
import torch
from torch.distributed.device_mesh import DeviceMesh

mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"), _init_backend=False)
if RANK == 3:
    time.sleep(8)  # the others give up at 3 s, and rank 0's process, the store's host, exits
source = [{"x": torch.arange(3)}] if tc.is_dp_source_rank(mesh) else None
try:
    tc.BroadcastingDataLoader(source, mesh, axes="tp", timeout=3)
except Exception as e:
    print(f"RAISED {type(e).__module__}.{type(e).__name__}: {e}", flush=True)
    if RANK == 0:
        raise  # the store's host exits on its own error
"""


def test_a_store_whose_host_exited_is_a_peer_error_naming_it(tmp_path: Path) -> None:
    """Rank 3 never comes in time: the others raise DesyncError, and rank 0, which hosts
    the TCPStore, exits on it. When rank 3 sets up, the store is gone: it gets PeerError
    naming the store's address and its host, never torch's raw DistNetworkError."""
    outs = run_ranks(_STORE_HOST_EXITS, 4, tmp_path, timeout=CALL_TIMEOUT)
    said = outs[3][1]
    assert "RAISED tensorcast._errors.PeerError" in said, outs[3]
    assert "a TCPStore at 127.0.0.1:" in said and "rank 0's process hosts it" in said, said
    assert outs[0][0] == 1 and "DesyncError" in outs[0][2], outs[0]
    for rank in (1, 2):  # told why, or that the store went before they read why
        assert "RAISED tensorcast._errors.DesyncError" in outs[rank][1] or (
            "RAISED tensorcast._errors.PeerError" in outs[rank][1]
        ), outs[rank]


_STORE_HOST_STOPS = """
import signal
import tensorcast as tc

if RANK == 0:
    with open("pid0", "w") as f:
        f.write(str(os.getpid()))
pair = dist.new_group([0, 2])
if RANK != 1:  # rank 2's tensorcast state is made before the host stops; rank 1's after
    tc.broadcast({"x": 1} if RANK == 0 else None, 0, pair, timeout=30)
dist.barrier()
if RANK == 0:  # stopped, and the TCPStore it hosts with it (a debugger, a paused container)
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)  # once rank 1 lets it go on
time.sleep(0.5)
start = time.monotonic()
try:
    if RANK == 1:
        tc.broadcast(None, 0, timeout=2)
    else:
        tc.BroadcastingDataLoader(None, group=dist.group.WORLD, src=0, timeout=2)
except Exception as e:
    print(f"RAISED after {time.monotonic() - start:.1f} s: {type(e).__name__}: {e}", flush=True)
if RANK == 1:  # its first request was given up: it may still land, so no state is made again
    start = time.monotonic()
    try:
        tc.broadcast(None, 0, timeout=2)
    except Exception as e:
        print(f"AGAIN after {time.monotonic() - start:.1f} s: {type(e).__name__}", flush=True)
    time.sleep(0.5)
    with open("pid0") as f:
        os.kill(int(f.read()), signal.SIGCONT)
os._exit(0)  # no teardown through the store
"""


def test_a_store_whose_host_is_stopped_fails_a_setup_within_its_timeout(tmp_path: Path) -> None:
    """A TCPStore client waits for ever on a host that is alive but stopped, whatever its
    own timeout: a first setup (its first store request) and a loader's used to hang on
    it. Each raises PeerError naming the store within the call's timeout."""
    outs = run_ranks(_STORE_HOST_STOPS, 3, tmp_path, timeout=CALL_TIMEOUT, pg_timeout=30)
    for rank in (1, 2):
        said = outs[rank][1]
        took = float(said.split("RAISED after ")[1].split(" s")[0])
        assert "PeerError" in said and "a TCPStore at 127.0.0.1:" in said, outs[rank]
        assert "did not answer its" in said and "stopped or gone" in said, said
        assert took < 2.0 + MARGIN, (rank, said)
    again = outs[1][1].split("AGAIN after ")[1]
    assert float(again.split(" s")[0]) < 0.5 and "PeerError" in again, outs[1]


_NEVER_COMES = """
import tensorcast as tc

if RANK == 1:
    time.sleep(8)  # never builds the loader, and stays alive while rank 0 waits
    os._exit(0)
try:
    tc.BroadcastingDataLoader([1, 2, 3], group=dist.group.WORLD, src=0, timeout=4)
except tc.DesyncError as e:
    print("RAISED", e, flush=True)
"""


def test_a_wait_for_a_missing_rank_prints_only_tensorcasts_lines(tmp_path: Path) -> None:
    """Rank 1 never builds the loader: rank 0 says every second whom it waits for, then
    raises; c10d's `waitForInput ... timed out after 3000ms` never appears."""
    outs = run_ranks(_NEVER_COMES, 2, tmp_path, timeout=CALL_TIMEOUT)
    rc, out, err = outs[0]
    assert rc == 0 and "RAISED rank 0: rank(s) [1] did not set up" in out, outs[0]
    assert "still waiting for rank 1 to set up BroadcastingDataLoader" in err, err
    assert "waitForInput" not in err and "timed out after" not in err, err


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _tensorcast_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("tensorcast"))


def _rounds(
    rank: int, world: int, folder: str, rounds: int, use: bool, keep_mesh: bool
) -> list[Any]:
    """``rounds`` times: init_process_group, a mesh (kept for good with ``keep_mesh``),
    (with ``use``) a loader kept for good, broadcast_batch and broadcast, then
    destroy_process_group(); after each round, once tensorcast's threads are gone (or
    after 5 s): open fds, OS threads, and tensorcast's threads still running."""
    dist.barrier()  # every rank is through the pool's own init before its group goes
    dist.destroy_process_group()
    kept: list[Any] = []
    seen: list[Any] = []
    for k in range(rounds):
        store = dist.FileStore(os.path.join(folder, f"{use}-{k}"), world)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20)
        )
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
        if keep_mesh:
            kept.append(mesh)
        if use:
            source = [{"x": torch.full((4,), s)} for s in range(3)] if rank == 0 else None
            loader = tc.BroadcastingDataLoader(source, mesh, timeout=20)
            kept.append(loader)
            assert [int(b["x"][0]) for b in loader] == [0, 1, 2]
            got = tc.broadcast_batch({"y": torch.ones(2)} if rank == 0 else None, mesh)
            assert torch.equal(got["y"], torch.ones(2))
            assert tc.broadcast({"z": 3} if rank == 0 else None, 0) == {"z": 3}
        gc.collect()
        in_use = _fds()  # this round's groups open; the earlier rounds' closed by now
        dist.barrier()
        del mesh
        dist.destroy_process_group()
        deadline = time.monotonic() + 5.0
        while _tensorcast_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        gc.collect()
        seen.append((_fds(), _os_threads(), _tensorcast_threads(), in_use))
    return seen


@pytest.mark.parametrize("keep_mesh", [True, False], ids=["mesh-kept", "loader-kept"])
def test_a_destroyed_default_group_leaves_nothing_running(
    pool2: RankPool, tmp_path: Path, keep_mesh: bool
) -> None:
    """Six rounds of init / mesh / loaders (kept) / destroy in one process pair: after
    each, no tensorcast thread runs (heartbeat, lanes, watch) and the process holds as
    many more fds and OS threads per round as with torch alone, whether the program keeps
    the mesh (which keeps the destroyed default group's object alive) or only its loaders
    (today, with the mesh kept: a heartbeat per round still writing to a destroyed
    group's store, and 5 fds more per round). While a round's loaders are in use, the
    earlier rounds' groups are closed already."""
    torch_alone = pool2.run(_rounds, str(tmp_path), 6, False, keep_mesh, timeout=CALL_TIMEOUT)
    with_tc = pool2.run(_rounds, str(tmp_path), 6, True, keep_mesh, timeout=CALL_TIMEOUT)
    for rank in range(2):
        alone, used = torch_alone[rank], with_tc[rank]
        assert all(not names for _, _, names, _ in used), (rank, used)
        # while a round's loaders are in use, tensorcast holds that round's groups only:
        # the first use under a new default group closed the earlier ones (not left to
        # their watch), so the fds over torch's own stay the same round after round
        over = [u[3] - a[3] for u, a in zip(used, alone)]
        # (from the second round: the first may be measured before it holds its groups)
        assert max(over[1:]) - min(over[1:]) <= 2, (rank, over)
        for i, what in ((0, "fds"), (1, "OS threads")):
            # what a round adds, the median of the five: torch's own counts move by a few
            # in one round or another as its objects of earlier rounds are freed, while a
            # leak adds its share every round
            grew = statistics.median(b[i] - a[i] for a, b in itertools.pairwise(used))
            grew_alone = statistics.median(b[i] - a[i] for a, b in itertools.pairwise(alone))
            assert grew <= grew_alone, (rank, what, [u[i] for u in used], [a[i] for a in alone])
