"""Fakes of the transport's seams, for tests: an in-memory wire, device streams and a
counting store.

:class:`FakeWire` is an in-memory :class:`~tensorcast.transport.wire.Wire`: two ranks,
one process. ``FakeWire.pair(streams=True)`` gives each end :class:`FakeStreams`, NCCL's
contract on the host: payloads then travel as device payloads do (posted by the
caller's thread at ``next()``, NOTE [ Device work at next() ]), and every device call is
recorded with the thread that made it. :class:`DeviceTap` does the same to a real wire
(``groups.wrapping_wires(DeviceTap)``), so a multi-process gloo test runs the device path
end to end.

They ship with the transport, so tests and anyone extending the transport fake
the same interface the real wires implement, and pass it in instead of patching a wire::

    source_wire, receiver_wire = FakeWire.pair()
    sender = Sender(Group((0, 1), source_wire, Lane("0-1", source_wire.abort)), 0)

or, for the two roles of one channel on such a pair, :func:`fake_roles`.

Messages are matched as gloo matches them: heads (a send and its receive) in their
order, payloads (broadcasts) in theirs. The source is group rank 0; its messages go at
once, and a receiver's arrives when it is waited for (run the receiver in a thread, as
it would run on its own rank).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from tensorcast.transport.receiver import Receiver
    from tensorcast.transport.sender import Sender
    from tensorcast.transport.wire import Wire

__all__ = ["CountingStore", "DeviceTap", "FakeEvent", "FakeStreams", "FakeWire", "fake_roles"]


class FakeEvent:
    """An event of :class:`FakeStreams`: done at once, unless its streams hold events."""

    __slots__ = ("done",)

    def __init__(self, done: bool) -> None:
        self.done = done


class FakeStreams:
    """:class:`~tensorcast.transport.device.Streams` on the host, recording every call.

    Attributes:
        calls: ``(operation, thread name)`` of every call, in order; a payload posted
            through a wire with these streams is ``"payload"``.
        hold: events recorded while set stay not done until :meth:`release` (device
            work that never finishes: a dead peer).
        buffers: every buffer :meth:`empty` made, weakly (which ones something holds).
        handed: every tensor handed over, weakly, and whether on the transfer stream
            (inside :meth:`transfer`: a tensor the work reads, recorded there).

    What CUDA refuses, these refuse: :meth:`hand_over` of a tensor off the streams'
    device. A subclass whose ``device`` is ``meta`` (and whose :meth:`empty` makes
    ``meta`` memory) is a device the host cannot read: a copy back from it, a host sync
    on a GPU, raises there, so a test that runs through it counts none.
    """

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.hold = False
        self.buffers: list[weakref.ref[torch.Tensor]] = []
        self.handed: list[tuple[weakref.ref[torch.Tensor], bool]] = []
        self._held: list[FakeEvent] = []
        self._local = threading.local()
        self._lock = threading.Lock()

    def log(self, operation: str) -> None:
        with self._lock:
            self.calls.append((operation, threading.current_thread().name))

    @property
    def in_transfer(self) -> bool:
        """Whether the calling thread is inside :meth:`transfer`."""
        return bool(getattr(self._local, "depth", 0))

    def threads(self, operation: str | None = None) -> set[str]:
        """The threads that made ``operation`` (any operation: None)."""
        return {t for op, t in self.calls if operation is None or op == operation}

    @contextlib.contextmanager
    def transfer(self) -> Iterator[None]:
        self.log("transfer")
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def empty(self, nbytes: int) -> torch.Tensor:
        self.log("empty")
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.buffers.append(weakref.ref(buffer))
        return buffer

    def host(self, nbytes: int) -> torch.Tensor:
        self.log("host")
        return torch.empty(nbytes, dtype=torch.uint8)

    def record(self) -> FakeEvent:
        self.log("record")
        event = FakeEvent(not self.hold)
        if self.hold:
            self._held.append(event)
        return event

    def release(self) -> None:
        """Every held event is done from now on."""
        self.hold = False
        for event in self._held:
            event.done = True
        self._held.clear()

    def wait(self, event: Any) -> None:
        self.log("wait")

    def hand_over(self, tensor: torch.Tensor) -> None:
        """As CUDA's ``record_stream``, which takes the device's own memory only: a
        tensor on another device (the host, for streams of ``meta``) raises."""
        self.log("hand_over")
        if tensor.device.type != self.device.type:
            raise NotImplementedError(
                f"record_stream of a tensor on {tensor.device}: the streams are {self.device}'s"
            )
        self.handed.append((weakref.ref(tensor), self.in_transfer))

    def done(self, event: Any) -> bool:
        self.log("done")
        return bool(event.done)


class DeviceTap:
    """A wire whose payloads travel as device payloads do (:class:`FakeStreams`): the
    real wire's collectives, posted on the caller's thread inside its transfer stream.

    Attributes:
        streams: the recording streams; ``payload`` calls are logged there, and one
            posted outside :meth:`FakeStreams.transfer` is counted in ``strays``.
    """

    def __init__(self, wire: Any) -> None:
        self._wire = wire
        self.streams = FakeStreams()
        self.strays = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wire, name)

    def head(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Any:
        return self._wire.head(tensor, root, timeout)

    def payload(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Any:
        self.streams.log("payload")
        if not self.streams.in_transfer:
            self.strays += 1
        return self._wire.payload(tensor, root, timeout)


class FakeWire:
    """One rank's end of two in-memory links, one for heads and one for payloads.

    Attributes:
        log: what the source posted, shared by both ends: ``(kind, nbytes)`` with kind
            ``"head"``, ``"payload"`` or ``"zeros"`` (a payload of zeros: a promise the
            frame did not keep).
        aborted: set by :meth:`abort`; every later post raises ``RuntimeError``.
        corrupt_next_payload: flip a bit of the next payload this end receives.
    """

    device = torch.device("cpu")
    size = 2

    def __init__(
        self,
        rank: int,
        links: dict[str, queue.Queue[bytes]],
        log: list[tuple[str, int]],
        streams: FakeStreams | None = None,
    ) -> None:
        self.rank = rank
        self._links = links
        self.log = log
        self.streams = streams
        self.aborted = False
        self.corrupt_next_payload = False
        #: payloads posted outside their streams' transfer (device wires only)
        self.strays = 0

    @classmethod
    def pair(cls, *, streams: bool = False) -> tuple[FakeWire, FakeWire]:
        """The source's end (group rank 0) and a receiver's (group rank 1), joined;
        with ``streams``, each end has its own :class:`FakeStreams`."""
        links: dict[str, queue.Queue[bytes]] = {"head": queue.Queue(), "payload": queue.Queue()}
        log: list[tuple[str, int]] = []
        ends = [FakeStreams() if streams else None for _ in range(2)]
        return cls(0, links, log, ends[0]), cls(1, links, log, ends[1])

    def head(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> _Posted:
        return self._post("head", tensor, root, timeout)

    def payload(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> _Posted:
        if self.streams is not None:
            self.streams.log("payload")
            if not self.streams.in_transfer:
                self.strays += 1
        return self._post("payload", tensor, root, timeout)

    def abort(self) -> None:
        self.aborted = True

    def shutdown(self) -> None:
        pass

    def _post(
        self, what: str, tensor: torch.Tensor, root: int, timeout: datetime.timedelta
    ) -> _Posted:
        if self.rank == root:
            self._move(what, tensor, root, timeout)
            return _Posted(lambda: None)
        if self.aborted:
            raise RuntimeError("the group was aborted")
        return _Posted(lambda: self._move(what, tensor, root, timeout))

    def _move(
        self, what: str, tensor: torch.Tensor, root: int, timeout: datetime.timedelta
    ) -> None:
        if self.aborted:
            raise RuntimeError("the group was aborted")
        if self.rank == root:
            zeros = what == "payload" and tensor.numel() and not tensor.any()
            self.log.append(("zeros" if zeros else what, tensor.numel()))
            self._links[what].put(tensor.numpy().tobytes())
            return
        try:
            data = self._links[what].get(timeout=timeout.total_seconds())
        except queue.Empty:
            raise RuntimeError(f"no {what} within {timeout.total_seconds():g} s") from None
        if len(data) != tensor.numel():
            raise RuntimeError(f"message of {len(data)} bytes into {tensor.numel()}")
        tensor.numpy()[:] = memoryview(data)
        if what == "payload" and self.corrupt_next_payload:
            self.corrupt_next_payload = False
            tensor[0] ^= 1


class _Posted:
    def __init__(self, wait: Callable[[], None]) -> None:
        self._wait = wait

    def wait(self, timeout: datetime.timedelta) -> Any:
        self._wait()


class CountingStore:
    """A store that counts the requests made through it (one per call), for tests and
    benchmarks of what an agreement costs: ``CountingStore(store).requests``, and by
    method in ``.calls`` (a wait's polls are its ``check`` calls)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.requests = 0
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            self.calls[name] += 1
            return method(*args, **kwargs)

        return counted


def fake_roles(
    channel_id: int = 0,
    *,
    streams: bool = False,
    idle_exit_s: float | None = None,
    **sender: Any,
) -> tuple[Sender, Receiver]:
    """The source's role and a receiver's of one channel over a :meth:`FakeWire.pair`
    (with :class:`FakeStreams` if ``streams``), each on a group and a lane of its own
    (``idle_exit_s``: how soon an idle worker leaves; the lane's default if None).
    ``sender``: keywords for the :class:`~tensorcast.transport.sender.Sender`. Each end's
    wire is ``role.group.wire``, its lane ``role.group.lane``."""
    from tensorcast.transport.groups import Group
    from tensorcast.transport.lane import Lane
    from tensorcast.transport.receiver import Receiver
    from tensorcast.transport.sender import Sender

    def group(fake: FakeWire) -> Group:
        # A Wire but for its streams' type (FakeStreams, which records what it is asked).
        wire = cast("Wire", fake)
        name = f"fake{fake.rank}"
        if idle_exit_s is None:
            return Group((0, 1), wire, Lane(name, wire.abort))
        return Group((0, 1), wire, Lane(name, wire.abort, idle_exit_s=idle_exit_s))

    groups = [group(w) for w in FakeWire.pair(streams=streams)]
    return (
        Sender(groups[0], 0, channel_id, **sender),
        Receiver(groups[1], 0, rank=1, channel_id=channel_id),
    )
