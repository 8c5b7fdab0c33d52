"""The source's side of a channel: a batch into a frame, the frame onto the wire.

Two phases, so that a frame is atomic (NOTE [ A frame is atomic ]):

1. :meth:`Sender.data` / :meth:`end` / :meth:`close` / :meth:`error` do everything that can fail:
   flatten, detach, allocate, copy, write the first message and build this rank's own
   tree. Nothing has been sent, so a failure can still be announced with an ERROR frame.
2. :meth:`Sender.send` runs the collectives, and nothing else. A failure there breaks
   the lane (see ``transport.lane``), so no rank can ever read a frame that is half old, half new.

# NOTE [ A frame is atomic ]
A frame is posted whole by one lane job, on the lane's worker thread or inline on the
caller's (see ``transport.lane``). Anything that escapes once its first message is
posted, a peer's failure or a signal handler's exception alike, breaks the lane, so the
peers fail within their timeout instead of reading a frame that is half old, half new.
The channel counts the frame before posting it, so an exception that escapes between
the last message and the job's return (a handler runs when a call returns) finds the
count moved: the lane breaks instead of a retry sending the frame a second time.
And the source's result is a tree of views into the buffer it is about to send, built
before the first message: the source and the receivers return the same tree (detached,
not inference tensors) or none of them does.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tensorcast._errors import PeerError
from tensorcast.codec import packed as _codec
from tensorcast.codec import schema as _schema
from tensorcast.codec.packed import Packed
from tensorcast.transport.frame import (
    MAX_ERROR_BYTES,
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

__all__ = ["Outgoing", "Sender"]

# A pre-packed buffer up to this size is copied into a pooled one (see Sender._prepacked).
_COPY_BELOW = 1 << 20
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default process group timeout


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A frame written and ready for its collectives."""

    plan: FramePlan
    message: Message  # the first message's buffer, and what was made from it
    promised: torch.Tensor | None  # posted with the first message: the payload, or zeros
    header: torch.Tensor | None  # the spilled header, when it did not fit
    payload: torch.Tensor | None  # the payload, when it travels on its own
    host_leaves: torch.Tensor | None = None  # a device frame's host block (codec.views)


class Sender:
    """Writes and sends the frames of one source on one of tensorcast's groups.

    Args:
        group: tensorcast's group the frames travel on.
        root: the source's group-local rank (this rank).
        verify: carry a CRC32 of every payload.
        promises: promise payloads (see NOTE [ Promised payloads ]; host wires only).
    """

    def __init__(
        self,
        group: Group,
        root: int,
        *,
        verify: bool = False,
        promises: bool = False,
        timeout: datetime.timedelta = _DEFAULT_TIMEOUT,
    ) -> None:
        self._group = group
        self._root = root
        self._verify = verify
        self._timeout = timeout  # a device payload's deadline, unless a call gives one
        self._device = group.wire.device
        #: the wire's device streams: payloads are then posted by DevicePart
        self._streams = group.wire.streams
        self._pool = BufferPool()  # payloads that travel on their own
        self._parts = Staging(group, root, self._failed)  # device parts of frames
        self._messages = FramePool()  # first messages
        self._layout: _codec.Layout | None = None  # the last batch's, reused when it repeats
        self._cutter = Cutter(group, promises=promises)  # frames as they are sent

    # -- phase 1: everything that can fail ---------------------------------------------

    def data(
        self,
        batch: Any,
        stamp: Stamp,
        device: torch.device | None,
        timeout: datetime.timedelta | None = None,
    ) -> tuple[Outgoing, Any]:
        """The frame of ``batch`` (a tree or a :class:`Packed`) and this rank's own tree.

        The payload is written where it travels: into the first message when it fits
        there (inline), else into a buffer of its own. Where the payload, or this rank's
        tree, lives on a GPU, the own tree is a :class:`DevicePart` to post and take on
        the caller's thread (NOTE [ Device work at next() ]); ``timeout`` is its deadline.

        Raises:
            UnsupportedLeafError, ValueError, HeaderError: the batch cannot travel.
        """
        if isinstance(batch, Packed):
            decoded = _codec.read_prepacked(batch)
            header, n = batch.header, decoded.nbytes
        else:
            encoded = _codec.encode(batch, previous=self._layout)
            self._layout = encoded.layout  # no tensors: it keeps no batch alive
            header, n = encoded.header, encoded.nbytes
        frame = self._plan(len(header), n)
        message = self._message(frame)
        wait = timeout or self._timeout
        if self._streams is not None:
            if isinstance(batch, Packed):
                part, staging, block = self._parts.prepacked(batch, decoded, device, wait)
            else:
                part, staging, block = self._parts.packed(encoded, device, wait)
            out = self._finish(message, frame, Kind.DATA, header, staging, stamp, n, block)
            return out, part
        if frame.inline:
            payload = message.inline_payload(frame.payload_at, n)
            if isinstance(batch, Packed):
                source = batch.buffer if batch.buffer.is_cpu else batch.buffer.cpu()
                message.host[frame.payload_at : frame.payload_at + n] = source.numpy()
                own = _codec.rebuild(decoded, payload, pool=message.kept)
            else:
                own = encoded.write_tree(payload, message.kept)
        elif isinstance(batch, Packed):
            payload, own = self._prepacked(batch, decoded)
        else:
            payload, own = self._packed(encoded)
        out = self._finish(message, frame, Kind.DATA, header, payload, stamp, n)
        if device is not None and device != payload.device:
            build: Callable[[torch.Tensor], Any]
            if isinstance(batch, Packed):
                build = functools.partial(_codec.rebuild, decoded)
            else:
                build = encoded.view_tree
            own = self._parts.upload(payload, device, build, wait)
        return out, own

    def end(self, stamp: Stamp) -> Outgoing:
        return self._control(Kind.END, b"", stamp)

    def close(self, stamp: Stamp) -> Outgoing:
        return self._control(Kind.CLOSE, b"", stamp)

    def error(self, message: str, stamp: Stamp) -> Outgoing:
        return self._control(
            Kind.ERROR, message.encode("utf-8", "replace")[:MAX_ERROR_BYTES], stamp
        )

    def _control(self, kind: Kind, text: bytes, stamp: Stamp) -> Outgoing:
        frame = self._plan(len(text), 0)
        return self._finish(self._message(frame), frame, kind, text, None, stamp)

    @staticmethod
    def _no_staging() -> torch.Tensor:
        raise ValueError(
            "verify=True on an NCCL group needs the payload's CRC32 on the host, and a "
            "batch already on the GPU has no host copy: pass CPU batches (they are staged "
            "through pinned memory anyway), or verify=False"
        )

    def _plan(self, header_len: int, payload_len: int) -> FramePlan:
        # Frames are cut in the order they are sent: a frame is sent in the job that
        # prepares it (an ERROR frame in place of one that failed to prepare).
        cutter = self._cutter
        return cutter.cut(header_len, payload_len, cutter.promised)

    def _packed(self, encoded: _codec.Encoded) -> tuple[torch.Tensor, Any]:
        payload = self._pool.take(encoded.nbytes, self._device)
        return payload, encoded.write_tree(payload, self._pool.kept)

    def _prepacked(self, batch: Packed, decoded: _schema.Decoded) -> tuple[torch.Tensor, Any]:
        payload = batch.buffer
        if not payload.is_cpu:
            payload = payload.cpu()  # a host wire: the bytes travel from the host
        elif payload.numel() <= _COPY_BELOW:
            # Views of a pooled buffer are kept and handed out again as detached copies,
            # while a buffer of the caller's needs each view made anew: for a small batch
            # of many leaves a copy into a pooled buffer is the cheaper of the two.
            copy = self._pool.take(payload.numel(), self._device).copy_(payload)
            return copy, _codec.rebuild(decoded, copy, pool=self._pool.kept)
        elif payload.is_inference():
            payload = payload.clone()  # this rank's tree must not be made of inference tensors
        return payload, _codec.rebuild(decoded, payload)

    def _message(self, frame: FramePlan) -> Message:
        """A first message for ``frame``, every byte zero but where the frame writes: no
        stale memory of this process travels. Cleared before the payload is written,
        which may lie where the last frame's head was."""
        message = self._messages.take(frame.capacity)
        head_end = PREFIX_SIZE + (0 if frame.spill else frame.header_len)
        if frame.inline:
            start, end = frame.payload_at, frame.payload_at + frame.payload_len
        else:
            start = end = frame.capacity
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

    def _finish(
        self,
        message: Message,
        frame: FramePlan,
        kind: Kind,
        header: bytes,
        payload: torch.Tensor | None,
        stamp: Stamp,
        nbytes: int = 0,
        block: torch.Tensor | None = None,
    ) -> Outgoing:
        """Write the prefix and the header (the payload is in place already; on a device
        wire ``payload`` is its host staging, or None, and travels later)."""
        flags, crc = frame.flags, 0
        if self._verify and (payload is not None or nbytes):
            flags |= Flags.CRC
            crc = crc32(payload if payload is not None else self._no_staging())
        mem = message.mem
        Prefix.write(
            mem, kind, flags, stamp, len(header), frame.payload_len, frame.next_capacity, crc
        )
        spilled: torch.Tensor | None = None
        if frame.spill:
            spilled = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        else:
            mem[PREFIX_SIZE : PREFIX_SIZE + len(header)] = header
        on_host = self._streams is None
        separate = payload if frame.separate_payload and on_host else None
        promised: torch.Tensor | None = None
        if frame.in_promise:
            promised = payload
        elif frame.promised:  # a promise this frame cannot keep: its receivers drop these
            promised = torch.zeros(frame.promised, dtype=torch.uint8, device=self._device)
        host_leaves = block if block is not None and block.numel() else None
        return Outgoing(frame, message, promised, spilled, separate, host_leaves)

    # -- phase 2: the collectives --------------------------------------------------------

    def _failed(self, error: BaseException) -> None:
        """Posting a device payload failed: the frame is half sent (see :meth:`send`)."""
        self._group.lane.break_(error)
        if isinstance(error, RuntimeError):
            raise self._peer_error(error, self._timeout) from error

    def _peer_error(self, error: BaseException, timeout: datetime.timedelta) -> PeerError:
        return PeerError(
            f"source rank (group rank {self._root}) of ranks {list(self._group.ranks)}: sending "
            f"a frame failed: a receiver died, or did not take it within "
            f"{timeout.total_seconds():g} s (a receiver that broke out of a loader's "
            f"loop after another batch than this rank says so in its own error) "
            f"({type(error).__name__}: {error})"
        )

    def send(self, out: Outgoing, timeout: Any) -> None:
        """Post the frame's messages in order; a failure breaks the lane."""
        wire, root = self._group.wire, self._root
        try:
            # Receivers posted a promised payload with the first message.
            promised = None if out.promised is None else wire.payload(out.promised, root, timeout)
            head = wire.head(out.message.buffer, root, timeout)
            if out.plan.inline:  # the next frame like it views this message again
                out.message.kept.detach_ahead()  # see receiver, NOTE [ Views made ahead ]
            head.wait(timeout)
            if promised is not None:
                promised.wait(timeout)
            if out.header is not None:
                wire.head(out.header, root, timeout).wait(timeout)
            if out.host_leaves is not None:  # a device frame's leaves that are not tensors
                wire.head(out.host_leaves, root, timeout).wait(timeout)
            if out.payload is not None:
                wire.payload(out.payload, root, timeout).wait(timeout)
            self._cutter.done(out.plan, out.plan.next_capacity)  # the frame is out
        except RuntimeError as e:  # from the collective: a peer died or timed out
            self._group.lane.break_(e)
            raise self._peer_error(e, timeout) from e
        except BaseException as e:  # e.g. a signal handler's: raised as it is
            self._group.lane.break_(e)
            raise
