"""The ways other libraries hand a batch to peers, for side-by-side benchmarks.

Each takes ``(batch, src, group)`` on every rank (``batch`` is ignored off the source)
and returns the batch every rank ends up with. ``src`` is a global rank. ``device`` is
where the messages travel: the CPU on gloo, the current CUDA device on NCCL, and where
the receivers' tensors land, as the peers' own code does it.

- ``pickled_packet``: NeMo's framed packet: ``pickle.dumps((kind, batch))``, an int64
  size broadcast, then the bytes as a uint8 tensor; ``pickle.loads`` on receivers.
- ``object_list``: ``torch.distributed.broadcast_object_list([batch])``.
- ``per_tensor``: accelerate / vLLM style: the tree's metadata via
  ``broadcast_object_list``, then one ``dist.broadcast`` per tensor leaf.
- ``Floor``: one ``dist.broadcast`` of a preallocated uint8 tensor of the batch's byte
  count: the transport's floor.

These baselines pickle by design: that is what is being measured. tensorcast does not.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["Floor", "batch_nbytes", "object_list", "per_tensor", "pickled_packet"]

_CPU = torch.device("cpu")


def batch_nbytes(batch: Any) -> int:
    """Bytes of tensor data in ``batch`` (the floor's message size)."""
    leaves, _ = tree_flatten(batch)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def pickled_packet(
    batch: Any, src: int, group: dist.ProcessGroup | None, device: torch.device = _CPU
) -> Any:
    if dist.get_rank() == src:
        data = pickle.dumps(("batch", batch), protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(size, src, group=group)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        dist.broadcast(payload, src, group=group)
        return batch
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src, group=group)
    _, out = pickle.loads(payload.cpu().numpy().tobytes())
    return out


def object_list(
    batch: Any, src: int, group: dist.ProcessGroup | None, device: torch.device = _CPU
) -> Any:
    box = [batch if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    return box[0]


def per_tensor(
    batch: Any, src: int, group: dist.ProcessGroup | None, device: torch.device = _CPU
) -> Any:
    is_src = dist.get_rank() == src
    if is_src:
        leaves, spec = tree_flatten(batch)
        meta = [
            ("t", tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("v", x)
            for x in leaves
        ]
        box: list[Any] = [(meta, spec)]
    else:
        box = [None]
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    meta, spec = box[0]
    out = []
    for i, m in enumerate(meta):
        if m[0] == "t":
            if is_src:
                t = leaves[i].contiguous().to(device, non_blocking=True)
            else:
                t = torch.empty(m[1], dtype=m[2], device=device)
            dist.broadcast(t, src, group=group)
            out.append(t)
        else:
            out.append(m[1])
    return tree_unflatten(out, spec)


class Memcpy:
    """One copy of ``nbytes`` between two preallocated host buffers, on every rank: the
    least a shared-memory lane pays (its source writes the bytes once)."""

    def __init__(self, nbytes: int, device: torch.device = _CPU) -> None:
        self.src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        self.dst = torch.zeros_like(self.src)  # both written: their pages are in

    def __call__(self, batch: Any) -> Any:
        self.dst.copy_(self.src)
        return batch


class Floor:
    """One broadcast of a preallocated buffer of ``nbytes``: the transport's floor."""

    def __init__(self, nbytes: int, device: torch.device = _CPU) -> None:
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def __call__(self, batch: Any, src: int, group: dist.ProcessGroup | None) -> Any:
        dist.broadcast(self.buffer, src, group=group)
        return batch
