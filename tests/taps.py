"""Hooks around the messages a rank moves, for multi-process tests: a bad link, a lying
source, a failing collective, a count of messages. Nothing is patched: a :class:`WireTap`
wraps the wires of the groups made inside ``groups.wrapping_wires(tap.wrap)``, and
:func:`tapped` runs a rank function on a new default group (so tensorcast's groups are
made afresh, inside it) with every one of its wires tapped.

    @tapped
    def _rank_fn(rank, world, tap):
        with tap.hook("payload", after=flip_a_byte):  # flip_a_byte(wire, tensor, root)
            ...

A hook sees the tapped wire (``wire.rank`` is the rank in tensorcast's group), the tensor
and the root: ``before`` just before the real wire posts the message (raising there means
the message is never posted), ``after`` once it has moved (when it is waited for).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from rankpool import in_a_new_process_group

from tensorcast.transport.frame import PREFIX_SIZE, Flags, Prefix, cut_frame
from tensorcast.transport.groups import wrapping_wires

Hook = Callable[[Any, torch.Tensor, int], None]
MESSAGES = ("head", "payload")


class WireTap:
    """The hooks of this rank's tapped wires, set and cleared as a test goes."""

    def __init__(self) -> None:
        self.wires: list[TappedWire] = []
        self._hooks: dict[str, tuple[Hook | None, Hook | None]] = {}

    def wrap(self, wire: Any) -> TappedWire:
        """What ``groups.wrapping_wires`` takes: each group's wire, tapped."""
        self.wires.append(TappedWire(wire, self))
        return self.wires[-1]

    @contextlib.contextmanager
    def hook(
        self, name: str, *, before: Hook | None = None, after: Hook | None = None
    ) -> Iterator[None]:
        """Run ``before`` / ``after`` around every ``name`` message (``"head"`` or
        ``"payload"``) of the tapped wires, within the block."""
        if name not in MESSAGES:
            raise ValueError(f"no {name!r} message: one of {MESSAGES}")
        if name in self._hooks:
            raise RuntimeError(f"the {name} messages are hooked already")
        self._hooks[name] = before, after
        try:
            yield
        finally:
            del self._hooks[name]

    def forward(
        self, name: str, wire: TappedWire, tensor: torch.Tensor, root: int, timeout: Any
    ) -> Any:
        before, after = self._hooks.get(name, (None, None))
        if before is not None:
            before(wire, tensor, root)
        posted = getattr(wire.real, name)(tensor, root, timeout)
        if after is None:
            return posted
        return _Then(posted, lambda: after(wire, tensor, root))


class TappedWire:
    """A wire that runs its tap's hooks around each message it forwards to ``real``;
    everything else is the real wire's."""

    def __init__(self, real: Any, tap: WireTap) -> None:
        self.real = real
        self._tap = tap

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def head(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Any:
        return self._tap.forward("head", self, tensor, root, timeout)

    def payload(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Any:
        return self._tap.forward("payload", self, tensor, root, timeout)


class _Then:
    """A posted message that runs ``then`` once it has been waited for."""

    def __init__(self, posted: Any, then: Callable[[], None]) -> None:
        self._posted, self._then = posted, then

    def wait(self, timeout: Any) -> None:
        self._posted.wait(timeout)
        self._then()


def tapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn(rank, world, tap, *args)`` on a new default group (see
    ``rankpool.in_a_new_process_group``) whose tensorcast groups all have tapped wires."""

    @functools.wraps(fn)
    def run(rank: int, world: int, *args: Any, **kwargs: Any) -> Any:
        tap = WireTap()
        with wrapping_wires(tap.wrap):
            return fn(rank, world, tap, *args, **kwargs)

    return in_a_new_process_group(run)


def first_message_problems(first: torch.Tensor) -> list[str]:
    """What is wrong with a source's first message: a byte that is not zero outside its
    prefix, its header and its inline payload (the stale bytes of an earlier frame, or of
    this process's memory, travelling to the peers)."""
    data = first.numpy()
    capacity = len(data)
    prefix = Prefix.unpack(data.data, capacity)
    plan = cut_frame(capacity, prefix.header_len, prefix.payload_len, host_payloads=True)
    if plan.flags != prefix.flags & (Flags.INLINE | Flags.SPILL):
        return [f"flags {prefix.flags!r} but the plan says {plan.flags!r}"]
    head = PREFIX_SIZE + (0 if plan.spill else plan.header_len)
    at = end = capacity
    if plan.inline:
        at, end = plan.payload_at, plan.payload_at + plan.payload_len
    problems = []
    if data[head:at].any():
        problems.append(f"non-zero bytes between the head ({head}) and {at}")
    if data[end:].any():
        problems.append(f"non-zero bytes after the inline payload ({end} of {capacity})")
    return problems
