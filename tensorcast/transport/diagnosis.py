"""What a receiver says about a source that did not send: its heartbeat, read with bounds.

A receiver whose wait for a frame failed reads the source's heartbeat (``transport.liveness``)
and watches it for up to two of the periods the beat announced, plus, after a timeout,
a few seconds more for a process that cannot beat because one call holds the GIL:

| what the receiver sees                          | what it says                          |
| ----------------------------------------------- | ------------------------------------- |
| beats that move, the thread held up lately      | alive, but the GIL was held N s       |
| beats that move, inside this channel's source   | alive but slow: busy N s in next()    |
| beats that move, inside another channel's       | alive, in another loader: misordered  |
| beats that move, outside every ``next(source)`` | alive, in its own code for N s        |
| beats that stand still                          | gone (connection closed) or frozen    |
| no key                                          | never sent a heartbeat                |
| a store that does not answer                    | the store's host is frozen or gone    |

# NOTE [ One diagnosis per frame ]
Receivers of one frame that each watched for themselves could disagree (one sees the
source inside ``next(source)``, the next sees it just left). The first to fail claims
the frame's diagnosis (``add`` on a key named by the source and the frame's stamp),
watches, and writes its verdict; the others ``wait`` for that key (the store tells them:
no polling) and say the same words. Per failed frame that is a few requests per receiver
and the watcher's reads, two per poll, one poll per half period of the source.

# NOTE [ A store that does not answer ]
The store may live in the source's own process (a TCPStore hosted by rank 0 under
``mp.spawn``, Lightning's launcher, ``env://``): frozen with it, it never answers, and
the c10d client's own timeout (the process group's, often 30 minutes) is no bound (a
clone's ``set_timeout`` was seen not to bound a read from a stopped server either).
Every request runs on a helper thread and is given up after a few seconds; the helper is
left to the client's own timeout. A setup's requests go the same way (:class:`Asker`, the
agreement's store), each given up once the setup's timeout has passed.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from tensorcast.transport import exits as _exits
from tensorcast.transport.liveness import SLOW_MAX_S, Beat, key

__all__ = ["STORE_OPS", "Asker", "Silent", "diagnose", "failed_after", "timed_out"]

_CLOSED = ("connection reset", "connection closed", "broken pipe", "connection refused")


def failed_after(error: BaseException, waited_s: float, timeout_s: float) -> str:
    """How a wait for a peer ended, for its message: what happened and after how long
    (a closed connection fails in a second, not after the timeout)."""
    if timed_out(error):
        return f"timed out after {waited_s:.1f} s (the timeout: {timeout_s:g} s)"
    return (
        f"failed after {waited_s:.1f} s, its connection closed (the timeout, {timeout_s:g} s, "
        f"did not run out)"
    )


class Silent(RuntimeError):
    """The store did not answer a request within the limit (its host is stopped or gone)."""


def timed_out(error: BaseException) -> bool:
    """Whether a failed wait ran out of time (rather than losing its peer's connection)."""
    text = str(error).lower()
    return not any(s in text for s in _CLOSED)


#: the requests an :class:`Asker` bounds when it stands for its store
STORE_OPS = frozenset(
    ("add", "append", "check", "compare_set", "delete_key", "get", "multi_get", "set", "wait")
)


class Asker:
    """Store requests, each answered within a limit or :class:`Silent` (NOTE [ A store that
    does not answer ]). It stands for ``store`` where a store is wanted: its requests
    (:data:`STORE_OPS`) go through :meth:`__call__`, anything else is the store's.

    The limit is ``limit_s``, or what :meth:`bounded` sets for the calling thread (a
    setup's timeout: setups on two threads each keep their own). While a request given up
    still has not come back, the next fails at once: it would queue behind it in the
    client; once it came back, the store is asked again.
    """

    def __init__(self, store: Any, limit_s: float) -> None:
        self.store = store
        self._limit_s = limit_s
        self._local = threading.local()
        self._hung: threading.Thread | None = None

    @property
    def limit_s(self) -> float:
        return getattr(self._local, "limit_s", None) or self._limit_s

    @contextlib.contextmanager
    def bounded(self, limit_s: float | None) -> Iterator[None]:
        """Within, this thread's requests are given up after ``limit_s`` (None: the
        default)."""
        before = getattr(self._local, "limit_s", None)
        self._local.limit_s = limit_s
        try:
            yield
        finally:
            self._local.limit_s = before

    def __getattr__(self, name: str) -> Any:
        if name in STORE_OPS:
            return functools.partial(self, name)
        return getattr(self.store, name)  # a prefix store's underlying store, say

    def __call__(self, op: str, *args: Any, limit_s: float | None = None) -> Any:
        hung = self._hung
        if hung is not None and hung.is_alive():  # the next would queue behind it
            raise Silent(
                f"the store has not answered an earlier request; this {op} would wait behind it"
            )
        box: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

        def run() -> None:
            try:
                box.put((True, getattr(self.store, op)(*args)))
            except BaseException as e:  # handed to the asking thread
                box.put((False, e))

        helper = threading.Thread(target=run, name="tensorcast-store", daemon=True)
        _exits.asking(helper)  # no store request at exit while this one may hang
        helper.start()
        try:
            ok, value = box.get(timeout=limit_s or self.limit_s)
        except queue.Empty:
            self._hung = helper
            raise Silent(
                f"the store did not answer its {op} request within "
                f"{limit_s or self.limit_s:g} s: the process that hosts it is stopped or gone"
            ) from None
        if not ok:
            raise value
        return value

    def beat(self, src: int) -> Beat | None:
        if not self("check", [key(src)]):
            return None
        return Beat.decode(self("get", key(src)).decode())


def diagnose(
    store: Any,
    src: int,
    *,
    rank: int,
    frame: tuple[int, int, int],
    timeout_s: float,
    timed_out: bool,
) -> str:
    """What the source's heartbeat says, for a receiver's error message.

    Args:
        store: the store the source beats in.
        src: the source's global rank; ``rank``: this receiver's.
        frame: the stamp of the frame that did not come (channel, pass, step).
        timeout_s: how long the receiver waited.
        timed_out: the wait ran out of time (else the source's connection closed).
    """
    ask = Asker(store, max(2.0, min(10.0, timeout_s / 4)))
    hold = min(30.0, max(5.0, timeout_s)) if timed_out else 0.0
    verdict = f"verdict/{src}/{frame[0]:x}/{frame[1]}/{frame[2]}"
    try:
        if ask("add", verdict + "/claim", 1) != 1:  # NOTE [ One diagnosis per frame ]
            longest = 2 * SLOW_MAX_S + hold + 6 * ask.limit_s
            try:
                wait = datetime.timedelta(seconds=longest)
                ask("wait", [verdict], wait, limit_s=longest + ask.limit_s)
                return str(ask("get", verdict).decode())
            except RuntimeError:
                pass  # the watcher did not say in time: watch for this rank
        try:
            text = _watch(ask, src, frame[0], hold, timed_out, timeout_s)
        except ValueError as e:  # a key that is not a beat: say so, and still write it
            text = (
                f"the source rank {src}'s heartbeat does not read as one ({e}): every rank "
                f"must run the same tensorcast"
            )
        text = f"{text} (seen by rank {rank})"
        ask("set", verdict, text)  # the other receivers wait for it
        return text
    except Silent:
        return _unread(src, store, f"did not answer within {ask.limit_s:g} s")
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else ""
        return _unread(src, store, f"failed ({type(e).__name__}: {first})")


def _watch(
    ask: Asker, src: int, channel: int, hold: float, timed_out: bool, timeout_s: float
) -> str:
    first = ask.beat(src)
    if first is None:
        return (
            f"the source rank {src} never sent a heartbeat: it has not built this loader "
            f"(or called tensorcast.broadcast) yet, or it died before"
        )
    start = time.monotonic()
    # A closed connection already says the process is gone or tore its group down: a
    # short look tells which, without waiting out a healthy source's slow period.
    window = 2 * first.period + hold if timed_out else min(2 * first.period, 3.0)
    while True:
        time.sleep(max(0.1, min(1.0, first.period / 2)))
        watched = time.monotonic() - start
        beat = ask.beat(src)
        if beat is not None and beat.beats != first.beats:
            if not timed_out:
                return (
                    f"the source rank {src} is alive, but closed its connection: it failed "
                    f"and tore its group down (its own error says why)"
                )
            return _alive(src, beat, channel, timeout_s + watched)
        if watched >= window:
            return _gone(src, first, watched, timed_out)


def _alive(src: int, beat: Beat, channel: int, waited: float) -> str:
    who = f"the source rank {src} is alive"
    longer = "give it a longer timeout (init_process_group(timeout=...) or timeout=)"
    if beat.held and beat.held_ago <= waited + 1.0:  # while this rank waited
        where = " inside next(source)" if beat.held_inside else ""
        return (
            f"{who}, but its process kept its heartbeat from running for {beat.held:.1f} s"
            f"{where}: one call held the GIL that long (a tokenizer or a decoder that does "
            f"not release it), or the process was stopped; {longer}, or release the GIL "
            f"in that call (or move it into DataLoader workers)"
        )
    if beat.inside and beat.channel == channel:
        return (
            f"{who} but slow: busy for {beat.age:.1f} s in {beat.what}; {longer} or a faster loader"
        )
    if beat.inside:
        return (
            f"{who} and busy for {beat.age:.1f} s in another loader's {beat.what} (channel "
            f"{beat.channel:#x}): the ranks do not iterate the same loaders in the same order"
        )
    return (
        f"{who} and has been outside next(source) for {beat.age:.1f} s, in its own code "
        f"(its training step, or a wait elsewhere): either that is slower than the "
        f"timeout ({longer}), or the ranks do not iterate the same loaders, or call "
        f"tensorcast.broadcast, in the same order"
    )


def _gone(src: int, last: Beat, watched: float, timed_out: bool) -> str:
    was = "inside " + last.what if last.inside else "outside next(source)"
    said = f"its last beat: {was} for {last.age:.1f} s"
    if not timed_out:
        return (
            f"the source rank {src} is gone: its connection closed and its heartbeat did "
            f"not move for {watched:.1f} s ({said}); its process died (or, if it still "
            f"runs, it failed and tore its group down: its own error says why)"
        )
    return (
        f"the source rank {src} is gone or frozen: its heartbeat did not move for "
        f"{watched:.1f} s after the timeout ({said}): its process died or is stopped "
        f"(SIGSTOP, swapped out), or one call has held the GIL for longer than that"
    )


def _unread(src: int, store: Any, why: str) -> str:
    """The message when the store cannot be read: it ``why``."""
    where = ""
    base = getattr(store, "_underlying_non_prefix_store", store)
    if hasattr(base, "host") and hasattr(base, "port"):
        where = f" (a TCPStore at {base.host}:{base.port})"
    host = "rank 0, here the source itself" if src == 0 else "rank 0"
    return (
        f"the source rank {src}'s heartbeat cannot be read: the store{where} {why}, so "
        f"the process that hosts it is frozen or gone (under mp.spawn, Lightning's "
        f"launcher and env:// without torchrun's agent store, that is {host}); find "
        f"what stopped that process, and restart the job"
    )
