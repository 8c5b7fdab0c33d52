"""Test helpers that ship with tensorcast: inject an interrupt at a named point.

``interrupt_at`` raises an exception the ``nth`` time the calling thread reaches one of
the points where a signal handler can land in a loader's ``next()`` or in
``tensorcast.broadcast`` (NOTE [ Interrupts ] in ``tensorcast.transport.interrupts``), as a
``SIGALRM`` handler would, but at exactly that point::

    from tensorcast.testing import POINTS, interrupt_at

    with interrupt_at("next.recorded") as armed:
        try:
            batch = next(it)
        except KeyboardInterrupt:
            batch = next(it)  # the same batch every peer gets
    assert armed.fired == 1

Nothing is patched: the library checks each point against one hook, unset by default.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from tensorcast.transport import interrupts
from tensorcast.transport.interrupts import points as _interrupts

__all__ = ["POINTS", "Armed", "interrupt_at"]

#: every point where an interrupt can land, in the order a pass reaches them
POINTS = interrupts.POINTS


class Armed:
    """What :func:`interrupt_at` armed: ``reached`` counts the visits to the point on the
    arming thread, ``fired`` the exceptions raised there."""

    def __init__(self, point: str, error: BaseException | type[BaseException], nth: int) -> None:
        self.point = point
        self.error = error
        self.nth = nth
        self.reached = 0
        self.fired = 0
        self._thread = threading.get_ident()

    def __call__(self, point: str) -> None:
        if point != self.point or threading.get_ident() != self._thread:
            return
        self.reached += 1
        if self.reached == self.nth:
            self.fired += 1
            raise self.error


@contextlib.contextmanager
def interrupt_at(
    point: str, error: BaseException | type[BaseException] = KeyboardInterrupt, *, nth: int = 1
) -> Iterator[Armed]:
    """Raise ``error`` the ``nth`` time this thread reaches ``point``, within the block.

    Args:
        point: one of :data:`POINTS`.
        error: the exception (a class or an instance) to raise there.
        nth: which visit to the point raises (1: the first).

    Raises:
        ValueError: ``point`` is not one of :data:`POINTS`, or ``nth < 1``.
        RuntimeError: another ``interrupt_at`` is already armed.
    """
    if point not in POINTS:
        raise ValueError(f"unknown point {point!r}; the points are {list(POINTS)}")
    if nth < 1:
        raise ValueError(f"nth counts visits from 1, got {nth}")
    if _interrupts.hook is not None:
        raise RuntimeError("interrupt_at is already armed; arm one point at a time")
    armed = Armed(point, error, nth)
    _interrupts.hook = armed
    try:
        yield armed
    finally:
        _interrupts.hook = None
