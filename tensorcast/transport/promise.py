"""Promised payloads: a receive posted with the first message, on a rule both sides keep.

# NOTE [ Promised payloads ]
gloo sends a message once its receiver has posted the receive, so a separate payload
waits for receivers to read the first message first. When the channel's last ``need``
frames each carried a separate payload of ``n`` bytes, the next frame *promises* ``n``
bytes: every rank posts an ``n``-byte payload message with the first message. The
source's is the payload when that is separate and ``n`` bytes long, else ``n`` zero bytes
that receivers drop. ``need`` starts at 2 and doubles, up to 16, each time a promise is
not kept. Source and receivers apply the rule to the same frames in the same order, and
the prefix's ``Flags.PROMISED`` makes a rank whose rule disagrees fail loudly. Host
payloads only; ``TENSORCAST_PROMISES=0`` turns it off (the setup agreement checks that
every rank agrees). Why and what it costs: ``docs/design.md``, section 7.
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

    def record(self, plan: FramePlan) -> int:
        """A frame cut as ``plan`` went on (or came off) the wire; returns :meth:`next`."""
        n = 0 if plan.inline else plan.payload_len  # outside the first message, or none
        if plan.promised and not plan.in_promise:
            self._need = min(2 * self._need, _MAX_NEED)
        if n and n == self._last:
            self._run += 1
        else:
            self._last, self._run = n, 1 if n else 0
        return self._last if self._on and self._run >= self._need else 0


class Cutter:
    """How one side of a channel cuts its frames, one after another: at the group's
    first-message capacity, with this channel's promises. The source and every receiver
    make the same calls for the same frames in the same order, so they cut each alike.

    Args:
        group: the group whose ``capacity`` (the next first message's size, the same for
            every channel on it) this cutter reads and advances.
        promises: whether this channel promises payloads (host payloads only).
    """

    __slots__ = ("_group", "_promises", "host_payloads", "promised")

    def __init__(self, group: Any, *, promises: bool) -> None:
        self._group = group
        #: payloads live on the host, so they may travel inside the first message
        self.host_payloads = group.wire.streams is None
        self._promises = Promises(promises and self.host_payloads)
        #: the bytes the next frame promises (0: none), posted with its first message
        self.promised = 0

    @property
    def capacity(self) -> int:
        """The size of the next first message."""
        return int(self._group.capacity)

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
        self.promised = self._promises.record(plan)
        self._group.capacity = next_capacity
