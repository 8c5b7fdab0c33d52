"""Ways for a test to stall a process as real sources do."""

from __future__ import annotations

import sys
import time


def hold_gil(seconds: float) -> None:
    """Hold the GIL for at least ``seconds`` (by the clock), letting no other thread in.

    A thread waiting for the GIL asks for it once the switch interval has passed; raised
    past the hold, nobody asks, so a loop of short C calls (``sum`` over a ``range``) keeps
    it throughout while reading the clock. A loop timed on a calibration run held it for
    less than asked when the machine was slower during the calibration than after."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 60.0)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sum(range(10**5))
    finally:
        sys.setswitchinterval(old)
