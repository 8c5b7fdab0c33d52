"""Slow is not dead: a source's heartbeat in the store, read by a receiver that timed out.

A receiver waiting for a frame cannot tell from the collective alone why nothing came:
the source may be gone, or alive and stuck in its own iterator (DataLoader workers that
start, slow storage). A source rank keeps one key in the store fresh while it is alive::

    alive/<global rank> = "<beats> <period> <busy seconds> <what it is busy with>"

written every ``period`` seconds (at most one; less for a channel with a shorter
timeout) by a daemon thread: a store write, not a collective. A receiver whose wait
failed reads the key twice, one and a half of the source's periods apart: beats that
moved mean the source is alive, and its busy time says for how long it has been inside
``next()``; beats that did not move (or no key) mean it is gone.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Heartbeat", "diagnose"]


def _period(timeout_s: float) -> float:
    return min(1.0, max(0.1, timeout_s / 8))


class Heartbeat:
    """The heartbeat of this rank while it is the source of any channel."""

    def __init__(self, store: Any, rank: int, timeout_s: float, alive: Callable[[], bool]) -> None:
        self._store = store
        self._key = f"alive/{rank}"
        self._period = _period(timeout_s)
        self._alive = alive  # False once the process group is gone: the thread leaves
        self._lock = threading.Lock()
        self._marks: weakref.WeakSet[_Busy] = weakref.WeakSet()  # one per channel
        self._beats = 0
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float) -> None:
        """Beat (from now on) often enough for a channel that waits ``timeout_s``."""
        with self._lock:
            self._period = min(self._period, _period(timeout_s))
            if self._thread is None:
                self._beat()
                self._thread = threading.Thread(
                    target=self._run, name="tensorcast-heartbeat", daemon=True
                )
                self._thread.start()

    def busy(self, what: str) -> _Busy:
        """A context in which this rank is marked busy with ``what`` (e.g. ``next(source)``);
        it may be entered again once left, never twice at a time."""
        mark = _Busy(what)
        with self._lock:
            self._marks.add(mark)
        return mark

    def _beat(self) -> None:
        now = time.monotonic()
        busy = []
        for mark in list(self._marks):
            since = mark.since  # read once: the mark's thread may leave it meanwhile
            if since is not None:
                busy.append((since, mark.what))
        since, what = min(busy, default=(now, "nothing"))
        self._beats += 1
        self._store.set(self._key, f"{self._beats} {self._period} {now - since:.1f} {what}")

    def _run(self) -> None:
        while True:
            time.sleep(self._period)
            if not self._alive():
                return
            try:
                with self._lock:
                    self._beat()
            except RuntimeError:
                return  # the store is gone with its process group: nothing to tell


class _Busy:
    """:meth:`Heartbeat.busy`'s context. Entering and leaving set one attribute, which the
    heartbeat's thread reads: no lock and no Python generator on every step."""

    __slots__ = ("__weakref__", "since", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        self.since: float | None = None

    def __enter__(self) -> None:
        self.since = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self.since = None


def diagnose(store: Any, src: int) -> str:
    """What the source's heartbeat says, for a receiver's error message."""
    key = f"alive/{src}"

    def read() -> list[str] | None:
        try:
            if not store.check([key]):
                return None
            return store.get(key).decode().split(" ", 3)
        except RuntimeError:
            return None

    first = read()
    time.sleep(1.5 * (float(first[1]) if first is not None else 1.0))
    second = read()
    if first is None or second is None:
        return f"the source rank {src} never sent a heartbeat (it died, or never started)"
    if first[0] == second[0]:
        return (
            f"the source rank {src} is gone: its heartbeat stopped (it died, or its "
            f"process is frozen)"
        )
    busy_s, what = float(second[2]), second[3]
    if what == "nothing":
        return (
            f"the source rank {src} is alive and not busy: it is waiting elsewhere (do all "
            f"ranks iterate the same loaders and call tensorcast.broadcast in the same order?)"
        )
    return (
        f"the source rank {src} is alive but slow: busy for {busy_s:.1f} s in {what}; give "
        f"it a longer timeout (init_process_group(timeout=...) or timeout=) or a faster "
        f"loader"
    )
