"""Setting up on real gloo ranks: every wait bounded by the call's timeout, meshes that
differ caught on the ranks that meet them, within seconds rather than at the timeout.

Each scenario runs on a new default group (a new store), so the agreements of earlier
calls on the pool do not number this one's, and nothing it leaves behind reaches the next.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rankpool import RankPool, in_a_new_process_group
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
    # broadcast_batch: rank 3's sub-mesh [2, 3] is short of it; [0, 1] is whole and works.
    said, took = results[2]["batch"]
    assert "rank(s) [3] did not set up tensorcast.broadcast_batch" in said, said
    assert took < TIMEOUT + MARGIN, took
    assert results[0]["batch"][0] == "ok" and results[1]["batch"][0] == "ok", results


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
    sub-mesh [4, 5, 6, 7] holds it and raises at once; [0, 1, 2, 3] does not meet it and
    works, a model's all_reduce on its own group between the batches."""
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
        if rank >= 4:
            assert "DesyncError" in said and "axes=" in said, (rank, said)
            assert took < MARGIN, (rank, took)  # not the 60 s timeout
        else:
            assert said == "ok" and got == [0, 1, 2], (rank, said, got)


@pytest.mark.parametrize("timeout", [0, -1.0, "5"])
def test_broadcast_batch_refuses_a_bad_timeout(timeout: Any) -> None:
    mesh = None  # the check comes first, whatever the mesh
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        tc.broadcast_batch({"x": 1}, mesh, timeout=timeout)
