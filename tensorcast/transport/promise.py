"""Promised payloads: a receive posted with the first message, on a rule both sides keep.

# NOTE [ Promised payloads ]
gloo sends a message once its receiver has posted the receive. A payload that follows
its first message therefore waits for receivers to read that message and post the
payload's receive: at 10 MB about a sixth of the floor (``benchmarks/bench_gloo.py``,
``read_first``). Receivers can post it earlier only if they know, before the first
message arrives, which collective the source posts next. A *promise* is that knowledge,
kept by a rule that the source and every receiver apply to the frames of one channel,
in the order all of them put on or took off the wire:

    when the channel's last ``need`` frames each carried a separate payload of ``n``
    bytes, the next frame *promises* ``n`` bytes; ``need`` starts at 2 and doubles, up to
    16, each time a promise is not kept.

In a promised frame, every rank posts an ``n``-byte payload message at the start of the
frame's job, together with the first message (the job runs alone on the lane, so no
other channel's collective can come between). The source's message is the frame's
payload when that is separate and ``n`` bytes long; otherwise (another size, an inline
payload, an END or ERROR frame) it is ``n`` zero bytes, which receivers drop, and the
frame goes on as an unpromised one would. The prefix carries ``Flags.PROMISED``, so a
rank whose rule disagrees fails loudly instead of reading the wrong bytes.

A promise kept saves a fraction of the payload's time and one not kept costs about the
whole of it, so the rule waits for a repeat and backs off. Fixed-shape batches (a
language model's packed sequences) are promised from their third frame on; each pass's
END frame breaks one promise. A loader whose sizes vary (lhotse's dynamic buckets)
rarely repeats a size, so it rarely promises; one whose sizes take a few values at
random breaks at most three promises before it needs runs of 16.

The switch: promises travel on the host wire only (a gloo payload) and can be turned off
with ``TENSORCAST_PROMISES=0``; every rank must agree, which the setup agreement checks.
"""

from __future__ import annotations

import os
from typing import Any

from tensorcast.transport.frame import FramePlan, plan_frame

__all__ = ["Cutter", "Promises", "enabled"]

_FIRST_NEED = 2  # same-size separate payloads in a row before a frame promises
_MAX_NEED = 16


def enabled() -> bool:
    """Whether channels set up now promise payloads (``TENSORCAST_PROMISES``, default on)."""
    return os.environ.get("TENSORCAST_PROMISES", "1") != "0"


class Promises:
    """The rule of NOTE [ Promised payloads ] for one channel, on one rank.

    Args:
        on: whether this channel promises at all (the switch, and a host wire).
    """

    __slots__ = ("_last", "_need", "_on", "_run")

    def __init__(self, on: bool) -> None:
        self._on = on
        self._last = 0  # the size of the last frame's separate payload (0: none)
        self._run = 0  # how many frames in a row carried one of that size
        self._need = _FIRST_NEED

    def next(self) -> int:
        """The bytes the next frame promises (0: none)."""
        return self._last if self._on and self._run >= self._need else 0

    def record(self, plan: FramePlan) -> None:
        """A frame cut as ``plan`` went on (or came off) the wire."""
        n = 0 if plan.inline else plan.payload_len  # outside the first message, or none
        if plan.promised and not plan.in_promise:
            self._need = min(2 * self._need, _MAX_NEED)
        if n and n == self._last:
            self._run += 1
        else:
            self._last, self._run = n, 1 if n else 0


class Cutter:
    """How one side of a channel cuts its frames, one after another: at the group's
    first-message capacity, with this channel's promises. The source and every receiver
    make the same calls for the same frames in the same order, so they cut each alike.

    Args:
        group: the group whose ``capacity`` (the next first message's size, the same for
            every channel on it) this cutter reads and advances.
        promises: whether this channel promises payloads (host payloads only).
    """

    __slots__ = ("_group", "_promises", "host_payloads")

    def __init__(self, group: Any, *, promises: bool) -> None:
        self._group = group
        #: payloads live on the host, so they may travel inside the first message
        self.host_payloads = group.wire.device.type == "cpu"
        self._promises = Promises(promises and self.host_payloads)

    @property
    def capacity(self) -> int:
        """The size of the next first message."""
        return int(self._group.capacity)

    def promised(self) -> int:
        """The bytes the next frame promises (0: none), posted with its first message."""
        return self._promises.next()

    def cut(self, header_len: int, payload_len: int, promised: int) -> FramePlan:
        """Cut the next frame (see ``plan_frame``)."""
        return plan_frame(
            self._group.capacity,
            header_len,
            payload_len,
            inline_ok=self.host_payloads,
            promised=promised,
        )

    def done(self, plan: FramePlan, next_capacity: int) -> None:
        """The frame cut as ``plan`` went on, or came off, the wire whole."""
        self._promises.record(plan)
        self._group.capacity = next_capacity
