"""A receiver's side of a channel: a frame off the wire, validated, rebuilt as views.

A frame is read in the order the source cut it (``transport.frame.plan_frame``, through the ``Cutter``, on both sides):
the first message, then a spilled header, then a separate payload. The prefix and the
header are validated before anything is allocated from their sizes. Until the whole
frame is in, any failure breaks the lane (this rank cannot skip the rest of a frame it
cannot read); once it is in, a bad CRC is an error of that step alone.

# NOTE [ Views made ahead ]
A batch of many small leaves spends much of each rank's time making one fresh tensor per
leaf, a ``detach()`` of the views its first message keeps (see ``transport.kept``). Both sides
make them while a head is on the wire, where they would only wait: a receiver once it
has posted the receive of the first message it is about to read, for the layout that
message carried last; the source once it has posted its first message, for the next
frame of the same layout that comes back to that message (its batch dropped by then).
When the frame has that layout they are its leaves; when not, they are dropped. Nothing
travels and nothing waits on them: they are made after the posting, before the wait.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tensorcast._errors import DesyncError, HeaderError, PeerError, TensorcastError
from tensorcast.codec import packed as _codec
from tensorcast.codec import schema as _schema
from tensorcast.codec import views as _views
from tensorcast.codec.views import KeepsViews
from tensorcast.transport.device import DevicePart
from tensorcast.transport.frame import (
    PREFIX_SIZE,
    Flags,
    FramePlan,
    Kind,
    Prefix,
    Stamp,
    crc32,
)
from tensorcast.transport.groups import Group
from tensorcast.transport.pool import BufferPool, FramePool, Message
from tensorcast.transport.promise import Cutter
from tensorcast.transport.staging import Staging
from tensorcast.transport.wire import Posted

__all__ = ["Receiver"]

_CUT = int(Flags.INLINE | Flags.SPILL)
_CRC = int(Flags.CRC)
_PROMISED = int(Flags.PROMISED)


@dataclass(frozen=True, slots=True)
class _Incoming:
    """A frame read off the wire whole: its prefix and header, and for a DATA frame the
    decoded header and the payload (with what keeps its views)."""

    prefix: Prefix
    cut: FramePlan
    header: bytes
    decoded: _schema.Decoded | None = None
    payload: torch.Tensor | None = None
    pool: KeepsViews | None = None
    host: torch.Tensor | None = None  # a device frame's host block (``codec.views``)


class Receiver:
    """Receives and rebuilds the frames of one source on one of tensorcast's groups.

    Args:
        group: tensorcast's group the frames travel on.
        root: the source's group-local rank.
        src: the source's global rank (for messages).
        diagnose: ``diagnose(stamp, error, timeout_s)`` says why the source did not send
            the frame ``stamp``, for the error of a wait that failed with ``error``.
        promises: expect promised payloads (see NOTE [ Promised payloads ]; host wires only).
    """

    def __init__(
        self,
        group: Group,
        root: int,
        src: int,
        diagnose: Callable[[Stamp, BaseException, float], str],
        *,
        promises: bool = False,
    ) -> None:
        self._group = group
        self._root = root
        self._src = src
        self._diagnose = diagnose
        self._messages = FramePool()  # first messages
        self._pool = BufferPool()  # payloads that travel on their own
        #: the wire's device streams: a payload is then received by a DevicePart
        self._streams = group.wire.streams
        self._parts = Staging(group, root, self._break)  # device parts of frames
        self._cutter = Cutter(group, promises=promises)
        self.last_nbytes = 0  # the last batch's payload, for the loader's stats

    def recv(
        self, expect: Stamp, device: torch.device | None, timeout: datetime.timedelta
    ) -> tuple[Kind, Any]:
        """The next frame: ``(DATA, tree)``, ``(END, None)``, ``(CLOSE, None)`` or
        ``(ERROR, message)``. Where the payload travels on a GPU, or lands on one, the
        tree is a :class:`DevicePart` to post and take on the caller's thread (NOTE
        [ Device work at next() ]).

        Raises:
            PeerError: the source died or did not send within ``timeout``.
            DesyncError: the frame is another step's, or another channel's.
            HeaderError: the frame is malformed or from another version.
        """
        first = self._messages.take(self._group.capacity)
        try:
            try:
                frame = self._read(first, expect, timeout)
            except BaseException as e:
                self._break(e)
                raise
            self._cutter.done(frame.cut, frame.prefix.next_capacity)
            return self._open(frame, expect, device, timeout)
        finally:
            if first.kept.ahead is not None:  # the frame did not use them
                first.kept.drop_ahead()

    def _break(self, error: BaseException) -> None:
        """Until a frame is in whole, any failure breaks the lane (this rank cannot skip
        the rest of a frame it cannot read); one from the collective is a ``PeerError``."""
        group = self._group
        group.lane.break_(error)
        if isinstance(error, RuntimeError) and not isinstance(error, TensorcastError):
            raise PeerError(
                f"receiving the rest of a frame from the source rank {self._src} on ranks "
                f"{list(group.ranks)} failed: {type(error).__name__}: {error}"
            ) from error

    def _read(self, first: Message, expect: Stamp, timeout: datetime.timedelta) -> _Incoming:
        """Post, wait for the first message, check its prefix, cut the frame, take the
        rest (a spilled header, a separate payload), decode the header."""
        wire, root = self._group.wire, self._root
        promised = self._cutter.promised
        posted: Posted | None = None
        buffer: torch.Tensor | None = None
        try:
            if promised:  # the source posts it with the first message
                buffer = self._pool.take(promised, wire.device)
                posted = wire.payload(buffer, root, timeout)
            head = wire.head(first.buffer, root, timeout)
            first.kept.detach_ahead()  # NOTE [ Views made ahead ]
            head.wait(timeout)
        except RuntimeError as e:  # from the collective: the source died or timed out
            raise PeerError(
                f"waiting for the source rank {self._src} on ranks {list(self._group.ranks)} "
                f"failed after up to {timeout.total_seconds():g} s: "
                f"{self._diagnose(expect, e, timeout.total_seconds())} "
                f"({type(e).__name__}: {e})"
            ) from e
        prefix = Prefix.unpack(first.mem, first.capacity)
        cut = self._plan(prefix, expect, promised)
        if posted is not None:
            posted.wait(timeout)  # the payload, or zeros where the promise was not kept
        header = self._header(first, prefix, cut, timeout)
        if prefix.kind != Kind.DATA:
            return _Incoming(prefix, cut, header)
        decoded = _schema.decode(header)  # validated before its sizes allocate anything
        n = prefix.payload_len
        if decoded.structure.nbytes != n:
            raise HeaderError(
                f"the header describes a {decoded.nbytes}-byte buffer but the frame carries "
                f"{n} bytes"
            )
        if cut.inline:
            payload = first.inline_payload(cut.payload_at, n)
            return _Incoming(prefix, cut, header, decoded, payload, first.kept)
        if cut.in_promise and buffer is not None:
            return _Incoming(prefix, cut, header, decoded, buffer, self._pool.kept)
        if self._streams is not None:  # received when posted (NOTE [ Device work at next() ])
            return _Incoming(prefix, cut, header, decoded, host=self._host_block(decoded, timeout))
        payload = self._pool.take(n, wire.device)
        if n:
            wire.payload(payload, root, timeout).wait(timeout)
        return _Incoming(prefix, cut, header, decoded, payload, self._pool.kept)

    def _header(
        self, first: Message, prefix: Prefix, cut: FramePlan, timeout: datetime.timedelta
    ) -> bytes:
        """The frame's header: in its first message, or spilled into a message of its own."""
        if not cut.spill:
            return first.mem[PREFIX_SIZE : PREFIX_SIZE + prefix.header_len].tobytes()
        spilled = torch.empty(prefix.header_len, dtype=torch.uint8)
        self._group.wire.head(spilled, self._root, timeout).wait(timeout)
        return spilled.numpy().tobytes()

    def _host_block(
        self, decoded: _schema.Decoded, timeout: datetime.timedelta
    ) -> torch.Tensor | None:
        """A device frame's leaves that are not tensors, which travel on the host (their
        host block, ``codec.views``); None when every leaf is a tensor."""
        spec = _views.view_spec(decoded)
        if not spec.others:
            return None
        host = torch.empty(spec.host_nbytes, dtype=torch.uint8)
        if spec.host_nbytes:
            self._group.wire.head(host, self._root, timeout).wait(timeout)
        return host

    def _open(
        self,
        frame: _Incoming,
        expect: Stamp,
        device: torch.device | None,
        timeout: datetime.timedelta,
    ) -> tuple[Kind, Any]:
        """A frame that is in whole (or whose payload a device part receives), as what it
        stands for; a bad CRC or bad small values are an error of this step alone."""
        prefix, payload, decoded = frame.prefix, frame.payload, frame.decoded
        if prefix.kind in (Kind.END, Kind.CLOSE):
            return prefix.kind, None
        if prefix.kind == Kind.ERROR or decoded is None:
            return Kind.ERROR, frame.header.decode("utf-8", "replace")
        self.last_nbytes = prefix.payload_len
        if payload is None:
            part = self._receive_on_device(decoded, prefix, expect, device, timeout, frame.host)
            return Kind.DATA, part
        if int(prefix.flags) & _CRC:
            self._check_crc(payload, prefix, expect)
        if device is not None and device != payload.device:
            build = functools.partial(_codec.rebuild, decoded)
            return Kind.DATA, self._parts.upload(payload, device, build, timeout)
        return Kind.DATA, _codec.rebuild(decoded, payload, pool=frame.pool)

    def _check_crc(self, payload: torch.Tensor, prefix: Prefix, expect: Stamp) -> None:
        if crc32(payload) != prefix.crc:
            raise HeaderError(
                f"step {expect.step}: the payload's CRC32 does not match the source's: the "
                f"bytes were corrupted in transit"
            )

    def _receive_on_device(
        self,
        decoded: _schema.Decoded,
        prefix: Prefix,
        expect: Stamp,
        device: torch.device | None,
        timeout: datetime.timedelta,
        host: torch.Tensor | None,
    ) -> DevicePart:
        def build(buffer: torch.Tensor) -> Any:
            if int(prefix.flags) & _CRC:  # verify=True: one copy to the host
                self._check_crc(buffer, prefix, expect)
            return _codec.rebuild(decoded, buffer, host=host)

        return self._parts.part(prefix.payload_len, build, device, timeout)

    def _plan(self, prefix: Prefix, expect: Stamp, promised: int) -> FramePlan:
        """The frame's plan, once its prefix is the expected step's and cut as its own
        sizes (and this rank's promise) say."""
        got = (prefix.channel, prefix.pass_index, prefix.step)
        if got != (expect.channel, expect.pass_index, expect.step):
            raise DesyncError(
                f"ranks {list(self._group.ranks)}: expected channel {expect.channel:#x} pass "
                f"{expect.pass_index} step {expect.step} from the source rank {self._src}, got "
                f"channel {prefix.channel:#x} pass {prefix.pass_index} step {prefix.step}: the "
                f"ranks did not use their loaders (or tensorcast.broadcast) in the same order"
            )
        plan = self._cutter.cut(prefix.header_len, prefix.payload_len, promised)
        flags = int(prefix.flags)  # plain int arithmetic: an IntFlag's operators run Python code
        if bool(flags & _PROMISED) != bool(promised):
            raise DesyncError(
                f"ranks {list(self._group.ranks)}: step {expect.step} of channel "
                f"{expect.channel:#x}: the source {'did' if flags & _PROMISED else 'did not'} "
                f"promise its payload and this rank expected {promised or 'no'} promised "
                f"bytes: the ranks do not run the same tensorcast, or TENSORCAST_PROMISES "
                f"differs between them"
            )
        if flags & (_CUT | _PROMISED) != plan.flags:
            raise HeaderError(
                f"the frame is cut as {Flags(prefix.flags & _CUT)!r} but its sizes say "
                f"{plan.flags!r}"
            )
        return plan
