"""``broadcast`` and ``broadcast_batch`` without a process group."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import tensorcast as tc


class Axis:
    """One dimension of a mesh-like object: its size (NOTE [ The per-axis mesh protocol ])."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_broadcast_batch_is_a_no_op_without_torch_distributed() -> None:
    assert not dist.is_initialized()
    batch = {"x": torch.ones(2)}
    assert tc.broadcast_batch(batch, None) is batch

    class Mesh:  # would span 4 ranks if a process group existed
        mesh = torch.arange(4).reshape(2, 2)
        mesh_dim_names = ("cp", "tp")

    assert tc.broadcast_batch(batch, Mesh()) is batch

    # The mesh's mistakes raise or warn without a group too, as the loader's do.
    class Unnamed:
        mesh_dim_names = None

    class Model:  # a ("dp", "model") mesh (dims no other test uses: warned once per process)
        mesh_dim_names = ("dp", "model")

        def __getitem__(self, name: str) -> Any:
            return Axis(4 if name == "model" else 1)

    for mesh in (Unnamed(), None):
        for axes in (5, [b"tp"]):
            with pytest.raises(TypeError, match=r"axes must be mesh dimension names"):
                tc.broadcast_batch(batch, mesh, axes=axes)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="named dimensions"):
        tc.broadcast_batch(batch, Unnamed())
    with pytest.warns(UserWarning, match=r"none of axes=\('cp', 'tp'\) is a dimension"):
        assert tc.broadcast_batch(batch, Model()) is batch
    with pytest.raises(TypeError, match="named dimensions"):
        tc.BroadcastingDataLoader([batch], Unnamed())
    with pytest.raises(RuntimeError, match="init_process_group"):
        tc.broadcast(batch, 0)


def test_a_failing_call_raises_its_own_error_whatever_its_part_in_the_frame_meets() -> None:
    """NOTE [ A call that does not take its part ]: the caller's mistake is what it sees;
    the frame's failure (here the wait for it) is a note beside it, not in its place."""
    import types

    from tensorcast.loader import broadcast as B

    def run(fn: Any, frames: Any) -> Any:
        raise tc.PeerError("waiting for the source rank 0 timed out")

    lane = types.SimpleNamespace(run=run)
    role = types.SimpleNamespace(group=types.SimpleNamespace(lane=lane), recv=print)
    with pytest.raises(TypeError, match="trim must be") as info, B._taking_part(role, 5):  # type: ignore[arg-type]
        raise TypeError("trim must be True or False, got 'yes'")
    notes = getattr(info.value, "__notes__", [""])
    assert "waiting for the source rank 0 timed out" in notes[0], notes
