"""The interrupt points' seam (NOTE [ Interrupts ]): ``tensorcast.testing.interrupt_at``
arms the one hook that the lane and the loader read, the loader through the transport's
face. Where each point is reached, and what holds there: ``tests/gloo/test_dist_interrupts``.
"""

from __future__ import annotations

import pytest

import tensorcast.transport
from tensorcast.testing import POINTS, interrupt_at
from tensorcast.transport import interrupts


def test_interrupt_at_arms_the_hook_the_loader_reads_and_disarms_it() -> None:
    points = tensorcast.transport.interrupt_points
    assert points is interrupts.points and points.hook is None
    with interrupt_at("next.start", KeyboardInterrupt) as armed:
        assert points.hook is armed
        with pytest.raises(KeyboardInterrupt):
            points.hook("next.start")
    assert points.hook is None


def test_the_points_named_are_the_points_documented() -> None:
    assert POINTS == interrupts.POINTS
    for point in POINTS:
        assert f"``{point}``" in (interrupts.__doc__ or ""), point
