"""The device side of a frame: posted on the caller's thread, handed to its stream.

# NOTE [ Device work at next() ]
On a GPU, order is a matter of streams as well as of threads. A lane's worker does host
work only (gloo heads, header checks, packing into pinned staging); everything a frame
does on the GPU (the upload, the NCCL payload, the stream waits) is one
:class:`DevicePart`, posted by the consumer's thread at ``next()`` / ``broadcast()``:
points that are the same on every rank, in lane order. A part's tree is built when it
is posted, and what building refuses (a bad CRC) is kept and raised when it is taken:
a loader posts the next frame's part before it hands this one out, so a frame refused
on one rank only does not keep that rank from posting what its peers post. A trimmed
leaf's re-pad (``codec.repad``) is device work too: it is queued on the part's stream
right after the transfer, before the part's event, into memory taken there. Each group's parts run on a
stream of the group's own (uploads for a host wire, which wait on no peer, on one per
device) that first waits on the caller's current stream, so a part starts after whatever
the caller queued before and overlaps whatever it queues after.
The batch is handed out with an event: the caller's current stream waits on it,
whichever thread did what before, and the buffer is recorded on that stream (it comes
from the caching allocator, so ``record_stream`` works: a consumer that reads on a side
stream and drops the batch cannot have it overwritten), and so is each trimmed leaf
rebuilt on the device. A leaf rebuilt on the host (a trimmed ndarray, or a tree asked
for with ``device="cpu"``) is not: ``record_stream`` takes device memory only, and host
memory written on the caller's thread is the caller's at once.

What a part reads of the device's memory that is not its own (the source's CUDA batch)
is recorded on the transfer stream when posted and not held: the caller may drop it at
once, on any path. What it reads on the host (pinned staging) is held until its event is
seen done on the caller's thread, at a later post or take (:class:`Inflight`), and only
then is a pooled staging buffer reused; nothing of the device's is held there.

Across groups tensorcast adds no order: a slow peer on one group delays only what the
caller's stream takes from that group. NCCL does not promise that kernels of two
communicators progress side by side, so programs whose groups overlap post them in the
same order on every rank, as for the model's own collectives (a loader's ``next()`` and
a ``tensorcast.broadcast`` are such points).

A payload that does not complete within the channel's timeout breaks the lane: the
lane's worker looks at a posted part only once its deadline has passed, so in steady
state it makes no CUDA call at all (a part not seen done keeps it, asleep and holding no
device memory, until then). Its CUDA calls can still fall inside a CUDA graph capture on
the caller's thread (the last part of a one-off broadcast is seen done only at its
deadline), so the worker takes the thread-local capture mode (:func:`apart_from_captures`):
a global-mode capture elsewhere does not count them against it.

The lane's thread makes each part (``transport.staging``: pinned staging, the host block
of the leaves that are not tensors, the payload's collective bound); the caller's thread
posts and takes it (:func:`post`, :func:`hand_out`). :class:`Streams` is the seam:
:class:`CudaStreams` on a GPU, a fake in ``transport.testing`` that records every call.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import datetime
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from tensorcast.transport.lane import Lane

__all__ = [
    "CudaStreams",
    "DevicePart",
    "Inflight",
    "Streams",
    "apart_from_captures",
    "hand_out",
    "post",
    "streams_for",
]

_CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1


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


def apart_from_captures() -> bool:
    """Let the calling thread's CUDA calls ignore graph captures on other threads (the
    thread-local capture mode, which PyTorch's NCCL watchdog also takes for its event
    queries). A lane's worker makes a few at moments of its own (a deadline's event
    query, pinned staging, a ``ready`` event): under a global-mode capture on the
    caller's thread, the default, each would invalidate it. Through the driver's
    ``cuThreadExchangeStreamCaptureMode``; False where the driver cannot be reached."""
    try:
        exchange = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
    except (OSError, AttributeError):
        return False
    mode = ctypes.c_int(_CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    return bool(exchange(ctypes.byref(mode)) == 0)


_streams: dict[torch.device, CudaStreams] = {}
_streams_lock = threading.Lock()


def streams_for(device: torch.device) -> CudaStreams:
    """The one :class:`CudaStreams` of ``device`` in this process, for uploads of host
    payloads (an NCCL group has streams of its own)."""
    with _streams_lock:
        streams = _streams.get(device)
        if streams is None:
            streams = _streams[device] = CudaStreams(device)
        return streams


class Inflight:
    """Device work posted and not yet seen done: the host memory it reads, held until
    then, and its deadline (NOTE [ Device work at next() ]). Filled and emptied on the
    caller's thread (:meth:`add`, :meth:`reap`); the lane's worker only looks at work past
    its deadline (:meth:`overdue`).

    Args:
        watch: called after work is added (the lane's worker then watches deadlines).
    """

    def __init__(self, watch: Callable[[], None] = lambda: None) -> None:
        self._watch = watch
        self._lock = threading.Lock()
        # (deadline, streams, event, holds), in posting order
        self._items: collections.deque[tuple[float, Streams, Any, Any]] = collections.deque()
        # (streams, event, holds) of work no longer watched (see clear)
        self._unwatched: list[tuple[Streams, Any, Any]] = []

    def __len__(self) -> int:
        """The work whose deadline is watched (the lane's worker stays for it)."""
        return len(self._items)

    def add(self, streams: Streams, event: Any, holds: Any, timeout_s: float) -> None:
        with self._lock:
            self._items.append((time.monotonic() + timeout_s, streams, event, holds))
        self._watch()

    def clear(self) -> None:
        """Stop watching deadlines (the lane broke, or its group closed), so the worker
        may leave. What the work reads on the host stays held until seen done: dropped
        now, a pool could hand it out again under a copy still reading it."""
        with self._lock:
            self._unwatched += [item[1:] for item in self._items if item[3] is not None]
            self._items.clear()

    def reap(self) -> None:
        """Let go of the work seen done, oldest first (the device runs it in order)."""
        with self._lock:
            items = self._items
            while items and items[0][1].done(items[0][2]):
                items.popleft()
            if self._unwatched:
                self._unwatched = [u for u in self._unwatched if not u[0].done(u[1])]

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
        build: ``build(buffer)``, the tree of the payload once it is in ``buffer``, and
            the re-pads of its trimmed leaves, run on the transfer stream right after.
        fill: ``fill(buffer)`` writes the payload on the transfer stream (an upload from
            pinned staging, or the source's CUDA batch packed), or None.
        send: ``send(buffer)`` posts the payload's collective and returns its handle,
            whose ``wait`` makes the current stream wait; or None.
        holds: what the work reads on the host, held until it is seen done (staging).
        reads: device tensors of the caller's the work reads (the source's CUDA batch):
            recorded on the transfer stream when posted, then let go.
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
        "_holds",
        "_inflight",
        "_on_error",
        "_outputs",
        "_reads",
        "_ready",
        "_send",
        "_started",
        "_taken",
        "_timeout_s",
        "_tree",
        "nbytes",
        "streams",
    )

    def __init__(
        self,
        streams: Streams,
        nbytes: int,
        build: Callable[..., Any],
        *,
        fill: Callable[[torch.Tensor], Any] | None = None,
        send: Callable[[torch.Tensor], Any] | None = None,
        holds: Any = None,
        reads: tuple[torch.Tensor, ...] = (),
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
        self._holds = holds
        self._reads = reads
        self._ready = ready
        self._buffer = buffer
        self._inflight = inflight
        self._timeout_s = timeout_s
        self._on_error = on_error
        self._event: Any = None
        self._tree: Any = None
        self._error: BaseException | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()  # the trimmed leaves' memory
        self._started = False
        self._taken = False

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
                for tensor in self._reads:  # first: a failure below drops them safely too
                    streams.hand_over(tensor)
                buffer = self._buffer
                if buffer is None:
                    buffer = self._buffer = streams.empty(self.nbytes)
                if self._fill is not None:
                    self._fill(buffer)
                if self._send is not None:  # a stream wait (NOTE [ A stream wait ], wire)
                    self._send(buffer).wait(datetime.timedelta(seconds=self._timeout_s))
                self._make(buffer)
                event = streams.record()
        except BaseException as e:  # nothing of the frame may go on on this rank
            self._on_error(e)
            raise
        self._event = event
        # The buffer is the allocator's, on the transfer stream: only host memory is held.
        self._inflight.add(streams, event, self._holds, self._timeout_s)
        self._fill = self._send = self._holds = self._ready = None
        self._reads = ()

    def _make(self, buffer: torch.Tensor) -> None:
        """Build the tree (on the transfer stream, after the transfer), and queue its
        trimmed leaves' re-pads there; what building raised is this step's alone, kept
        for :meth:`take`."""
        repads: list[Any] = []
        try:
            self._tree, repads = self._build(buffer)
            for repad in repads:
                repad()
        except Exception as e:  # a refusal of this step: a bad CRC, bad values
            self._error = e
            self._tree = None
        else:  # record_stream takes the device's own memory only: a host output (a
            # trimmed ndarray, a tree asked for on the CPU) is the caller's at once
            kind = self.streams.device.type
            self._outputs = tuple(r.out for r in repads if r.out.device.type == kind)
        self._build = None  # type: ignore[assignment]

    def take(self) -> Any:
        """The batch, for the caller's current stream: posts the work if not yet done,
        makes the stream wait on it and hands the memory over (once; what building
        raised, a bad CRC or bad values, is raised again by a later call)."""
        self.post()
        if not self._taken:
            buffer = self._buffer
            assert buffer is not None
            self.streams.wait(self._event)
            self.streams.hand_over(buffer)
            for out in self._outputs:  # made on the transfer stream, read on this one
                self.streams.hand_over(out)
            self._outputs = ()
            self._inflight.reap()  # what is done by now goes now (a one-off broadcast's)
            self._taken = True
        if self._error is not None:
            raise self._error
        return self._tree


def hand_out(value: Any, lane: Lane, ahead: Callable[[], None] | None = None) -> Any:
    """What a job returned, as the caller gets it: a frame's device part is posted (if it
    was not yet) and taken for the caller's current stream; anything else as it is. Only
    on the caller's thread, in lane order. ``ahead`` posts what comes next (a loader's
    next frame) after this part and before its tree is built: a build refused on this
    rank alone then skips no post its peers make (NOTE [ Device work at next() ])."""
    if isinstance(value, DevicePart):
        if lane.broken is not None:
            lane.check()
        if ahead is not None:
            value.post()
            ahead()
        return value.take()
    return value


def post(value: Any) -> None:
    """Post a frame's device part ahead of its hand-out (a loader's ``prefetch``)."""
    if isinstance(value, DevicePart):
        value.post()
