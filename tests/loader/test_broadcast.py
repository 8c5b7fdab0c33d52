"""``broadcast`` and ``broadcast_batch`` without a process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tensorcast as tc


def test_broadcast_batch_is_a_no_op_without_torch_distributed() -> None:
    assert not dist.is_initialized()
    batch = {"x": torch.ones(2)}
    assert tc.broadcast_batch(batch, None) is batch

    class Mesh:  # would span 4 ranks if a process group existed
        mesh = torch.arange(4).reshape(2, 2)
        mesh_dim_names = ("cp", "tp")

    assert tc.broadcast_batch(batch, Mesh()) is batch
    with pytest.raises(RuntimeError, match="init_process_group"):
        tc.broadcast(batch, 0)
