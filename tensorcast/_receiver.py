"""A receiver's side of a channel: a frame off the wire, validated, rebuilt as views.

A frame is read in the order the source cut it (``_frame.plan_frame`` on both sides):
the first message, then a spilled header, then a separate payload. The prefix and the
header are validated before anything is allocated from their sizes. Until the whole
frame is in, any failure breaks the lane (this rank cannot skip the rest of a frame it
cannot read); once it is in, a bad CRC is an error of that step alone.

# NOTE [ Views made ahead ]
A batch of many small leaves spends much of each rank's time making one fresh tensor per
leaf, a ``detach()`` of the views its first message keeps (see ``_pool``). Both sides
make them while a head is on the wire, where they would only wait: a receiver once it
has posted the receive of the first message it is about to read, for the layout that
message carried last; the source once it has posted its first message, for the next
frame of the same layout that comes back to that message (its batch dropped by then).
When the frame has that layout they are its leaves; when not, they are dropped. Nothing
travels and nothing waits on them: they are made after the posting, before the wait.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch

from tensorcast import _codec, _schema
from tensorcast._errors import DesyncError, HeaderError, PeerError, TensorcastError
from tensorcast._frame import PREFIX_SIZE, Flags, FramePlan, Kind, Prefix, plan_frame
from tensorcast._groups import Group
from tensorcast._pool import BufferPool, FramePool, KeepsViews, Message
from tensorcast._promise import Promises
from tensorcast._sender import Stamp, crc32
from tensorcast._wire import Posted

__all__ = ["Receiver"]

_CUT = int(Flags.INLINE | Flags.SPILL)
_CRC = int(Flags.CRC)
_PROMISED = int(Flags.PROMISED)


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
        self._inline_ok = group.wire.device.type == "cpu"  # payloads on the host
        self._promises = Promises(promises and self._inline_ok)

    def recv(
        self, expect: Stamp, device: torch.device | None, timeout: datetime.timedelta
    ) -> tuple[Kind, Any]:
        """The next frame: ``(DATA, tree)``, ``(END, None)`` or ``(ERROR, message)``.

        Raises:
            PeerError: the source died or did not send within ``timeout``.
            DesyncError: the frame is another step's, or another channel's.
            HeaderError: the frame is malformed or from another version.
        """
        first = self._messages.take(self._group.capacity)
        try:
            return self._recv(first, expect, device, timeout)
        finally:
            first.drop_ahead()  # when the frame did not use them

    def _recv(
        self,
        first: Message,
        expect: Stamp,
        device: torch.device | None,
        timeout: datetime.timedelta,
    ) -> tuple[Kind, Any]:
        group, wire = self._group, self._group.wire
        capacity = first.capacity
        promised = self._promises.next()
        posted: tuple[torch.Tensor, Posted] | None = None
        try:
            if promised:  # the source posts it with the first message
                buffer = self._pool.take(promised, wire.device)
                posted = buffer, wire.payload(buffer, self._root, timeout)
            head = wire.head(first.buffer, self._root, timeout)
            first.detach_ahead()  # NOTE [ Views made ahead ]
            head.wait(timeout)
        except RuntimeError as e:  # from the collective: the source died or timed out
            group.lane.break_(e)
            raise PeerError(
                f"waiting for the source rank {self._src} on ranks {list(group.ranks)} "
                f"failed after up to {timeout.total_seconds():g} s: "
                f"{self._diagnose(expect, e, timeout.total_seconds())} "
                f"({type(e).__name__}: {e})"
            ) from e
        except BaseException as e:
            group.lane.break_(e)
            raise
        try:
            prefix, header, decoded, payload, pool = self._rest(
                first, capacity, expect, timeout, posted
            )
        except (TensorcastError, RuntimeError) as e:
            group.lane.break_(e)
            if isinstance(e, TensorcastError):
                raise
            raise PeerError(
                f"receiving the rest of a frame from the source rank {self._src} on ranks "
                f"{list(group.ranks)} failed: {type(e).__name__}: {e}"
            ) from e
        except BaseException as e:
            group.lane.break_(e)
            raise
        group.capacity = prefix.next_capacity
        if prefix.kind == Kind.END:
            return Kind.END, None
        if prefix.kind == Kind.ERROR or decoded is None or payload is None:
            return Kind.ERROR, header.decode("utf-8", "replace")
        if int(prefix.flags) & _CRC and crc32(payload) != prefix.crc:
            raise HeaderError(
                f"step {expect.step}: the payload's CRC32 does not match the source's: the "
                f"bytes were corrupted in transit"
            )
        if device is not None and device != payload.device:
            return Kind.DATA, _codec.rebuild(decoded, _codec.copy_to_device(payload, device))
        return Kind.DATA, _codec.rebuild(decoded, payload, pool=pool)

    def _plan(self, prefix: Prefix, capacity: int, expect: Stamp, promised: int) -> FramePlan:
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
        plan = plan_frame(
            capacity,
            prefix.header_len,
            prefix.payload_len,
            inline_ok=self._inline_ok,
            promised=promised,
        )
        flags = int(prefix.flags)  # int arithmetic: an IntFlag's is Python code, and slow
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

    def _rest(
        self,
        first: Message,
        capacity: int,
        expect: Stamp,
        timeout: datetime.timedelta,
        posted: tuple[torch.Tensor, Posted] | None,
    ) -> tuple[Prefix, bytes, _schema.Decoded | None, torch.Tensor | None, KeepsViews]:
        """Validate the first message and take what follows it (``posted``: the promised
        message, with its buffer)."""
        wire = self._group.wire
        mem = first.mem
        prefix = Prefix.unpack(mem, capacity)
        plan = self._plan(prefix, capacity, expect, 0 if posted is None else posted[0].numel())
        self._promises.record(plan)
        if posted is not None:
            posted[1].wait(timeout)  # the payload, or zeros where the promise was not kept
        if plan.spill:
            spilled = torch.empty(prefix.header_len, dtype=torch.uint8)
            wire.head(spilled, self._root, timeout).wait(timeout)
            header = spilled.numpy().tobytes()
        else:
            header = mem[PREFIX_SIZE : PREFIX_SIZE + prefix.header_len].tobytes()
        if prefix.kind != Kind.DATA:
            return prefix, header, None, None, self._pool
        decoded = _schema.decode(header)  # validated before its sizes allocate anything
        if decoded.nbytes != prefix.payload_len:
            raise HeaderError(
                f"the header describes a {decoded.nbytes}-byte buffer but the frame carries "
                f"{prefix.payload_len} bytes"
            )
        n = prefix.payload_len
        if plan.inline:
            return prefix, header, decoded, first.payload(plan.payload_at, n), first
        if plan.in_promise and posted is not None:
            return prefix, header, decoded, posted[0], self._pool
        payload = self._pool.take(n, wire.device)
        if n:
            wire.payload(payload, self._root, timeout).wait(timeout)
        return prefix, header, decoded, payload, self._pool
