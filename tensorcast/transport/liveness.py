"""Slow is not dead: a source's heartbeat in the store, read by a receiver that timed out.

A receiver waiting for a frame cannot tell from the collective alone why nothing came:
the source may be gone, frozen, stuck in its own iterator, or busy in the caller's own
code. A source rank keeps one key in the store (``alive/<global rank>``, a
:class:`Beat`), written by a daemon thread: a store write, never a collective. What a
receiver makes of it is ``transport.diagnosis``.

# NOTE [ Bounded heartbeat ]
The thread wakes every *fast* period (``timeout / 8``, between 0.1 and 1 s) but writes
only when a receiver may need it:

| the rank has been ...                                    | it writes            |
| -------------------------------------------------------- | -------------------- |
| in one state (inside ``next(source)``, or outside every  | every fast period    |
| ``next(source)``) for ``timeout / 8`` or longer           |                      |
| changing state sooner than that (a healthy job)          | every slow period    |
| held up (the thread woke late: the GIL held, a stop)     | at once              |

The slow period is ``timeout / 60``, between the fast period and 30 s: at the default
30-minute timeout a healthy source writes once every 30 s, whatever the world size
(every beat announces the period within which its next one comes, which bounds how
long a receiver watches). A receiver times out only after ``timeout`` without a frame,
by when the source, if that is the cause, has been in one state far longer than
``timeout / 8``: it beats fast, and a receiver tells alive from gone within seconds.
The thread wakes on time only if it can take the GIL; a wake that comes late says for
how long the process did not let it run, and the next beats say so. It sleeps on an
event, so that interpreter exit stops it at once (NOTE [ Interpreter exit ]).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensorcast.transport import exits as _exits
from tensorcast.transport.agreement import store_failed

__all__ = ["SLOW_MAX_S", "Beat", "Heartbeat", "Schedule", "key"]

SLOW_MAX_S = 30.0  # the slow period at long timeouts: what a healthy source costs the store

_HELD_MIN_S = 1.0  # a wake later than this (and two fast periods) is a hold-up, not jitter


def key(rank: int) -> str:
    """The store key of ``rank``'s heartbeat."""
    return f"alive/{rank}"


@dataclass(frozen=True, slots=True)
class Beat:
    """What one write of the heartbeat says.

    ``inside``: in ``next(source)`` (of ``channel``, doing ``what``) rather than outside
    every one; ``age``: for how long, in seconds; ``held``: the longest the heartbeat's
    thread was kept from running lately, ``held_ago`` seconds ago (0 if never), and
    ``held_inside`` whether that was in ``next(source)``.
    """

    beats: int
    period: float
    inside: bool
    age: float
    held: float
    held_ago: float
    held_inside: bool
    channel: int
    what: str

    def encode(self) -> str:
        return (
            f"{self.beats} {self.period:.3f} {int(self.inside)} {self.age:.1f} "
            f"{self.held:.1f} {self.held_ago:.1f} {int(self.held_inside)} {self.channel:x} "
            f"{self.what}"
        )

    @staticmethod
    def decode(text: str) -> Beat:
        f = text.split(" ", 8)
        return Beat(
            int(f[0]), float(f[1]), f[2] == "1", float(f[3]), float(f[4]), float(f[5]),
            f[6] == "1", int(f[7], 16), f[8],
        )  # fmt: skip


class Schedule:
    """When the heartbeat writes (see NOTE [ Bounded heartbeat ]): a pure function of
    the times it is given, so its rates can be checked without waiting for them."""

    def __init__(self, timeout_s: float) -> None:
        self.fast = min(1.0, max(0.1, timeout_s / 8))
        self.slow = min(SLOW_MAX_S, max(self.fast, timeout_s / 60))
        self.long = timeout_s / 8

    def tighten(self, timeout_s: float) -> None:
        """Serve a channel with ``timeout_s`` too: the shortest timeout sets the periods."""
        other = Schedule(timeout_s)
        self.fast, self.slow = min(self.fast, other.fast), min(self.slow, other.slow)
        self.long = min(self.long, other.long)

    def period(self, now: float, state_since: float) -> float:
        """The longest the heartbeat may go, from ``now``, before its next write."""
        return self.fast if now - state_since >= self.long - self.fast else self.slow

    def due(self, now: float, written: float, state_since: float, held: bool) -> bool:
        """Whether to write at ``now``, last written at ``written``, in the current state
        since ``state_since``, ``held``: this wake came late."""
        quiet = now - written + self.fast / 2  # wakes come once a fast period, give or take
        return held or quiet >= self.slow or (now - state_since >= self.long and quiet >= self.fast)


class Heartbeat:
    """The heartbeat of this rank while it is the source of any channel."""

    def __init__(self, store: Any, rank: int, timeout_s: float, alive: Callable[[], bool]) -> None:
        self._store = store
        self._rank = rank
        self._key = key(rank)
        self._schedule = Schedule(timeout_s)
        self._alive = alive  # False once the process group is gone: the thread leaves
        self._lock = threading.Lock()
        self._marks: weakref.WeakSet[_Busy] = weakref.WeakSet()  # one per channel
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # set at interpreter exit
        self._beats = 0
        self._written = 0.0
        self._out_since = time.monotonic()  # outside every next(source) since (or earlier)
        #: each mark's entry time at the last wake (None: it was inside)
        self._seen: weakref.WeakKeyDictionary[_Busy, float | None] = weakref.WeakKeyDictionary()
        self._held = (0.0, 0.0, False)  # how long, when it ended, whether inside

    def start(self, timeout_s: float) -> None:
        """Beat (from now on) often enough for a channel that waits ``timeout_s``."""
        with self._lock:
            self._schedule.tighten(timeout_s)
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._run, name="tensorcast-heartbeat", daemon=True
            )
            text = self._next(time.monotonic(), write=True)
        _exits.register(self)
        try:
            self._store.set(self._key, text)  # a receiver never finds no key once a channel is
        except RuntimeError as e:  # the store's host exited: no thread, and the caller is told
            with self._lock:
                self._thread = None
            raise store_failed(self._store, self._rank, "starting its heartbeat", e) from e
        self._thread.start()

    def stop_at_exit(self) -> _exits.Waiter:
        """Stop the thread (NOTE [ Interpreter exit ]); it leaves at its next wake."""
        self._stop.set()
        return _exits.Waiter(self._thread, 2 * self._schedule.fast + 1.0, "the heartbeat")

    def busy(self, what: str, channel: int = 0) -> _Busy:
        """A context in which this rank is marked busy with ``what`` (``next(source)``) for
        ``channel``; it may be entered again once left, never twice at a time."""
        mark = _Busy(what, channel)
        with self._lock:
            self._marks.add(mark)
        return mark

    def _next(self, now: float, *, write: bool = False, late: float = 0.0) -> str:
        """The beat to write at ``now`` (or ``""`` when none is due); under the lock."""
        inside: tuple[float, _Busy] | None = None
        moved = False
        for mark in list(self._marks):
            now_inside = mark.inside  # read first: entering sets `since`, then `inside`
            since = mark.since
            if now_inside and (inside is None or since < inside[0]):
                inside = (since, mark)
            seen = self._seen.get(mark, 0.0)
            moved |= seen is None or seen != since  # was inside, or entered, since last
            self._seen[mark] = None if now_inside else since
        if inside is None and moved:
            self._out_since = now  # it left a next(source) since the last wake
        state_since = inside[0] if inside is not None else self._out_since
        if late:
            self._held = (late, now, inside is not None or moved)
        if not (write or self._schedule.due(now, self._written, state_since, late > 0)):
            return ""
        self._beats += 1
        self._written = now
        held, held_at, held_inside = self._held
        return Beat(
            self._beats,
            self._schedule.period(now, state_since),
            inside is not None,
            now - state_since,
            held,
            now - held_at if held else 0.0,
            held_inside,
            inside[1].channel if inside is not None else 0,
            inside[1].what if inside is not None else "-",
        ).encode()

    def _run(self) -> None:
        woke = time.monotonic()
        while True:
            fast = self._schedule.fast
            if self._stop.wait(fast):
                return
            now = time.monotonic()
            late = now - woke - fast
            woke = now
            if not self._alive():
                return
            with self._lock:
                text = self._next(now, late=late if late >= max(_HELD_MIN_S, 2 * fast) else 0)
            if not text:
                continue
            try:
                self._store.set(self._key, text)
            except RuntimeError:
                return  # the store is gone with its process group: nothing to tell


class _Busy:
    """:meth:`Heartbeat.busy`'s context. Entering sets two attributes and leaving one,
    which the heartbeat's thread reads: no lock and no Python generator on every step."""

    __slots__ = ("__weakref__", "channel", "inside", "since", "what")

    def __init__(self, what: str, channel: int) -> None:
        self.what = what
        self.channel = channel
        self.since = 0.0
        self.inside = False

    def __enter__(self) -> None:
        self.since = time.monotonic()
        self.inside = True

    def __exit__(self, *exc: object) -> None:
        self.inside = False
