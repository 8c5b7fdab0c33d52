"""``broadcast`` and ``broadcast_batch``: one batch from a source rank to its peers.

Both run one job on the lane of tensorcast's own group over the caller's ranks (see
NOTE [ One ordered lane ]): the caller's group (or mesh) only says which ranks; nothing
travels on it.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tensorcast._errors import SourceError
from tensorcast.codec.packed import Packed, resolve_device, unpack
from tensorcast.loader import mesh as _mesh
from tensorcast.transport import groups as _groups
from tensorcast.transport.agreement import ranks_name
from tensorcast.transport.channel import Channel, group_ranks, open_channel
from tensorcast.transport.frame import Kind

__all__ = [
    "broadcast",
    "broadcast_batch",
    "mesh_channel",
    "output_device",
    "to_timedelta",
    "unpack_if_packed",
]

_AVAILABLE = dist.is_available()  # fixed by how torch was built
_ATTR = "_tensorcast_channels"  # on a mesh: its channels by axes
_lock = threading.Lock()


def to_timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return datetime.timedelta(seconds=timeout)


def _raise_for(kind: Kind, value: Any, src: int) -> None:
    """Raise the ``SourceError`` a received END or ERROR frame stands for."""
    if kind == Kind.ERROR:
        raise SourceError(f"source rank {src} reported: {value}")
    raise SourceError(f"source rank {src} ended the stream where a batch was expected")


def output_device(device: torch.device | str | int | None) -> torch.device | None:
    """Where output tensors land: ``device`` normalised, a bare ``"cuda"`` meaning this
    rank's GPU: the one ``init_process_group(device_id=)`` bound, else the current one."""
    if device is None:
        return None
    dev = torch.device(device) if not isinstance(device, int) else None
    if dev is not None and dev.type == "cuda" and dev.index is None and _initialized():
        bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
        if bound is not None and bound.type == "cuda":
            return resolve_device(bound)
    return resolve_device(device)


def _initialized() -> bool:
    return _AVAILABLE and dist.is_initialized()


def broadcast(
    tree: Any,
    src: int,
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | str | None = None,
    timeout: float | datetime.timedelta | None = None,
) -> Any:
    """Send ``tree`` from rank ``src`` to every rank of ``group``; all return the same tree.

    Every rank of ``group`` calls this, in the same order as its other tensorcast calls
    on those ranks. The source packs the tree into a header and one buffer; receivers
    rebuild it as views into the buffer they received. Nothing is pickled on any rank,
    and nothing travels on ``group`` itself: tensorcast sends on its own group over the
    same ranks, made (with an agreement among the ranks) the first time a ``(group,
    src)`` pair is used.

    Args:
        tree: the batch on the source rank (a tree or a :class:`Packed`); ignored elsewhere,
            where ``None`` is the usual value.
        src: the source's *global* rank, as in ``torch.distributed.broadcast``.
        group: the ranks to reach; None means every rank.
        device: where output tensors land. Defaults to the group's transfer device:
            ``cuda:<current device>`` for NCCL, CPU for gloo. numpy leaves stay on CPU.
        timeout: seconds (or a timedelta) to wait for a peer; None means the default
            process group's timeout.

    Returns:
        The rebuilt tree, on every rank including the source.

    Raises:
        UnsupportedLeafError: on the source, when the tree holds a leaf that cannot travel.
        SourceError: on receivers, when the source could not encode its tree.
        DesyncError: the ranks disagree on ``src`` the first time it is used.
        PeerError: a peer died or did not answer within the timeout.
    """
    if not (_AVAILABLE and dist.is_initialized()):
        raise RuntimeError(
            "tensorcast.broadcast needs torch.distributed: call "
            "torch.distributed.init_process_group() first (tensorcast.broadcast_batch and "
            "BroadcastingDataLoader are no-ops without it)"
        )
    wait = None if timeout is None else to_timedelta(timeout)
    dev = None if device is None else output_device(device)
    channel = _broadcast_channel(group, src, wait)
    return _run(channel, tree, dev, wait)


def _run(
    channel: Channel, tree: Any, device: torch.device | None, wait: datetime.timedelta | None
) -> Any:
    """One frame on the channel's lane, then handed out on this thread."""
    lane = channel.group.lane
    frames = functools.partial(getattr, channel, "step")  # read by the lane: no call in here
    if channel.is_source:
        own = lane.run(functools.partial(channel.send_batch, tree, device, wait), frames)
        return channel.hand_out(own)
    kind, value = lane.run(functools.partial(channel.recv, device, wait), frames)
    if kind != Kind.DATA:
        _raise_for(kind, value, channel.src)
    return channel.hand_out(value)


# The (group, src) broadcast was last called with, under which default group, and its
# channel: a training loop calls with the same arguments every step, and the lookup below
# (the group's ranks, tensorcast's state) is most of a tiny batch's cost on a receiver.
# Weak references: a destroyed group is not kept alive by it.
_last: tuple[Any, int, Any, Any] | None = None


def _broadcast_channel(group: Any, src: int, setup: datetime.timedelta | None = None) -> Channel:
    global _last
    default = dist.distributed_c10d._get_default_group()
    last = _last
    if (
        last is not None
        and last[1] == src
        and last[2]() is default
        and (last[0] is None if group is None else last[0] is not None and last[0]() is group)
        and (hit := last[3]()) is not None
    ):
        return hit  # type: ignore[no-any-return]
    ranks = group_ranks(group, src)
    world = _groups.world()
    key = (ranks, src)
    channel = world.broadcast_channels.get(key)
    if channel is None:
        what = f"tensorcast.broadcast(src={src})"
        # The call's timeout bounds this setup; later calls give their own for messages.
        channel, _ = open_channel(
            ranks_name(ranks), ranks, src, what, {"src": src}, setup_timeout=setup
        )
        world.broadcast_channels[key] = channel
    # The channel too, weakly: it lives with its world, which goes with the default group.
    _last = (
        None if group is None else weakref.ref(group),
        src,
        weakref.ref(default),
        weakref.ref(channel),
    )
    return channel  # type: ignore[no-any-return]


def mesh_channel(
    device_mesh: Any,
    axes: tuple[str, ...],
    what: str,
    setup: dict[str, Any],
    *,
    extra: dict[str, Any] | None = None,
    timeout: datetime.timedelta | None = None,
    setup_timeout: datetime.timedelta | None = None,
    verify: bool = False,
) -> tuple[Channel, dict[int, dict[str, Any]]]:
    """A channel over this rank's flattened sub-mesh of ``axes``, from its first rank.

    Every rank of the mesh calls this together: the ranks of each sub-mesh agree on
    ``setup`` (with the mesh's shape, rank layout and the axes), numbered among the
    mesh's ranks, and each sub-mesh gets tensorcast's group over its ranks.
    """
    spanning = _mesh.spanning_axes(device_mesh, axes)
    rows = _mesh.submesh_rows(device_mesh, spanning)
    rank = dist.get_rank()
    mine = next((r for r in rows if rank in r), None)
    if mine is None:
        raise ValueError(f"rank {rank} is not part of the device mesh {device_mesh}")
    layout = device_mesh.mesh.to(torch.int64).contiguous().numpy().tobytes()
    full = {
        **setup,
        "axes": list(axes),
        "mesh": [list(device_mesh.mesh_dim_names), list(device_mesh.mesh.shape)],
        "layout": hashlib.blake2b(layout, digest_size=8).hexdigest(),
    }
    everyone = sorted(r for row in rows for r in row)
    return open_channel(
        ranks_name(everyone),
        mine,
        mine[0],
        what,
        full,
        extra=extra,
        timeout=timeout,
        setup_timeout=setup_timeout,
        first=(everyone[0], len(everyone)) if len(rows) > 1 else None,
        verify=verify,
    )


def broadcast_batch(
    batch: Any,
    device_mesh: Any,
    axes: Sequence[str] | str = ("cp", "tp"),
    *,
    device: torch.device | str | None = None,
    timeout: float | datetime.timedelta | None = None,
) -> Any:
    """Broadcast ``batch`` across this rank's ``(cp, tp)`` sub-mesh, from its first rank.

    The named axes present in ``device_mesh`` are flattened into one group per DP slot
    (tensorcast's own, made on the first call and reused). Returns ``batch`` itself, the
    very same object, when there is nothing to do: ``torch.distributed`` not initialized,
    ``device_mesh`` None, no named axis in the mesh, or every present named axis of size 1.
    A mesh without dimension names is a ``TypeError``; axes that miss a mesh with another
    dimension of size > 1 (not data- or pipeline-parallel) warn once per process.

    Every rank of the mesh must make the first call together (it sets up the groups).
    ``timeout`` (seconds or a timedelta) bounds every wait of the call, the first call's
    setup included; None means the default process group's timeout.
    """
    wait = to_timedelta(timeout)
    if not _initialized():
        return batch
    names = _mesh.normalize_axes(axes)
    if not _mesh.spanning_axes(device_mesh, names, what="tensorcast.broadcast_batch", stacklevel=2):
        return batch
    dev = output_device(device)
    world = _groups.world()
    with _lock:
        cache: dict[tuple[str, ...], tuple[Any, Channel]] = device_mesh.__dict__.setdefault(
            _ATTR, {}
        )
        hit = cache.get(names)
    if hit is None or hit[0]() is not world:
        channel, _ = mesh_channel(
            device_mesh, names, "tensorcast.broadcast_batch", {}, setup_timeout=wait
        )
        with _lock:
            cache[names] = (weakref.ref(world), channel)
    else:
        channel = hit[1]
    return _run(channel, batch, dev, wait)


def unpack_if_packed(batch: Any) -> Any:
    """A pre-packed batch rebuilt as a tree; anything else unchanged."""
    return unpack(batch) if isinstance(batch, Packed) else batch
