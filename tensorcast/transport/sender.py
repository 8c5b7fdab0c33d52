"""The source's role: a batch into a frame, the frame onto the wire.

A :class:`Sender` is what a source rank holds for one channel: its agreed id, which every
frame carries with a :class:`Stamp` (its pass and step), how it packs batches
(:class:`Packing`), and two phases per frame, so that a frame is atomic (NOTE [ A frame is
atomic ]):

1. :meth:`Sender.write` does everything that can fail: flatten, detach, allocate, copy,
   write the first message and build this rank's own tree. Nothing has been sent, so a
   failure can still be announced with an ERROR frame (:meth:`send_batch` does).
2. :meth:`Sender.send` counts the frame, writes its prefix and runs the collectives,
   and nothing else. A failure there breaks the lane (see ``transport.lane``), so no
   rank can ever read a frame that is half old, half new.

# NOTE [ A frame is atomic ]
A frame is posted whole by one lane job, on the lane's worker thread or inline on the
caller's (see ``transport.lane``). Anything that escapes once its first message is
posted, a peer's failure or a signal handler's exception alike, breaks the lane, so the
peers fail within their timeout instead of reading a frame that is half old, half new.
Both roles count a frame (their ``frames``, and its stamp's ``step``) as they start on it,
before its first message is posted: :meth:`Sender.send` and ``Receiver.recv``, once the
lane is known whole. An
exception that escapes from then on, even between the last message and the job's return
(a handler runs when a call returns), finds the count moved, and the lane breaks
(``Lane.run``) instead of a retry sending or reading the frame a second time. And the
source's result is a tree of views into the buffer it is about to send, built before the
first message: the source and the receivers return the same tree (detached, not
inference tensors) or none of them does.

# NOTE [ The own tree's re-pads ]
A trimmed leaf is no view: the source's own tree holds it rebuilt, a write of the whole
leaf (``codec.repad``), as a receiver's does. Its memory is taken in phase 1, with the
rest of the tree; the re-pad itself, which only reads the payload the wire is reading
too, runs in phase 2 while the frame's largest message is in flight (the payload, or the
first message that holds it), not before the first message: on a host wire the source
pays for it beside the transfer instead of ahead of it. Its sizes were checked when the
side table was made, so it cannot fail on them; anything it raises (memory, a signal)
escapes mid-frame and breaks the lane like any other failure there.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tensorcast import codec as _codec
from tensorcast._errors import PeerError, describe
from tensorcast.codec import Decoded, Encoded, Encoder, Packed, Repad
from tensorcast.transport.frame import (
    DEFAULT_TIMEOUT,
    MAX_ERROR_BYTES,
    PREFIX_SIZE,
    Cut,
    Cutter,
    Kind,
    Stamp,
    crc32,
)
from tensorcast.transport.pool import BufferPool, FirstMessage, FramePool, Keeper
from tensorcast.transport.relay import Relay
from tensorcast.transport.shm import MIN_PAYLOAD, Ref, Taken, Writer
from tensorcast.transport.staging import Staging

if TYPE_CHECKING:
    from tensorcast.transport.groups import Group

__all__ = ["Outgoing", "Packing", "Sender"]

# A pre-packed buffer up to this size is copied into a pooled one (see Sender._prepacked).
_COPY_BELOW = 1 << 20


@dataclass(frozen=True, slots=True)
class Packing:
    """How a source packs its batches into a frame's buffer, as ``tc.pack`` does. Only the
    source uses it: a receiver reads every leaf's offset from the header, so the ranks of
    a channel need not agree on it (it is no part of the setup agreement).

    Attributes:
        align: every leaf's offset in the buffer is a multiple of this (a power of two).
        trim: padded leaves travel without their padding where that pays (NOTE [ Trimmed
            leaves ], ``codec/trim.py``): the default of :meth:`Sender.write`.

    Raises:
        ValueError, TypeError: as ``tc.pack`` raises for the same values (checked where it
            is made).
    """

    align: int = 64
    trim: bool = True

    def __post_init__(self) -> None:
        Encoder(align=self.align, trim=self.trim)  # tc.pack's own checks and messages

    def encoder(self) -> Encoder:
        return Encoder(align=self.align, trim=self.trim)


def _kind(device: torch.device) -> str:
    """Where receivers whose output device is ``device`` rebuild (``codec.trim.decide``)."""
    return "device" if device.type == "cuda" else "host"


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A frame written and ready for its collectives (its prefix is written as it goes)."""

    kind: Kind
    cut: Cut
    message: FirstMessage  # the first message's buffer, and what was made from it
    header_len: int
    crc: int | None  # the payload's CRC32, when the frame carries one
    promised: torch.Tensor | None  # posted with the first message: the payload, or zeros
    header: torch.Tensor | None  # the spilled header, when it did not fit
    payload: torch.Tensor | None  # the payload, when it travels on its own
    host_leaves: torch.Tensor | None = None  # a device frame's host block (``Decoded``)
    ref: Ref | None = None  # the shared-memory slot that holds the payload, if one does
    # the own tree's re-pads of trimmed leaves, run while the frame's largest message is
    # in flight (NOTE [ The own tree's re-pads ])
    repads: list[Repad] = field(default_factory=list)


class Sender:
    """The source of one channel on one of tensorcast's groups: writes and sends its frames.

    Every method that communicates (:meth:`send_batch`, :meth:`send`, :meth:`send_end`,
    :meth:`send_close`, :meth:`send_error`) must run as a job on the group's lane (see
    NOTE [ One ordered lane ]). Each takes the ``stamp`` its frame carries: a loader pass's,
    or by default the sender's own.

    Args:
        group: tensorcast's group the frames travel on.
        src: this rank, the source (a global rank).
        channel_id: the number the ranks agreed on for this channel.
        timeout: how long a message may take (None: torch's default group timeout); a
            call's own timeout replaces it for that call.
        verify: carry a CRC32 of every payload.
        promises: promise payloads (NOTE [ Promised payloads ]; host wires only).
        pulling: the context in which the source is in ``next(source)`` (its heartbeat
            says so, see ``transport.liveness``).
        packing: how batches are packed (default: ``tc.pack``'s defaults).
        shm: the arena of the shared-memory lane (``transport.shm``), None for none.
        relay: the route of a channel spread over hosts (``transport.relay``).
    """

    is_source = True

    def __init__(
        self,
        group: Group,
        src: int,
        channel_id: int = 0,
        *,
        timeout: datetime.timedelta | None = None,
        verify: bool = False,
        promises: bool = False,
        pulling: contextlib.AbstractContextManager[Any] | None = None,
        packing: Packing | None = None,
        shm: Writer | None = None,
        relay: Relay | None = None,
    ) -> None:
        self.group = group
        self.src = self.rank = src
        self.id = channel_id
        #: the pass and step of frames sent outside a loader's pass
        self.stamp = Stamp()
        #: frames counted, every pass together (NOTE [ A frame is atomic ]); never goes back
        self.frames = 0
        self.timeout = timeout or DEFAULT_TIMEOUT
        self.pulling = pulling if pulling is not None else contextlib.nullcontext()
        self._root = group.local(src)
        self._verify = verify
        self._device = group.wire.device
        #: the wire's device streams: payloads are then posted by DevicePart
        self._streams = group.wire.streams
        # what this role hands out, reused under NOTE [ Memory handed out ]
        self._reuse = Keeper()
        self._pool = BufferPool(keeper=self._reuse)  # payloads that travel on their own
        self._parts = Staging(group, self._root, self._failed)  # device parts of frames
        self._messages = FramePool(keeper=self._reuse)  # first messages
        # reuses the last batch's layout while the structure repeats
        self._encoder = (packing or Packing()).encoder()
        self._cutter = Cutter(group, promises=promises)  # frames as they are sent
        self._shm = shm if self._streams is None else None
        self._relay = relay

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.group.ranks

    def send_batch(
        self,
        batch: Any,
        device: torch.device | None,
        timeout: datetime.timedelta | None = None,
        stamp: Stamp | None = None,
        trim: bool | None = None,
    ) -> Any:
        """Send ``batch`` and return this rank's own tree of it (see :meth:`write`).

        A batch that cannot travel is announced with an ERROR frame, then raised.
        """
        try:
            out, own = self.write(batch, device, timeout, trim=trim)
        except Exception as e:
            message = f"batch serialization failed: {describe(e)}"
            self.send_error(message, timeout, stamp)
            raise
        self.send(out, timeout, stamp)
        return own

    def send_end(
        self, timeout: datetime.timedelta | None = None, stamp: Stamp | None = None
    ) -> None:
        """The pass ended: the source is exhausted."""
        self.send(self._control(Kind.END, b""), timeout, stamp)

    def send_close(
        self, timeout: datetime.timedelta | None = None, stamp: Stamp | None = None
    ) -> None:
        """The pass was closed at this step (a loader iterator's ``close()``)."""
        self.send(self._control(Kind.CLOSE, b""), timeout, stamp)

    def send_error(
        self, message: str, timeout: datetime.timedelta | None = None, stamp: Stamp | None = None
    ) -> None:
        """The pass failed here; receivers raise ``SourceError`` with ``message``."""
        text = message.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
        self.send(self._control(Kind.ERROR, text), timeout, stamp)

    # -- phase 1: everything that can fail ---------------------------------------------

    def write(
        self,
        batch: Any,
        device: torch.device | None,
        timeout: datetime.timedelta | None = None,
        trim: bool | None = None,
    ) -> tuple[Outgoing, Any]:
        """The frame of ``batch`` (a tree or a :class:`Packed`) and this rank's own tree;
        ``trim``: see :class:`Packing` (None: the Packing's; a :class:`Packed` goes as is).

        The payload is written where it travels: into the first message when it fits
        there (inline), else into a buffer of its own. Where the payload, or this rank's
        tree, lives on a GPU, the own tree is a :class:`DevicePart` to post and take on
        the caller's thread (NOTE [ Device work at next() ]); ``timeout`` is its deadline.

        Raises:
            PeerError: the lane broke earlier.
            UnsupportedLeafError, ValueError, HeaderError: the batch cannot travel.
        """
        lane = self.group.lane
        if lane.broken is not None:
            lane.check()
        coded: Decoded | Encoded
        if isinstance(batch, Packed):
            coded = _codec.decode(batch.header)
            coded.check_buffer(batch.buffer)
            header = batch.header
        else:
            kind, shm = _kind(device or self._device), self._shm
            if kind == "host" and shm and shm.last_used and self._relay is None:
                trim = False  # every receiver reads the arena on the host: trimming saves nothing
            coded = self._encoder.encode(batch, trim=trim, receiver=kind)
            header = coded.header
        n = coded.nbytes
        # Frames are cut in the order they are sent: a frame is sent in the job that
        # writes it (an ERROR frame in place of one that failed to write).
        cut = self._cutter.cut(len(header), n)
        wait = timeout or self.timeout
        slot = self._shm.take(n) if self._shm and not cut.inline and n >= MIN_PAYLOAD else None
        if slot is not None:  # the payload goes into shared memory, its Ref on the wire
            cut = self._cutter.cut(len(header), n, shm=True)
        message = _message(self._messages, cut)
        if self._streams is not None:
            if isinstance(coded, Decoded):
                part, staging, block = self._parts.prepacked(batch, coded, device, wait)
            else:
                part, staging, block = self._parts.packed(coded, device, wait)
            return self._finish(message, cut, Kind.DATA, header, staging, n, block), part
        if slot is not None:
            slot.ref.pack_into(message.mem, cut.payload_at)
            payload, (own, repads) = _in_slot(batch, coded, slot, self._reuse)
        else:
            payload, (own, repads) = _on_host(batch, coded, message, cut, self._pool, self._device)
        if device is not None and device != payload.device:
            own = self._parts.upload(payload, device, coded, wait)
            repads = []  # the host tree is not handed out
        ref = None if slot is None else slot.ref
        out = self._finish(message, cut, Kind.DATA, header, payload, n, ref=ref)
        out.repads.extend(repads)
        return out, own

    def _control(self, kind: Kind, text: bytes) -> Outgoing:
        self.group.lane.check()
        cut = self._cutter.cut(len(text), 0)
        return self._finish(_message(self._messages, cut), cut, kind, text, None)

    def _finish(
        self,
        message: FirstMessage,
        cut: Cut,
        kind: Kind,
        header: bytes,
        payload: torch.Tensor | None,
        nbytes: int = 0,
        block: torch.Tensor | None = None,
        ref: Ref | None = None,
    ) -> Outgoing:
        """Write the header (the payload is in place already; on a device wire
        ``payload`` is its host staging, or None, and travels later)."""
        crc: int | None = None
        if self._verify and kind == Kind.DATA:
            covered = payload
            if covered is None:
                covered = _no_staging() if nbytes else torch.empty(0, dtype=torch.uint8)
            crc = crc32(covered, header)
        spilled: torch.Tensor | None = None
        if cut.spill:
            spilled = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        else:
            message.mem[PREFIX_SIZE : PREFIX_SIZE + len(header)] = header
        on_host = self._streams is None
        # a relayed channel sends the payload to remote hosts even from a slot
        relayed = cut.shm and self._relay is not None
        separate = payload if (cut.separate_payload or relayed) and on_host else None
        promised: torch.Tensor | None = None
        if cut.in_promise:
            promised = payload
        elif cut.promised:  # a promise this frame cannot keep: its receivers drop these
            promised = torch.zeros(cut.promised, dtype=torch.uint8, device=self._device)
        host_leaves = block if block is not None and block.numel() else None
        return Outgoing(
            kind, cut, message, len(header), crc, promised, spilled, separate, host_leaves, ref
        )

    # -- phase 2: the collectives --------------------------------------------------------

    def _failed(self, error: BaseException) -> None:
        """Posting a device payload failed: the frame is half sent (see :meth:`send`)."""
        self.group.lane.break_(error)
        if isinstance(error, RuntimeError):
            raise self._peer_error(error, self.timeout) from error

    def _peer_error(self, error: BaseException, timeout: datetime.timedelta) -> PeerError:
        return PeerError(
            f"source rank (group rank {self._root}) of ranks {list(self.group.ranks)}: sending "
            f"a frame failed: a receiver died, or did not take it within "
            f"{timeout.total_seconds():g} s (a receiver that broke out of a loader's "
            f"loop after another batch than this rank says so in its own error) "
            f"({type(error).__name__}: {error})"
        )

    def send(
        self, out: Outgoing, timeout: datetime.timedelta | None = None, stamp: Stamp | None = None
    ) -> None:
        """Post a frame :meth:`write` made, stamped with ``stamp`` (default: the sender's):
        counted first, then its messages in order (NOTE [ A frame is atomic ]); a failure
        breaks the lane."""
        if stamp is None:
            stamp = self.stamp
        step = stamp.step
        stamp.step = step + 1
        self.frames += 1
        wait = timeout or self.timeout
        wire, root, message = self.group.wire, self._root, out.message
        try:
            self._cutter.commit(
                message.mem, out.kind, out.cut, out.header_len, out.crc, self.id,
                stamp.pass_index, step,
            )  # fmt: skip
            if out.ref is not None and self._shm is not None:
                self._shm.sent(out.ref)
            # Receivers posted a promised payload with the first message.
            promised = None if out.promised is None else wire.payload(out.promised, root, wait)
            head = wire.head(message.buffer, root, wait)
            if out.cut.inline:  # the next frame like it views this message again
                message.kept.detach_ahead()  # NOTE [ Views made ahead ]
            if out.payload is None:
                _run(out.repads)
            head.wait(wait)
            if promised is not None:
                promised.wait(wait)
            if out.header is not None:
                wire.head(out.header, root, wait).wait(wait)
            if out.host_leaves is not None:  # a device frame's leaves that are not tensors
                wire.head(out.host_leaves, root, wait).wait(wait)
            if out.payload is not None:
                relay = self._relay
                posted = (
                    wire.payload(out.payload, root, wait)
                    if relay is None
                    else relay.send(wire, out.payload, out.cut.shm)
                )
                _run(out.repads)
                posted.wait(wait)
        except RuntimeError as e:  # from the collective: a peer died or timed out
            self._broke(e)
            raise self._peer_error(e, wait) from e
        except BaseException as e:  # e.g. a signal handler's: raised as it is
            self._broke(e)
            raise

    def _broke(self, error: BaseException) -> None:
        self.group.lane.break_(error)
        if self._shm is not None:  # no frame follows: nothing may stay in /dev/shm
            self._shm.close()


def _message(messages: FramePool, cut: Cut) -> FirstMessage:
    """A first message for ``cut``, every byte zero but where the frame writes: no
    stale memory of this process travels. Cleared before the payload is written,
    which may lie where the last frame's head was."""
    message = messages.take(cut.capacity)
    head_end = PREFIX_SIZE + (0 if cut.spill else cut.header_len)
    if cut.inline:
        start, end = cut.payload_at, cut.payload_at + cut.payload_len
    elif cut.shm:  # the slot's Ref
        start, end = cut.payload_at, cut.capacity
    else:
        start = end = cut.capacity
    host = message.host
    last_head, last_start, last_end = message.written
    if last_head > head_end:
        host[head_end:last_head] = 0
    if last_start < start:
        host[last_start : min(start, last_end)] = 0
    if last_end > end:
        host[max(end, last_start) : last_end] = 0
    message.written = (head_end, start, end)
    return message


def _on_host(
    batch: Any,
    coded: Decoded | Encoded,
    message: FirstMessage,
    cut: Cut,
    pool: BufferPool,
    device: torch.device,
) -> tuple[torch.Tensor, tuple[Any, list[Repad]]]:
    """A host frame's payload, written where it travels (inline in ``message``, else a
    buffer of ``pool``'s or the :class:`Packed` batch's own), and this rank's tree of it
    with the tree's re-pads left to run (NOTE [ The own tree's re-pads ])."""
    n, reuse = coded.nbytes, pool.keeper
    if isinstance(coded, Encoded):
        inline = message.inline_payload(cut.payload_at, n) if cut.inline else None
        payload = pool.take(n, device) if inline is None else inline
        return payload, coded.write_tree(payload, reuse)
    buffer = batch.buffer
    if cut.inline:
        payload = message.inline_payload(cut.payload_at, n)
        payload.copy_(buffer)
        return payload, coded.rebuild_later(payload, reuse)
    if not buffer.is_cpu:
        buffer = buffer.cpu()  # a host wire: the bytes travel from the host
    elif buffer.numel() <= _COPY_BELOW:
        # Views of a pooled buffer are kept and handed out again as detached copies,
        # while a buffer of the caller's needs each view made anew: for a small batch
        # of many leaves a copy into a pooled buffer is the cheaper of the two.
        copy = pool.take(buffer.numel(), device).copy_(buffer)
        return copy, coded.rebuild_later(copy, reuse)
    elif buffer.is_inference():
        buffer = buffer.clone()  # this rank's tree must not be made of inference tensors
    return buffer, coded.rebuild_later(buffer, reuse)


def _no_staging() -> torch.Tensor:
    raise ValueError(
        "verify=True on an NCCL group needs the payload's CRC32 on the host, and a "
        "batch already on the GPU has no host copy: pass CPU batches (they are staged "
        "through pinned memory anyway), or verify=False"
    )


def _in_slot(
    batch: Any, coded: Decoded | Encoded, slot: Taken, reuse: Keeper
) -> tuple[torch.Tensor, tuple[Any, list[Repad]]]:
    """A payload written into a shared-memory slot (``slot.into``), and this rank's tree
    of views of it (``slot.seen``, this process's own: NOTE [ Private views of a slot ];
    released by the rule its readers follow) with the tree's re-pads left to run."""
    if isinstance(coded, Encoded):
        return slot.into, coded.write_tree(slot.into, reuse, seen=slot.seen)
    slot.into.copy_(batch.buffer)
    return slot.into, coded.rebuild_later(slot.seen, reuse)


def _run(repads: list[Repad]) -> None:
    """Run the own tree's re-pads (NOTE [ The own tree's re-pads ]), once."""
    for repad in repads:
        repad()
    repads.clear()
