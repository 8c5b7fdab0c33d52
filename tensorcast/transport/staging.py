"""The device parts of frames, made on the lane's thread (NOTE [ Device work at next() ]).

A side of a channel whose payloads travel on a GPU, or whose caller asked for GPU
tensors, hands the caller a :class:`~tensorcast.transport.device.DevicePart` instead of a
tree. :class:`Staging` makes them: it stages a source's host batch in pinned memory (a
pool of a few buffers, reused once their upload is seen done), records when a CUDA batch
made on this thread is ready, puts the leaves that are not tensors in their host block
(``codec.views``), and binds the payload's collective for the caller's thread to post.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from typing import Any

import torch

from tensorcast.codec import packed as _codec
from tensorcast.codec import schema as _schema
from tensorcast.codec import views as _views
from tensorcast.codec.packed import Packed
from tensorcast.transport.device import DevicePart, Streams, streams_for
from tensorcast.transport.groups import Group
from tensorcast.transport.pool import BufferPool

__all__ = ["Staged", "Staging"]

_CPU = torch.device("cpu")
#: pinned staging buffers kept per side: one per frame between its packing and its
#: upload's end, a few frames deep
STAGING_BUFFERS = 4

#: a device part, the host copy of its payload (None: on the GPU already), and the host
#: block of its leaves that are not tensors (None: every leaf is a tensor)
Staged = tuple[DevicePart, torch.Tensor | None, torch.Tensor | None]


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
        on_error: called with what posting a payload raised (it breaks the lane).
    """

    def __init__(self, group: Group, root: int, on_error: Callable[[BaseException], None]) -> None:
        self._group = group
        self._root = root
        self._on_error = on_error
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
        self, encoded: _codec.Encoded, device: torch.device | None, timeout: datetime.timedelta
    ) -> Staged:
        """A source's tree: packed into pinned staging here when it is on the host, else
        (a CUDA batch) packed on the transfer stream when posted."""
        streams = self._streams
        pool = self._pool(streams)
        n = encoded.nbytes
        block = None
        if encoded.layout.write_spec.others:
            spec = encoded.layout.write_spec
            block = encoded.host_block(pool.take(spec.host_nbytes, _CPU))
        own = functools.partial(encoded.device_tree, host=block)
        if encoded.device.type == "cpu":
            staging = pool.take(n, _CPU)
            with torch.no_grad():
                encoded.write(staging)
            fill = _upload_from(staging)
            return self.part(n, own, device, timeout, fill=fill, kept=staging), staging, block

        def write(buffer: torch.Tensor) -> None:
            with torch.no_grad():
                encoded.write(buffer, others=False)
            if block is not None:
                encoded.upload_others(buffer, block)

        ready = streams.record()  # the batch was made on this thread's stream
        kept = (encoded, block)
        return self.part(n, own, device, timeout, fill=write, kept=kept, ready=ready), None, block

    def prepacked(
        self,
        batch: Packed,
        decoded: _schema.Decoded,
        device: torch.device | None,
        timeout: datetime.timedelta,
    ) -> Staged:
        """A source's :class:`Packed`: a host buffer through pinned staging, a buffer on
        the wire's device as it is (its views are this rank's tree)."""
        streams = self._streams
        pool = self._pool(streams)
        buffer, n = batch.buffer, decoded.nbytes
        spec = _views.view_spec(decoded)
        block = None
        if spec.others:
            out = pool.take(spec.host_nbytes, _CPU)
            # A GPU buffer's other leaves come back to the host once, here (a sync).
            block = _views.host_block(spec, buffer if buffer.is_cpu else buffer.cpu(), out)
        build = functools.partial(_codec.rebuild, decoded, host=block)
        if buffer.is_cpu:
            staging = pool.take(n, _CPU).copy_(buffer)
            fill = _upload_from(staging)
            return self.part(n, build, device, timeout, fill=fill, kept=staging), staging, block
        ready = streams.record()  # the buffer was made on this thread's stream
        if buffer.is_inference() or buffer.device != streams.device:
            fill = _upload_from(buffer)
            part = self.part(n, build, device, timeout, fill=fill, kept=buffer, ready=ready)
        else:
            part = self.part(n, build, device, timeout, buffer=buffer, ready=ready)
        return part, None, block

    def part(
        self,
        n: int,
        build: Callable[[torch.Tensor], Any],
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
        return DevicePart(
            streams,
            n,
            build,
            send=(lambda buffer: wire.payload(buffer, root, timeout)) if n else None,
            inflight=self._group.lane.inflight,
            timeout_s=timeout.total_seconds(),
            on_error=self._on_error,
            **work,
        )

    def upload(
        self,
        payload: torch.Tensor,
        device: torch.device,
        build: Callable[[torch.Tensor], Any],
        timeout: datetime.timedelta,
    ) -> DevicePart:
        """This rank's tree of a host payload, on ``device`` (a host wire's caller asked
        for CUDA tensors): through pinned staging here, uploaded when posted."""
        streams = streams_for(device)
        staging = self._pool(streams).take(payload.numel(), _CPU).copy_(payload)
        return DevicePart(
            streams,
            payload.numel(),
            build,
            fill=_upload_from(staging),
            kept=staging,
            inflight=self._group.lane.inflight,
            timeout_s=timeout.total_seconds(),
            on_error=_local,
        )


def _on_device(build: Callable[[torch.Tensor], Any], device: torch.device) -> Any:
    """``build``, its tree made from a copy of the buffer on ``device`` (asked for)."""
    return lambda buffer: build(buffer.to(device))
