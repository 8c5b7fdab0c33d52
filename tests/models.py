"""A "model" around the loader in multi-process tests: a ``(dp, tp)`` mesh and a step of
the model's own collectives on its TP group, at moments that differ per rank."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def dp_tp_mesh(world: int) -> Any:
    return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))


def model_step(rank: int, step: int, tp: Any) -> None:
    """The model's own traffic on the TP group, at a moment that differs per rank."""
    time.sleep(0.002 * ((rank + step) % 3))
    x = torch.ones(3) * (rank + 1)
    dist.all_reduce(x, group=tp)
    root = dist.get_process_group_ranks(tp)[step % 2]
    y = torch.full((4,), float(root + step)) if rank == root else torch.zeros(4)
    dist.broadcast(y, root, group=tp)
    if not torch.equal(y, torch.full((4,), float(root + step))):
        raise AssertionError(f"the model's broadcast got {y.tolist()} at step {step}")
