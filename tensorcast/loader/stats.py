"""Where a loader's steps spend their time: the caller's stall, the source, the transfer.

NOTE [ Where a step's time goes ]
A step, seen from the caller, runs from one ``next()``'s return to the next one's: the
caller's own work, then the *stall*, the time it waits inside ``next()`` for the batch.
Meanwhile the lane (see NOTE [ One ordered lane ]) runs the loader's jobs::

    caller:  |-- training step --|-- stall --|-- training step --|-- stall --|
    source:    next(source) -> pack -> transfer     next(source) -> ...
    receiver:  ---- wait_for_source ----> transfer  ---- wait_for_source ...

A receiver's job starts waiting for the frame's first message as soon as it runs: until
that message arrives it waits for the source (its ``next(source)``, its packing, its
steps before), which says nothing of the network; only the rest is the frame's transfer.
The split costs one ``perf_counter()`` as the first message arrives.

With ``prefetch=0`` the stall is the job itself; with ``prefetch > 0`` the job runs under
the caller's step and the stall is what it did not hide. Recording a step costs a few
appends: the last ``WINDOW`` steps are kept as they are and folded, a window at a time,
into log-spaced bins 2% wide, which is the precision of the pass's medians and p90 (its
totals and maxima are exact). Nothing grows with the world size or, beyond those fixed
bins, with the pass.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["WINDOW", "LoaderStats", "Recorder", "Timings"]

logger = logging.getLogger("tensorcast")

#: The most recent steps whose times are kept exactly: ``stats(last=N)`` takes N <= this.
WINDOW = 1000
_LOW, _RATIO, _BINS = 1e-6, 1.02, 1100  # bins from 1 us up to about 3 hours


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds over a span of steps: the median, the 90th percentile, the max, the sum."""

    median: float = 0.0
    p90: float = 0.0
    max: float = 0.0
    total: float = 0.0


@dataclass(frozen=True, slots=True)
class LoaderStats:
    """A loader's pass so far on this rank (``loader.stats()``), or its last steps.

    Attributes:
        steps: batches handed to the caller.
        bytes: bytes of the batches' buffers this rank sent (source) or received.
        stall: the time the caller waited inside ``next()``: the data stall.
        source: the time spent in ``next(source)`` (the source rank; zeros elsewhere).
        wait_for_source: receivers: the time a step waited for the source's frame to
            start arriving (its ``next(source)``, its packing, its steps before); zeros
            on the source rank. Not the network: a slow source shows here.
        transfer: the time moving a batch's frame: sending it whole (source; gloo sends
            once the receivers are ready), or receiving the rest of it once its first
            message arrived (receivers; about 0 for a batch inside the first message).
        step: the time from one ``next()``'s return to the next one's.
        stall_share: ``stall.total / step.total``: 0 when loading is hidden, 1 when the
            caller does nothing but wait.
        recent: the same for the last ``last`` steps (None on that one itself).
        last: how many steps ``recent`` covers at most.
        shm_bytes: of ``bytes``, those that went through shared memory instead of the
            wire (``shm=``); :attr:`wire_bytes` the rest.
    """

    steps: int = 0
    bytes: int = 0
    stall: Timings = Timings()
    source: Timings = Timings()
    wait_for_source: Timings = Timings()
    transfer: Timings = Timings()
    step: Timings = Timings()
    stall_share: float = 0.0
    recent: LoaderStats | None = None
    last: int = 0
    shm_bytes: int = 0

    @property
    def wire_bytes(self) -> int:
        """Of ``bytes``, those that travelled on the wire."""
        return self.bytes - self.shm_bytes


class _Samples:
    """Rows of per-step numbers: the last ``WINDOW`` exact, every one in the bins."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.recent: collections.deque[tuple[float, ...]] = collections.deque(maxlen=WINDOW)
        self.unfolded = 0  # the newest rows of ``recent``, not in the bins yet
        self.count = 0
        self.total = np.zeros(width)
        self.max = np.zeros(width)
        self.bins = np.zeros((width, _BINS), dtype=np.int64)

    def add(self, row: tuple[float, ...]) -> None:
        self.recent.append(row)
        self.unfolded += 1
        if self.unfolded == WINDOW:  # before the oldest unfolded row leaves ``recent``
            self.fold()

    def fold(self) -> None:
        if not self.unfolded:
            return
        rows = self.last(self.unfolded)
        self.unfolded = 0
        self.count += len(rows)
        self.total += rows.sum(axis=0)
        self.max = np.maximum(self.max, rows.max(axis=0))
        index = np.log(np.maximum(rows, _LOW) / _LOW) / math.log(_RATIO)
        index = np.clip(index.astype(np.int64), 0, _BINS - 1)
        for col in range(rows.shape[1]):
            self.bins[col] += np.bincount(index[:, col], minlength=_BINS)

    def timings(self, col: int) -> Timings:
        """Column ``col`` over every row, from the bins (call :meth:`fold` first)."""
        if not self.count:
            return Timings()
        cumulative = np.cumsum(self.bins[col])
        peak = float(self.max[col])

        def quantile(q: float) -> float:
            b = int(np.searchsorted(cumulative, q * self.count))
            return min(_LOW * _RATIO ** (b + 0.5), peak) if b else min(_LOW, peak)

        return Timings(quantile(0.5), quantile(0.9), peak, float(self.total[col]))

    def last(self, n: int) -> np.ndarray:
        rows = list(self.recent)[-n:] if n else []
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), self.width)


def _exact(column: np.ndarray) -> Timings:
    if not len(column):
        return Timings()
    p50, p90 = np.percentile(column, [50, 90])
    return Timings(float(p50), float(p90), float(column.max()), float(column.sum()))


def _share(stall: Timings, step: Timings) -> float:
    return stall.total / step.total if step.total > 0 else 0.0


class Recorder:
    """One pass's step times on this rank, recorded by the caller's thread as each batch
    is handed out, with what its job spent (a lock guards them, as ``stats()`` may be
    called from another thread). A job whose batch is never handed out (a pass left
    early) is not counted.

    Args:
        log_every: log the last ``log_every`` steps every ``log_every`` steps (None: never).
    """

    def __init__(self, log_every: int | None = None) -> None:
        # stall, step, source, wait_for_source, transfer, bytes, bytes through shared memory
        self._rows = _Samples(7)
        self._lock = threading.Lock()
        self._last_return: float | None = None
        self._log_every = log_every
        self._steps = 0

    def handed_out(
        self,
        called: float,
        source_s: float = 0.0,
        wait_s: float = 0.0,
        transfer_s: float = 0.0,
        nbytes: int = 0,
        now: float | None = None,
        shm_nbytes: int = 0,
    ) -> None:
        """A ``next()`` that began at ``called`` returns a batch ``now`` (default: now, by
        ``time.perf_counter()``, as ``called``); its job spent ``source_s`` in
        ``next(source)``, ``wait_s`` waiting for the source's frame and ``transfer_s``
        moving it, for ``nbytes`` of payload (``shm_nbytes`` of them in shared memory)."""
        now = time.perf_counter() if now is None else now
        stall = now - called
        step = stall if self._last_return is None else now - self._last_return
        self._last_return = now
        with self._lock:
            row = (stall, step, source_s, wait_s, transfer_s, float(nbytes), float(shm_nbytes))
            self._rows.add(row)
        self._steps += 1
        if self._log_every and self._steps % self._log_every == 0:
            self._log()
            self._last_return = time.perf_counter()  # the log line is not the caller's step

    def stats(self, last: int) -> LoaderStats:
        """The pass so far, with its last ``last`` steps in ``recent``."""
        with self._lock:
            rows = self._rows
            rows.fold()
            stall, step, source, wait, transfer = (rows.timings(col) for col in range(5))
            nbytes, shm = int(rows.total[5]), int(rows.total[6])
            recent = self._window(rows.last(last), last)
        share = _share(stall, step)
        return LoaderStats(
            self._steps, nbytes, stall, source, wait, transfer, step, share, recent, last, shm
        )

    @staticmethod
    def _window(rows: np.ndarray, last: int) -> LoaderStats:
        stall, step, source, wait, transfer = (_exact(rows[:, col]) for col in range(5))
        nbytes, shm = int(rows[:, 5].sum()), int(rows[:, 6].sum())
        share = _share(stall, step)
        return LoaderStats(
            len(rows), nbytes, stall, source, wait, transfer, step, share, None, last, shm
        )

    def _log(self) -> None:
        n = self._log_every or 0
        with self._lock:
            s = self._window(self._rows.last(n), n)
        logger.info(
            "loader step %d: data stall %.2f ms median, %.2f ms p90, %.2f ms max "
            "(%.1f%% of the step); next(source) %.2f ms, transfer %.2f ms median; last %d steps",
            self._steps, s.stall.median * 1e3, s.stall.p90 * 1e3, s.stall.max * 1e3,
            100 * s.stall_share, s.source.median * 1e3, s.transfer.median * 1e3, s.steps,
        )  # fmt: skip
