"""The device side of a frame: posted on the caller's thread, handed to its stream.

# NOTE [ Device work at next() ]
On a GPU, order is a matter of streams as well as of threads. A lane's worker does host
work only (gloo heads, header checks, packing into pinned staging); everything a frame
does on the GPU (the upload, the NCCL payload, the stream waits) is one
:class:`DevicePart`, posted by the consumer's thread at ``next()`` / ``broadcast()``:
points that are the same on every rank, in lane order. It runs on a stream tensorcast
owns that first waits on the caller's current stream, so it starts after whatever the
caller queued before (the same collectives on every rank: no cross-communicator cycle),
and overlaps whatever the caller queues after. The batch is handed out with an event:
the caller's current stream waits on it, whichever thread did what before, and the
buffer is recorded on that stream (it comes from the caching allocator, so
``record_stream`` works: a consumer that reads on a side stream and drops the batch
cannot have it overwritten). What the work reads (pinned staging, the source's batch) is
held until its event is seen done, on the caller's thread; a pooled staging buffer is
reused only then (:class:`Inflight`).

A payload that does not complete within the channel's timeout breaks the lane: the
lane's worker looks at a posted part only once its deadline has passed, so in steady
state it makes no CUDA call at all.

The lane's thread makes each part (:class:`Staging`: pinned staging, the host block of
the leaves that are not tensors, the payload's collective bound); the caller's thread
posts and takes it (:func:`post`, :func:`hand_out`). :class:`Streams` is the seam:
:class:`CudaStreams` on a GPU, a fake in ``transport.testing`` that records every call.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tensorcast.codec import Decoded, Encoded, Packed
from tensorcast.transport.pool import BufferPool

if TYPE_CHECKING:
    from tensorcast.transport.groups import Group
    from tensorcast.transport.lane import Lane

__all__ = [
    "CudaStreams",
    "DevicePart",
    "Inflight",
    "Staging",
    "Streams",
    "hand_out",
    "post",
    "streams_for",
]


class Streams(Protocol):
    """The stream operations of one device, as the device side of a frame uses them."""

    device: torch.device

    def transfer(self) -> contextlib.AbstractContextManager[None]:
        """Run the block on tensorcast's stream, after it waited on the current stream."""
        ...

    def empty(self, nbytes: int) -> torch.Tensor:
        """A fresh uint8 buffer on the device (the caching allocator's)."""
        ...

    def host(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer the device copies from asynchronously (pinned)."""
        ...

    def record(self) -> Any:
        """An event recorded on the current stream."""
        ...

    def wait(self, event: Any) -> None:
        """The current stream waits on ``event`` (the host does not)."""
        ...

    def hand_over(self, tensor: torch.Tensor) -> None:
        """``tensor`` is used on the current stream from now on (``record_stream``)."""
        ...

    def done(self, event: Any) -> bool:
        """Whether ``event`` has completed (asks the device; never waits)."""
        ...


class CudaStreams:
    """:class:`Streams` of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None  # made on first use, on the caller's thread

    @contextlib.contextmanager
    def transfer(self) -> Iterator[None]:
        with torch.cuda.device(self.device):
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                yield

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def hand_over(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(torch.cuda.current_stream(self.device))

    def done(self, event: Any) -> bool:
        return bool(event.query())


_streams: dict[torch.device, CudaStreams] = {}
_streams_lock = threading.Lock()


def streams_for(device: torch.device) -> CudaStreams:
    """The one :class:`CudaStreams` of ``device`` in this process."""
    with _streams_lock:
        streams = _streams.get(device)
        if streams is None:
            streams = _streams[device] = CudaStreams(device)
        return streams


class Inflight:
    """Device work posted and not yet seen done: what it reads, held until then, and its
    deadline. Filled and emptied on the caller's thread (:meth:`add`, :meth:`reap`); the
    lane's worker only looks at work past its deadline (:meth:`overdue`).

    Args:
        watch: called after work is added (the lane's worker then watches deadlines).
    """

    def __init__(self, watch: Callable[[], None] = lambda: None) -> None:
        self._watch = watch
        self._lock = threading.Lock()
        # (deadline, streams, event, kept), in posting order
        self._items: collections.deque[tuple[float, Streams, Any, Any]] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def add(self, streams: Streams, event: Any, kept: Any, timeout_s: float) -> None:
        with self._lock:
            self._items.append((time.monotonic() + timeout_s, streams, event, kept))
        self._watch()

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def reap(self) -> None:
        """Let go of the work seen done, oldest first (the device runs it in order)."""
        with self._lock:
            items = self._items
            while items and items[0][1].done(items[0][2]):
                items.popleft()

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((item[0] for item in self._items), default=None)

    def overdue(self) -> float | None:
        """How late the oldest work past its deadline and not done is (seconds), else None;
        asks the device only about such work."""
        now = time.monotonic()
        with self._lock:
            for deadline, streams, event, _ in self._items:
                if deadline <= now and not streams.done(event):
                    return now - deadline
            while self._items and self._items[0][0] <= now:
                self._items.popleft()  # past its deadline, and done
        return None


class DevicePart:
    """The device side of one frame (NOTE [ Device work at next() ]).

    Args:
        streams: the device's streams.
        nbytes: the payload's size.
        build: ``build(buffer)``, the tree of the payload once it is in ``buffer``.
        fill: ``fill(buffer)`` writes the payload on the transfer stream (an upload from
            pinned staging, or the source's CUDA batch packed), or None.
        send: ``send(buffer)`` posts the payload's collective and returns its handle,
            whose ``wait`` makes the current stream wait; or None.
        kept: what the work reads, held until it is seen done (staging, the batch).
        ready: an event the work waits on first (a batch made on the lane's worker).
        buffer: the destination when it exists already (a source's own CUDA buffer).
        inflight: where the posted work is held until done; ``timeout_s`` its deadline.
        on_error: called with what posting raised (it breaks the lane), before it is raised.
    """

    __slots__ = (
        "_buffer",
        "_build",
        "_error",
        "_event",
        "_fill",
        "_inflight",
        "_kept",
        "_on_error",
        "_ready",
        "_send",
        "_started",
        "_timeout_s",
        "_tree",
        "nbytes",
        "streams",
    )

    def __init__(
        self,
        streams: Streams,
        nbytes: int,
        build: Callable[[torch.Tensor], Any],
        *,
        fill: Callable[[torch.Tensor], Any] | None = None,
        send: Callable[[torch.Tensor], Any] | None = None,
        kept: Any = None,
        ready: Any = None,
        buffer: torch.Tensor | None = None,
        inflight: Inflight,
        timeout_s: float,
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.streams = streams
        self.nbytes = nbytes
        self._build = build
        self._fill = fill
        self._send = send
        self._kept = kept
        self._ready = ready
        self._buffer = buffer
        self._inflight = inflight
        self._timeout_s = timeout_s
        self._on_error = on_error
        self._event: Any = None
        self._tree: Any = None
        self._error: BaseException | None = None
        self._started = False

    @property
    def posted(self) -> bool:
        return self._event is not None

    def post(self) -> None:
        """Queue the frame's device work (once), on the caller's thread."""
        if self._event is not None:
            return
        if self._started:  # an interrupt in the middle: what it posted is not known
            error = RuntimeError("posting a frame's device work was interrupted half-way")
            self._on_error(error)
            raise error
        streams = self.streams
        self._inflight.reap()
        self._started = True
        try:
            with streams.transfer():
                if self._ready is not None:
                    streams.wait(self._ready)
                buffer = self._buffer
                if buffer is None:
                    buffer = self._buffer = streams.empty(self.nbytes)
                if self._fill is not None:
                    self._fill(buffer)
                if self._send is not None:  # its wait makes this stream wait, not the host
                    self._send(buffer).wait(datetime.timedelta(seconds=self._timeout_s))
                event = streams.record()
        except BaseException as e:  # nothing of the frame may go on on this rank
            self._on_error(e)
            raise
        self._event = event
        # Held until the device is done with them: pinned staging is reused only then.
        self._inflight.add(streams, event, (self._kept, buffer), self._timeout_s)
        self._fill = self._send = self._kept = self._ready = None

    def take(self) -> Any:
        """The batch, for the caller's current stream: posts the work if not yet done,
        makes the stream wait on it, and builds the tree (once; what building raised, a
        bad CRC or bad values, is raised again by a later call)."""
        self.post()
        if self._build is not None:
            buffer = self._buffer
            assert buffer is not None
            self.streams.wait(self._event)
            self.streams.hand_over(buffer)
            try:
                self._tree = self._build(buffer)
            except Exception as e:  # a refusal of this step (an interrupt: built again)
                self._error = e
            self._build = None  # type: ignore[assignment]
        if self._error is not None:
            raise self._error
        return self._tree


def hand_out(value: Any, lane: Lane) -> Any:
    """What a job returned, as the caller gets it: a frame's device part is posted (if it
    was not yet) and taken for the caller's current stream; anything else as it is. Only
    on the caller's thread, in lane order."""
    if isinstance(value, DevicePart):
        if lane.broken is not None:
            lane.check()
        return value.take()
    return value


def post(value: Any) -> None:
    """Post a frame's device part ahead of its hand-out (a loader's ``prefetch``)."""
    if isinstance(value, DevicePart):
        value.post()


# -- the lane's thread: device parts made ------------------------------------------

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
        build = functools.partial(decoded.rebuild, host=block)
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
        if n:
            work["send"] = lambda buffer: wire.payload(buffer, root, timeout)
        return self._part(streams, n, build, timeout, self._on_error, **work)

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
        fill = _upload_from(staging)
        return self._part(streams, payload.numel(), build, timeout, _local, fill=fill, kept=staging)

    def _part(
        self,
        streams: Streams,
        n: int,
        build: Callable[[torch.Tensor], Any],
        timeout: datetime.timedelta,
        on_error: Callable[[BaseException], None],
        **work: Any,
    ) -> DevicePart:
        inflight, timeout_s = self._group.lane.inflight, timeout.total_seconds()
        return DevicePart(
            streams, n, build, inflight=inflight, timeout_s=timeout_s, on_error=on_error, **work
        )


def _on_device(build: Callable[[torch.Tensor], Any], device: torch.device) -> Any:
    """``build``, its tree made from a copy of the buffer on ``device`` (asked for)."""
    return lambda buffer: build(buffer.to(device))
