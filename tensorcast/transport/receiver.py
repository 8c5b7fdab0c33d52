"""A receiver's role: a frame off the wire, validated, rebuilt as views.

A :class:`Receiver` is what a receiving rank holds for one channel: the channel's agreed
id and :meth:`Receiver.recv`, which checks that a frame carries that id and the pass and
step of the :class:`Stamp` it is given, and returns the next batch, :data:`END` or
:data:`CLOSE`, and raises ``SourceError`` for a source's ERROR frame. A frame is read in
the order the source cut it (one ``Cutter`` per side, ``transport.frame``): the first
message, then a spilled header, then a separate payload. The prefix and the header are validated before anything is
allocated from their sizes. Until the whole frame is in, any failure breaks the lane
(this rank cannot skip the rest of a frame it cannot read); once it is in, a bad CRC is
an error of that step alone. The frame's leaves were made while its head was on the wire
(NOTE [ Views made ahead ], ``codec.views``).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tensorcast import codec as _codec
from tensorcast._errors import DesyncError, HeaderError, PeerError, SourceError, TensorcastError
from tensorcast.codec import Decoded, Repad, Reuses
from tensorcast.transport.device import DevicePart
from tensorcast.transport.diagnosis import failed_after
from tensorcast.transport.frame import (
    DEFAULT_TIMEOUT,
    PREFIX_SIZE,
    Cut,
    Cutter,
    Flags,
    Kind,
    Prefix,
    Stamp,
    crc32,
)
from tensorcast.transport.pool import BufferPool, FirstMessage, FramePool, Keeper
from tensorcast.transport.relay import Relay
from tensorcast.transport.shm import Reader, Ref
from tensorcast.transport.staging import Staging
from tensorcast.transport.wire import Posted

if TYPE_CHECKING:
    from tensorcast.transport.groups import Group

__all__ = ["CLOSE", "END", "Close", "End", "Receiver"]

_CRC = int(Flags.CRC)
_PROMISED = int(Flags.PROMISED)


class End:
    """What :meth:`Receiver.recv` returns for an END frame: the source's pass is over."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "END"


class Close:
    """What :meth:`Receiver.recv` returns for a CLOSE frame: the source left its pass
    early, at this step (NOTE [ An early close ] in ``loader.steps``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CLOSE"


END = End()
CLOSE = Close()


def _no_diagnosis(frame: tuple[int, int, int], error: BaseException, timeout_s: float) -> str:
    return "no diagnosis"


@dataclass(frozen=True, slots=True)
class _Incoming:
    """A frame read off the wire whole: its prefix and header, and for a DATA frame the
    decoded header and the payload (with what keeps its views)."""

    prefix: Prefix
    cut: Cut
    header: bytes
    decoded: Decoded | None = None
    payload: torch.Tensor | None = None
    reuse: Reuses | None = None
    host: torch.Tensor | None = None  # a device frame's host block (``Decoded.host_block``)


class Receiver:
    """A receiver of one channel on one of tensorcast's groups: receives and rebuilds the
    source's frames. :meth:`recv` must run as a job on the group's lane (see NOTE [ One
    ordered lane ]).

    Args:
        group: tensorcast's group the frames travel on.
        src: the source's global rank.
        rank: this rank (global), for messages.
        channel_id: the number the ranks agreed on for this channel.
        timeout: how long a message may take (None: torch's default group timeout); a
            call's own timeout replaces it for that call.
        promises: expect promised payloads (see NOTE [ Promised payloads ]; host wires only).
        diagnose: ``diagnose((channel, pass, step), error, timeout_s)`` says why the source
            did not send that frame, for the error of a wait that failed with ``error``.
        shm: this rank's reader of the source's shared-memory arena (``transport.shm``),
            None where the channel has no such lane.
        relay: the route of a channel spread over hosts (``transport.relay``).
    """

    is_source = False

    def __init__(
        self,
        group: Group,
        src: int,
        *,
        rank: int,
        channel_id: int = 0,
        timeout: datetime.timedelta | None = None,
        promises: bool = False,
        diagnose: Callable[[tuple[int, int, int], BaseException, float], str] = _no_diagnosis,
        shm: Reader | None = None,
        relay: Relay | None = None,
    ) -> None:
        self.group = group
        self.src = src
        self.rank = rank
        self.id = channel_id
        #: the pass and step expected of frames outside a loader's pass
        self.stamp = Stamp()
        #: frames counted, every pass together (NOTE [ A frame is atomic ]); never goes back
        self.frames = 0
        self.timeout = timeout or DEFAULT_TIMEOUT
        self._root = group.local(src)
        self._diagnose = diagnose
        # what this role hands out, reused under NOTE [ Memory handed out ]
        self._reuse = Keeper()
        self._messages = FramePool(keeper=self._reuse)  # first messages
        self._pool = BufferPool(keeper=self._reuse)  # payloads that travel on their own
        #: the wire's device streams: a payload is then received by a DevicePart
        self._streams = group.wire.streams
        self._parts = Staging(group, self._root, self._break)  # device parts of frames
        self._cutter = Cutter(group, promises=promises)
        self.last_nbytes = 0  # the last batch's payload, for the loader's stats
        self.last_shm = False  # ... and whether it came through shared memory
        self._shm = shm
        self._relay = relay  # a channel spread over hosts (``transport.relay``)
        #: when the last frame's first message arrived (``time.perf_counter()``): before
        #: it, a receiver waits for the source; after it, the frame's transfer
        self.first_at = 0.0

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.group.ranks

    def recv(
        self,
        device: torch.device | None,
        timeout: datetime.timedelta | None = None,
        stamp: Stamp | None = None,
    ) -> Any:
        """The source's next frame, that of ``stamp``'s pass and step (default: the
        receiver's own stamp), as what it stands for: a batch, :data:`END` or
        :data:`CLOSE`. Where the payload travels on a GPU, or lands on one, the batch is
        a :class:`DevicePart` to post and take on the caller's thread (NOTE [ Device work
        at next() ]).

        Raises:
            SourceError: the source sent an ERROR frame (its batch or iterator failed).
            PeerError: the lane broke earlier, or the source died or did not send within
                ``timeout``.
            DesyncError: the frame is another step's, or another channel's.
            HeaderError: the frame is malformed or from another version.
        """
        lane = self.group.lane
        if lane.broken is not None:
            lane.check()
        wait = timeout or self.timeout
        if stamp is None:
            stamp = self.stamp
        step = stamp.step
        stamp.step = step + 1  # before the first message (NOTE [ A frame is atomic ])
        self.frames += 1
        if self._shm is not None:  # slots this rank no longer sees go back to the source
            self._shm.release()
        first = self._messages.take(self.group.capacity)
        try:
            try:
                frame = self._read(first, stamp.pass_index, step, wait)
            except BaseException as e:
                self._break(e)
                raise
            return self._open(frame, step, device, wait)
        finally:
            if first.kept.ahead is not None:  # the frame did not use them
                first.kept.drop_ahead()

    def _break(self, error: BaseException) -> None:
        """Until a frame is in whole, any failure breaks the lane (this rank cannot skip
        the rest of a frame it cannot read); one from the collective is a ``PeerError``."""
        group = self.group
        group.lane.break_(error)
        if self._relay is not None:  # a writer may be dead: what it left goes
            self._relay.close()
        elif self._shm is not None:
            self._shm.sweep()
        if isinstance(error, RuntimeError) and not isinstance(error, TensorcastError):
            relayed = self._relay.doing if self._relay is not None else ""
            doing = (
                f"{relayed} (the source is rank {self.src})"
                if relayed
                else f"receiving the rest of a frame from the source rank {self.src}"
            )
            raise PeerError(
                f"{doing} on ranks {list(group.ranks)} failed: {type(error).__name__}: {error}"
            ) from error

    def _read(
        self, first: FirstMessage, pass_index: int, step: int, timeout: datetime.timedelta
    ) -> _Incoming:
        """Post, wait for the first message, check its prefix, cut the frame, take the
        rest (a spilled header, a separate payload), decode the header."""
        wire, root = self.group.wire, self._root
        promised = self._cutter.promised
        posted: Posted | None = None
        buffer: torch.Tensor | None = None
        started = time.perf_counter()
        try:
            if promised:  # the source posts it with the first message
                buffer = self._pool.take(promised, wire.device)
                posted = wire.payload(buffer, root, timeout)
            head = wire.head(first.buffer, root, timeout)
            first.kept.detach_ahead()  # NOTE [ Views made ahead ]
            head.wait(timeout)
            self.first_at = time.perf_counter()
        except RuntimeError as e:  # from the collective: the source died or timed out
            waited = time.perf_counter() - started
            why = self._diagnose((self.id, pass_index, step), e, timeout.total_seconds())
            raise PeerError(
                f"waiting for the source rank {self.src} on ranks {list(self.group.ranks)} "
                f"{failed_after(e, waited, timeout.total_seconds())}: {why} "
                f"({type(e).__name__}: {e})"
            ) from e
        prefix = Prefix.unpack(first.mem, first.capacity)
        self._check(prefix, pass_index, step, promised)
        cut = self._cutter.read(prefix)
        if posted is not None:
            posted.wait(timeout)  # the payload, or zeros where the promise was not kept
        header = self._header(first, prefix, cut, timeout)
        if prefix.kind != Kind.DATA:
            return _Incoming(prefix, cut, header)
        decoded = _codec.decode(header)  # validated before its sizes allocate anything
        n = prefix.payload_len
        if decoded.nbytes != n:
            raise HeaderError(
                f"the header describes a {decoded.nbytes}-byte buffer but the frame carries "
                f"{n} bytes"
            )
        if cut.inline:
            payload = first.inline_payload(cut.payload_at, n)
            return _Incoming(prefix, cut, header, decoded, payload, self._reuse)
        self.last_shm = cut.shm
        if self._relay is not None and n:  # NOTE [ Several hosts ]
            ref = Ref.unpack(first.mem, cut.payload_at) if cut.shm else None
            payload, self.last_shm = self._relay.receive(wire, self._pool, ref, n, timeout)
            return _Incoming(prefix, cut, header, decoded, payload, self._reuse)
        if cut.shm:
            payload = self._in_slot(first, cut, n)
            return _Incoming(prefix, cut, header, decoded, payload, self._reuse)
        if cut.in_promise and buffer is not None:
            return _Incoming(prefix, cut, header, decoded, buffer, self._reuse)
        if self._streams is not None:  # received when posted (NOTE [ Device work at next() ])
            return _Incoming(prefix, cut, header, decoded, host=self._host_block(decoded, timeout))
        payload = self._pool.take(n, wire.device)
        if n:
            wire.payload(payload, root, timeout).wait(timeout)
        return _Incoming(prefix, cut, header, decoded, payload, self._reuse)

    def _in_slot(self, first: FirstMessage, cut: Cut, n: int) -> torch.Tensor:
        """The payload of a frame in the source's shared-memory arena: the slot's bytes."""
        if self._shm is None:
            raise HeaderError("a frame in shared memory on a channel that has no such lane")
        ref = Ref.unpack(first.mem, cut.payload_at)  # read once, checked on this copy
        try:
            return self._shm.payload(ref, n)
        except OSError as e:
            raise PeerError(
                f"the source rank {self.src}'s shared-memory segment is gone (it exited?): {e}"
            ) from e

    def _header(
        self, first: FirstMessage, prefix: Prefix, cut: Cut, timeout: datetime.timedelta
    ) -> bytes:
        """The frame's header: in its first message, or spilled into a message of its own."""
        if not cut.spill:
            return first.mem[PREFIX_SIZE : PREFIX_SIZE + prefix.header_len].tobytes()
        spilled = torch.empty(prefix.header_len, dtype=torch.uint8)
        self.group.wire.head(spilled, self._root, timeout).wait(timeout)
        return spilled.numpy().tobytes()

    def _host_block(self, decoded: Decoded, timeout: datetime.timedelta) -> torch.Tensor | None:
        """A device frame's leaves that are not tensors, which travel on the host (their
        host block, ``Decoded.host_block``); None when every leaf is a tensor."""
        n = decoded.host_nbytes
        if n is None:
            return None
        host = torch.empty(n, dtype=torch.uint8)
        if n:
            self.group.wire.head(host, self._root, timeout).wait(timeout)
        return host

    def _open(
        self,
        frame: _Incoming,
        step: int,
        device: torch.device | None,
        timeout: datetime.timedelta,
    ) -> Any:
        """A frame that is in whole (or whose payload a device part receives), as what it
        stands for; a bad CRC or bad small values are an error of this step alone."""
        prefix, payload, decoded = frame.prefix, frame.payload, frame.decoded
        kind = prefix.kind
        if kind == Kind.END:
            return END
        if kind == Kind.CLOSE:
            return CLOSE
        if kind == Kind.ERROR or decoded is None:
            text = frame.header.decode("utf-8", "replace")
            raise SourceError(f"source rank {self.src} reported: {text}")
        self.last_nbytes = prefix.payload_len
        if payload is None:
            return self._receive_on_device(frame, decoded, step, device, timeout)
        if int(prefix.flags) & _CRC:
            self._check_crc(payload, frame.header, prefix, step)
        if device is not None and device != payload.device:
            return self._parts.upload(payload, device, decoded, timeout)
        return decoded.rebuild(payload, frame.reuse)

    def _check_crc(self, payload: torch.Tensor, header: bytes, prefix: Prefix, step: int) -> None:
        if crc32(payload, header) != prefix.crc:
            raise HeaderError(
                f"step {step}: the CRC32 of the header and payload does not match the "
                f"source's: the bytes were corrupted in transit"
            )

    def _receive_on_device(
        self,
        frame: _Incoming,
        decoded: Decoded,
        step: int,
        device: torch.device | None,
        timeout: datetime.timedelta,
    ) -> DevicePart:
        prefix, host = frame.prefix, frame.host

        def build(buffer: torch.Tensor) -> tuple[Any, list[Repad]]:
            if int(prefix.flags) & _CRC:  # verify=True: one copy to the host
                self._check_crc(buffer, frame.header, prefix, step)
            return decoded.rebuild_later(buffer, host=host)

        return self._parts.part(prefix.payload_len, build, device, timeout)

    def _check(self, prefix: Prefix, pass_index: int, step: int, promised: int) -> None:
        """Raise ``DesyncError`` unless the prefix is this channel's frame of ``pass_index``
        at ``step`` and promised as this rank's rule says (NOTE [ Promised payloads ])."""
        if (prefix.channel, prefix.pass_index, prefix.step) != (self.id, pass_index, step):
            raise DesyncError(
                f"ranks {list(self.group.ranks)}: expected channel {self.id:#x} pass "
                f"{pass_index} step {step} from the source rank {self.src}, got "
                f"channel {prefix.channel:#x} pass {prefix.pass_index} step {prefix.step}: the "
                f"ranks did not use their loaders (or tensorcast.broadcast) in the same order, "
                f"or left a pass (a break, an iterator dropped) after different batches: "
                f"decide a break together, e.g. with an all_reduce of a stop flag"
            )
        flags = int(prefix.flags)  # plain int arithmetic: an IntFlag's operators run Python code
        if bool(flags & _PROMISED) != bool(promised):
            raise DesyncError(
                f"ranks {list(self.group.ranks)}: step {step} of channel "
                f"{self.id:#x}: the source {'did' if flags & _PROMISED else 'did not'} "
                f"promise its payload and this rank expected {promised or 'no'} promised "
                f"bytes: the ranks do not run the same tensorcast, or TENSORCAST_PROMISES "
                f"differs between them"
            )
