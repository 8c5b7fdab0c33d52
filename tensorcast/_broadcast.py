"""``broadcast`` and ``broadcast_batch``: one batch from a source rank to its peers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorcast import _mesh, _transport
from tensorcast._codec import Packed, resolve_device, unpack

__all__ = ["broadcast", "broadcast_batch"]


_AVAILABLE = dist.is_available()  # fixed by how torch was built


def _require_initialized(what: str) -> None:
    if not (_AVAILABLE and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs torch.distributed: call torch.distributed.init_process_group() "
            f"first (tensorcast.broadcast_batch and BroadcastingDataLoader are no-ops without it)"
        )


def broadcast(
    tree: Any,
    src: int,
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | str | None = None,
) -> Any:
    """Send ``tree`` from rank ``src`` to every rank of ``group``; all return the same tree.

    Every rank of ``group`` calls this. The source packs the tree into a header and one
    buffer and sends both (one message when they are small, two otherwise); receivers
    rebuild the tree as views into the received buffer. Nothing is pickled on any rank.
    Tensor leaves of 2 MiB or more travel from their own memory, each as a broadcast of
    its own, straight into its place in the receivers' buffer; the source copies them for
    its own result while they are on the wire.

    Args:
        tree: the batch on the source rank (a tree or a :class:`Packed`); ignored elsewhere,
            where ``None`` is the usual value.
        src: the source's *global* rank, as in ``torch.distributed.broadcast``.
        group: the process group; None means the default group.
        device: where output tensors land. Defaults to the group's transfer device:
            ``cuda:<current device>`` for NCCL, CPU for gloo. numpy leaves stay on CPU.

    Returns:
        The rebuilt tree, on every rank including the source.

    Raises:
        UnsupportedLeafError: on the source, when the tree holds a leaf that cannot travel.
        SourceError: on receivers, when the source could not encode its tree.
        PeerError: a peer died or did not join within the group's timeout.
    """
    _require_initialized("tensorcast.broadcast")
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    _transport.drain(group)  # a loader pass left early may still owe broadcasts here
    channel = _transport.channel_for_group(group, src)
    dev = resolve_device(device)
    if channel.is_source:
        return channel.send_batch(tree, device=dev)
    kind, value = channel.recv(device=dev)
    return _transport.raise_for(kind, value, src)


def broadcast_batch(
    batch: Any,
    device_mesh: Any,
    axes: Sequence[str] | str = ("cp", "tp"),
    *,
    device: torch.device | str | None = None,
) -> Any:
    """Broadcast ``batch`` across this rank's ``(cp, tp)`` sub-mesh, from its first rank.

    The named axes present in ``device_mesh`` are flattened (once; the groups are reused)
    into one group per DP slot. Returns ``batch`` itself, the very same object, when there
    is nothing to do: ``torch.distributed`` not initialized, ``device_mesh`` None, no named
    axis in the mesh, or every present named axis of size 1.

    Every rank of the mesh must make the first call together (it creates the groups).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return batch
    if not _mesh.spanning_axes(device_mesh, axes):
        return batch
    sub = _mesh.resolve_submesh(device_mesh, axes)
    return broadcast(batch, sub.src, sub.group, device=device)


def unpack_if_packed(batch: Any) -> Any:
    """A pre-packed batch rebuilt as a tree; anything else unchanged."""
    return unpack(batch) if isinstance(batch, Packed) else batch
