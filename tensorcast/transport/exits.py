"""What tensorcast's threads do when the interpreter exits.

# NOTE [ Interpreter exit ]
tensorcast starts daemon threads only (a lane's worker, the source's heartbeat, the watch
on a default group), so none keeps the process alive. Left to die with it, though, one
that returns from a call that released the GIL (a gloo wait, a store write) once
finalization has begun is ended with ``pthread_exit``, whose forced unwind through
pybind11's ``noexcept`` GIL release calls ``std::terminate``: the process aborts (SIGABRT)
instead of ending with the program's exit code. So an ``atexit`` hook, registered once
when the first of those threads' owners is made (hooks run last registered first, so
before torch's), stops them while threads can still take the GIL:

1. every live lane takes no job from then on (a call that would queue or run one raises
   ``RuntimeError``, as it does once ``sys.is_finalizing()``), withdraws the jobs queued
   and not started (locally: nothing goes on the wire) and lets its worker leave once its
   one running job ends; the heartbeat and the watch are told to stop;
2. the hook joins those threads: a running job ends with its frame, or fails at once when
   a peer's process exits (its connections close), and a peer's own hook waits only for
   its own running job; the wait is bounded by the channel's timeout, and after
   ``WARN_AFTER_S`` a line on stderr says what it waits for.

Nothing is ever queued from the hook, nor from a finaliser (NOTE [ Where a pass ends ] in
``loader.passes``): at exit the peers may be gone or exiting too.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Protocol

__all__ = ["WARN_AFTER_S", "Stoppable", "Waiter", "exiting", "refuse", "register"]

#: how long the hook waits for threads before it says what it waits for
WARN_AFTER_S = 2.0

_lock = threading.Lock()
_owners: weakref.WeakSet[Stoppable] = weakref.WeakSet()  # a registry: see STYLE
state = {"registered": False, "ran": False}


@dataclass(frozen=True, slots=True)
class Waiter:
    """A thread the hook joins, for at most ``limit_s`` seconds, doing ``what``."""

    thread: threading.Thread | None
    limit_s: float
    what: str


class Stoppable(Protocol):
    """An owner of a thread (a lane, a heartbeat, a world's watch)."""

    def stop_at_exit(self) -> Waiter:
        """Tell the thread to stop, without waiting (and without any communication)."""
        ...


def register(owner: Stoppable) -> None:
    """Stop ``owner``'s thread at interpreter exit (NOTE [ Interpreter exit ])."""
    with _lock:
        _owners.add(owner)
        if not state["registered"]:
            state["registered"] = True
            atexit.register(_at_exit)


def exiting() -> bool:
    """Whether the exit hook ran, or the interpreter is finalizing."""
    return state["ran"] or sys.is_finalizing()


def refuse(ranks: str) -> None:
    """Raise ``RuntimeError`` once the interpreter exits: a job queued or run then, on
    tensorcast's group over ``ranks``, would wait on peers that are exiting too."""
    if state["ran"] or sys.is_finalizing():
        raise RuntimeError(
            f"tensorcast: no transfer starts on its group over ranks {ranks} any more: the "
            f"interpreter is exiting. A loader's next() or tensorcast.broadcast was called "
            f"from an atexit hook, a finaliser or a thread still running at exit; finish "
            f"them before the program ends"
        )


def _at_exit() -> None:
    with _lock:
        state["ran"] = True
        owners = list(_owners)
    waiters = [owner.stop_at_exit() for owner in owners]
    del owners
    started = time.monotonic()
    warned = False
    for waiter in waiters:
        thread = waiter.thread
        while thread is not None and thread.is_alive():
            waited = time.monotonic() - started
            if waited >= waiter.limit_s:
                break
            if not warned and waited >= WARN_AFTER_S:
                warned = True
                print(
                    f"tensorcast: at exit, waiting up to {waiter.limit_s - waited:.0f} s more "
                    f"for {waiter.what} to end (a peer that exits ends it at once)",
                    file=sys.stderr,
                    flush=True,
                )
            thread.join(min(0.1, waiter.limit_s - waited))
