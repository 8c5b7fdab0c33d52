"""Ways for a test to stall a process as real sources do."""

from __future__ import annotations

import time


def hold_gil(seconds: float) -> None:
    """One call that holds the GIL for about ``seconds``, or longer on a busy machine
    (``sum`` over a ``range`` runs in C and never lets another thread in; a sleep or a
    Python loop would). Timed on the fastest of three short runs."""
    n = 10**6
    took = []
    for _ in range(3):
        start = time.monotonic()
        sum(range(n))
        took.append(time.monotonic() - start)
    sum(range(int(n * seconds / max(min(took), 1e-6))))
