"""The device parts of frames, made on the lane's thread: which memory each one reads.

The caller's thread posts a frame's :class:`~tensorcast.transport.device.DevicePart` and
takes it (NOTE [ Device work at next() ] in ``transport.device``); the lane's thread makes
it here, with what the part will read: a CPU batch packed into pooled pinned staging (host
memory, held until the part is seen done), the host block of the leaves that are not
tensors, a CUDA batch's own tensors (recorded on the transfer stream when posted, never
held), and the payload's collective bound to the group's wire. Kept apart from the
posting side because it runs on the other thread, and owns the pinned pools.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tensorcast.codec import Decoded, Encoded, Packed
from tensorcast.transport.device import DevicePart, Streams, streams_for
from tensorcast.transport.pool import BufferPool

if TYPE_CHECKING:
    from tensorcast.transport.groups import Group

__all__ = ["STAGING_BUFFERS", "Staging"]

_CPU = torch.device("cpu")
#: pinned staging buffers kept per side: one per frame between its packing and its
#: upload's end, a few frames deep
STAGING_BUFFERS = 4

#: a part, its payload's host copy (None: on the GPU), its host block (None: no leaf else)
_Staged = tuple[DevicePart, torch.Tensor | None, torch.Tensor | None]


def _upload_from(source: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    """A fill that copies ``source`` into the buffer, on the transfer stream."""
    return lambda buffer: buffer.copy_(source, non_blocking=True)


def _local(error: BaseException) -> None:
    """A failure of this rank's own copy, raised as it is (the frame went out whole)."""


class Staging:
    """The device parts of one side of a channel on ``group``.

    Args:
        group: tensorcast's group; its wire's ``streams`` (None on a host wire) are where
            payloads travel, and its lane holds posted work until done.
        root: the source's group-local rank.
        on_error: called with what posting a payload raised (it breaks the lane); a bound
            method is held weakly (its object owns this).
    """

    def __init__(self, group: Group, root: int, on_error: Callable[[BaseException], None]) -> None:
        self._group = group
        self._root = root
        # A method of the side that owns this is held weakly: a strong reference would make
        # a cycle, kept (with the side's shared-memory arena) until the garbage collector runs.
        self._on_error: Callable[[], Callable[[BaseException], None] | None] = (
            weakref.WeakMethod(on_error) if inspect.ismethod(on_error) else lambda: on_error
        )
        self._pools: dict[torch.device, BufferPool] = {}  # pinned staging, per GPU

    def _pool(self, streams: Streams) -> BufferPool:
        pool = self._pools.get(streams.device)
        if pool is None:
            pool = self._pools[streams.device] = BufferPool(
                max_buffers=STAGING_BUFFERS, allocate=streams.host
            )
        return pool

    @property
    def _streams(self) -> Streams:
        streams = self._group.wire.streams
        assert streams is not None, "a device part needs a device wire"
        return streams

    def packed(
        self, encoded: Encoded, device: torch.device | None, timeout: datetime.timedelta
    ) -> _Staged:
        """A source's tree: packed into pinned staging here when it is on the host, else
        (a CUDA batch) packed on the transfer stream when posted."""
        streams = self._streams
        pool = self._pool(streams)
        n = encoded.nbytes
        block = None
        host_nbytes = encoded.host_nbytes
        if host_nbytes is not None:
            block = encoded.host_block(pool.take(host_nbytes, _CPU))
        own = functools.partial(encoded.device_tree, host=block)
        if encoded.device.type == "cpu":
            staging = pool.take(n, _CPU)
            with torch.no_grad():
                encoded.write(staging)
            fill = _upload_from(staging)
            return self.part(n, own, device, timeout, fill=fill, holds=staging), staging, block

        def write(buffer: torch.Tensor) -> None:
            with torch.no_grad():
                encoded.write(buffer, others=False)
            if block is not None:
                encoded.upload_others(buffer, block)

        ready = streams.record()  # the batch was made on this thread's stream
        reads = encoded.tensors
        work: dict[str, Any] = {"fill": write, "holds": block, "reads": reads, "ready": ready}
        return self.part(n, own, device, timeout, **work), None, block

    def prepacked(
        self,
        batch: Packed,
        decoded: Decoded,
        device: torch.device | None,
        timeout: datetime.timedelta,
    ) -> _Staged:
        """A source's :class:`Packed`: a host buffer through pinned staging, a buffer on
        the wire's device as it is (its views are this rank's tree)."""
        streams = self._streams
        pool = self._pool(streams)
        buffer, n = batch.buffer, decoded.nbytes
        block = None
        host_nbytes = decoded.host_nbytes
        if host_nbytes is not None:
            out = pool.take(host_nbytes, _CPU)
            # A GPU buffer's other leaves come back to the host once, here (a sync).
            block = decoded.host_block(buffer if buffer.is_cpu else buffer.cpu(), out)
        build = functools.partial(decoded.rebuild_later, host=block)
        if buffer.is_cpu:
            staging = pool.take(n, _CPU).copy_(buffer)
            fill = _upload_from(staging)
            return self.part(n, build, device, timeout, fill=fill, holds=staging), staging, block
        ready = streams.record()  # the buffer was made on this thread's stream
        work: dict[str, Any] = {"reads": (buffer,), "ready": ready}
        if buffer.is_inference() or buffer.device != streams.device:
            work["fill"] = _upload_from(buffer)
        else:
            work["buffer"] = buffer
        return self.part(n, build, device, timeout, **work), None, block

    def part(
        self,
        n: int,
        build: Callable[..., Any],
        device: torch.device | None,
        timeout: datetime.timedelta,
        **work: Any,
    ) -> DevicePart:
        """The device side of a frame of ``n`` payload bytes on the wire's device:
        ``work`` fills the buffer (on the source), then the payload's collective moves
        it; ``build`` makes this rank's tree of it, moved to ``device`` when asked."""
        streams = self._streams
        wire, root = self._group.wire, self._root
        if device is not None and device != streams.device:
            build = _on_device(build, device)
        if n:
            work["send"] = lambda buffer: wire.payload(buffer, root, timeout)
        on_error = self._on_error()
        assert on_error is not None, "called by the side that owns it, which is alive"
        return self._part(streams, n, build, timeout, on_error, **work)

    def upload(
        self,
        payload: torch.Tensor,
        device: torch.device,
        coded: Encoded | Decoded,
        timeout: datetime.timedelta,
    ) -> DevicePart:
        """This rank's tree of a host payload (``coded`` says what it holds: the source's
        encoded batch, or a decoded header), on ``device``: a host wire's caller asked for
        CUDA tensors. Through pinned staging here, uploaded when posted; the leaves that
        are not tensors are read from a host block made here, as they are on the host
        already (from the device they would come back one by one, each a sync)."""
        n = coded.host_nbytes
        out = None if n is None else torch.empty(n, dtype=torch.uint8)
        if isinstance(coded, Encoded):
            host = None if out is None else coded.host_block(out)
            build = functools.partial(coded.device_tree, host=host)
        else:
            host = None if out is None else coded.host_block(payload, out)
            build = functools.partial(coded.rebuild_later, host=host)
        streams = streams_for(device)
        staging = self._pool(streams).take(payload.numel(), _CPU).copy_(payload)
        fill = _upload_from(staging)
        return self._part(
            streams, payload.numel(), build, timeout, _local, fill=fill, holds=staging
        )

    def _part(
        self,
        streams: Streams,
        n: int,
        build: Callable[..., Any],
        timeout: datetime.timedelta,
        on_error: Callable[[BaseException], None],
        **work: Any,
    ) -> DevicePart:
        inflight, timeout_s = self._group.lane.inflight, timeout.total_seconds()
        return DevicePart(
            streams, n, build, inflight=inflight, timeout_s=timeout_s, on_error=on_error, **work
        )


def _on_device(build: Callable[..., Any], device: torch.device) -> Any:
    """``build``, its tree made from a copy of the buffer on ``device`` (asked for)."""
    return lambda buffer: build(buffer.to(device))
