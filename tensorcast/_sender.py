"""The source's side of a channel: a batch into a frame, the frame onto the wire.

Two phases, so that a frame is atomic (NOTE [ A frame is atomic ]):

1. :meth:`Sender.data` / :meth:`end` / :meth:`error` do everything that can fail:
   flatten, detach, allocate, copy, write the first message and build this rank's own
   tree. Nothing has been sent, so a failure can still be announced with an ERROR frame.
2. :meth:`Sender.send` runs the collectives, and nothing else. A failure there breaks
   the lane (see ``_lane``), so no rank can ever read a frame that is half old, half new.

# NOTE [ A frame is atomic ]
Every frame is posted whole by one job on the lane's worker thread. A signal handler
that raises (Ctrl-C, SIGTERM) runs on the caller's thread, so it interrupts the caller's
wait, never the frame; and the source's result is a tree of views into the buffer it is
about to send, built before the first message, so the source and the receivers return
the same tree (detached, not inference tensors) or none of them does.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorcast import _codec, _schema
from tensorcast._codec import Packed
from tensorcast._errors import PeerError
from tensorcast._frame import (
    MAX_ERROR_BYTES,
    PREFIX_SIZE,
    Flags,
    FramePlan,
    Kind,
    Prefix,
    plan_frame,
)
from tensorcast._groups import Group
from tensorcast._pool import BufferPool

__all__ = ["Outgoing", "Sender", "Stamp", "crc32"]

# A pre-packed buffer up to this size is copied into a pooled one (see Sender._prepacked).
_COPY_BELOW = 1 << 20


@dataclass(frozen=True, slots=True)
class Stamp:
    """Which frame this is: the channel, the loader's pass, the step within it."""

    channel: int
    pass_index: int
    step: int


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A frame written and ready for its collectives."""

    plan: FramePlan
    first: torch.Tensor
    header: torch.Tensor | None  # the spilled header, when it did not fit
    payload: torch.Tensor | None  # the payload, when it travels on its own


def crc32(buffer: torch.Tensor) -> int:
    return zlib.crc32(buffer.cpu().numpy().data) if buffer.numel() else 0


class Sender:
    """Writes and sends the frames of one source on one of tensorcast's groups.

    Args:
        group: tensorcast's group the frames travel on.
        root: the source's group-local rank (this rank).
        verify: carry a CRC32 of every payload.
    """

    def __init__(self, group: Group, root: int, *, verify: bool = False) -> None:
        self._group = group
        self._root = root
        self._verify = verify
        self._device = group.wire.device
        self._pool = BufferPool()
        self._layout: _codec.Layout | None = None  # the last batch's, reused when it repeats
        self._first: torch.Tensor | None = None  # this rank's first message, reused
        self._host: np.ndarray = np.empty(0, np.uint8)  # and a numpy view of it
        self._inline_ok = self._device.type == "cpu"
        self._written = (0, 0, 0)  # the last first message's head end, inline start and end

    # -- phase 1: everything that can fail ---------------------------------------------

    def data(self, batch: Any, stamp: Stamp, device: torch.device | None) -> tuple[Outgoing, Any]:
        """The frame of ``batch`` (a tree or a :class:`Packed`) and this rank's own tree.

        Raises:
            UnsupportedLeafError, ValueError, HeaderError: the batch cannot travel.
        """
        with torch.no_grad():
            if isinstance(batch, Packed):
                header, payload, own = self._prepacked(batch)
            else:
                header, payload, own = self._packed(batch)
            if device is not None and device != payload.device:
                own = _codec.rebuild(_schema.decode(header), _codec.copy_to_device(payload, device))
        return self._frame(Kind.DATA, header, payload, stamp), own

    def end(self, stamp: Stamp) -> Outgoing:
        return self._frame(Kind.END, b"", None, stamp)

    def error(self, message: str, stamp: Stamp) -> Outgoing:
        text = message.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
        return self._frame(Kind.ERROR, text, None, stamp)

    def _packed(self, tree: Any) -> tuple[bytes, torch.Tensor, Any]:
        plan = _codec.plan(tree, previous=self._layout)
        self._layout = plan.layout  # no tensors: it keeps no batch alive
        if self._device.type == "cuda" and plan.device.type == "cpu":
            # Packed on the host into pinned memory, then one asynchronous copy to the GPU.
            staging = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=True)
            plan.write(staging)
            payload = _codec.copy_to_device(staging, self._device)
            return plan.header, payload, _codec.rebuild(_schema.decode(plan.header), payload)
        payload = self._pool.take(plan.nbytes, self._device)
        views = plan.layout.write_spec().pooled_views(payload, self._pool)
        views = plan.write(payload, views=views)
        own = _codec.rebuild(_schema.decode(plan.header), payload, plan.values(payload, views))
        return plan.header, payload, own

    def _prepacked(self, batch: Packed) -> tuple[bytes, torch.Tensor, Any]:
        decoded = _schema.decode(batch.header)
        _codec._check_buffer(batch.buffer, decoded.nbytes)
        payload = batch.buffer
        if payload.device != self._device:
            payload = _codec.copy_to_device(payload, self._device)
        elif payload.numel() <= _COPY_BELOW and payload.is_cpu:
            # Views of a pooled buffer are kept and handed out again as detached copies,
            # while a buffer of the caller's needs each view made anew (a microsecond or
            # two a leaf): for a small batch of many leaves the copy is far cheaper.
            copy = self._pool.take(payload.numel(), self._device).copy_(payload)
            return batch.header, copy, _codec.rebuild(decoded, copy, pool=self._pool)
        elif payload.is_inference():
            payload = payload.clone()  # this rank's tree must not be made of inference tensors
        return batch.header, payload, _codec.rebuild(decoded, payload)

    def _frame(
        self, kind: Kind, header: bytes, payload: torch.Tensor | None, stamp: Stamp
    ) -> Outgoing:
        n = 0 if payload is None else payload.numel()
        plan = plan_frame(self._group.capacity, len(header), n, inline_ok=self._inline_ok)
        flags = plan.flags
        crc = 0
        if self._verify and payload is not None:
            flags |= Flags.CRC
            crc = crc32(payload)
        first, host = self._first_message(plan)
        Prefix(
            kind,
            flags,
            stamp.channel,
            stamp.pass_index,
            stamp.step,
            len(header),
            n,
            plan.next_capacity,
            crc,
        ).pack_into(host.data)
        spilled: torch.Tensor | None = None
        if plan.spill:
            spilled = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        else:
            host[PREFIX_SIZE : PREFIX_SIZE + len(header)] = memoryview(header)
        separate = payload if plan.separate_payload else None
        if plan.inline and payload is not None and n:
            at = plan.payload_at
            host[at : at + n] = payload.numpy()  # the host's copy: no tensor op for a few bytes
        return Outgoing(plan, first, spilled, separate)

    def _first_message(self, plan: FramePlan) -> tuple[torch.Tensor, np.ndarray]:
        """This rank's first message (and a numpy view of it), with every byte but the new
        head and inline payload zero: no stale memory of this process travels."""
        head_end = PREFIX_SIZE + (0 if plan.spill else plan.header_len)
        start, end = (
            (plan.payload_at, plan.payload_at + plan.payload_len)
            if plan.inline
            else (plan.capacity, plan.capacity)
        )
        if self._first is None or self._first.numel() != plan.capacity:
            self._first = torch.zeros(plan.capacity, dtype=torch.uint8)
            self._host = self._first.numpy()
        else:  # clear what the last frame wrote where this one writes nothing
            host = self._host
            last_head, last_start, last_end = self._written
            if last_head > head_end:
                host[head_end:last_head] = 0
            if last_start < start:
                host[last_start : min(start, last_end)] = 0
            if last_end > end:
                host[max(end, last_start) : last_end] = 0
        self._written = (head_end, start, end)
        return self._first, self._host

    # -- phase 2: the collectives --------------------------------------------------------

    def send(self, out: Outgoing, timeout: Any) -> None:
        """Post the frame's messages in order; a failure breaks the lane."""
        wire, root = self._group.wire, self._root
        try:
            wire.head(out.first, root, timeout)
            if out.header is not None:
                wire.head(out.header, root, timeout)
            if out.payload is not None:
                wire.payload(out.payload, root, timeout)
        except RuntimeError as e:  # from the collective: a peer died or timed out
            self._group.lane.break_(e)
            raise PeerError(
                f"source rank (group rank {root}) of ranks {list(self._group.ranks)}: sending "
                f"a frame failed: a receiver died, or did not take it within "
                f"{timeout.total_seconds():g} s ({type(e).__name__}: {e})"
            ) from e
        except BaseException as e:  # e.g. a signal handler's: raised as it is
            self._group.lane.break_(e)
            raise
        self._group.capacity = out.plan.next_capacity
