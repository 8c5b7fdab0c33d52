"""Everything tensorcast does when the interpreter exits, in one hook.

# NOTE [ Interpreter exit ]
tensorcast starts daemon threads only (a lane's worker, the source's heartbeat, the watch
on a default group), so none keeps the process alive. Left to die with it, though, one
that returns from a call that released the GIL (a gloo wait, a store write) once
finalization has begun is ended with ``pthread_exit``, whose forced unwind through
pybind11's ``noexcept`` GIL release calls ``std::terminate``: the process aborts (SIGABRT)
instead of ending with the program's exit code. So one ``atexit`` hook, registered when
the first of those threads' owners is made (a process that imports tensorcast and builds
nothing registers none, and makes no store request at exit; hooks run last registered
first, so before torch's), does everything, in order, while threads can still take the
GIL:

1. every live lane takes no job from then on (a call that would queue or run one raises
   ``RuntimeError``, as it does once ``sys.is_finalizing()``), withdraws the jobs queued
   and not started (locally: nothing goes on the wire) and lets its worker leave once its
   one running job ends; the heartbeat and the watch are told to stop. A daemon thread of
   the program's that waits for a withdrawn job or calls in later (a prefetch thread
   inside ``next()``) gets a ``SystemExit`` instead, which ends it without a traceback
   (:func:`refusal`); the main thread (an atexit hook, a finaliser) gets the ``RuntimeError``;
2. the hook joins those threads: a running job ends with its frame, or fails at once when
   a peer's process exits (its connections close), and a peer's own hook waits only for
   its own running job; each wait is bounded (a transfer's by the channel's timeout), and
   after ``WARN_AFTER_S`` one line on stderr says what it waits for and that bound;
3. with the default group still up, it says in the store that this process exited
   (``agreement.EXITED``: ranks waiting for it to set something up tell it from a late
   one), but only where that cannot wait on the network: not when a thread of step 2 is
   still alive nor while a store request of tensorcast's hangs (a diagnosis's, on a
   frozen store host: the c10d client serves one request at a time, so this one would
   queue behind it for good), and then on a helper thread given ``MARK_S`` seconds,
   after which the hook returns whatever the store does. A frozen store host never
   keeps the process from ending.

Nothing is ever queued from the hook, nor from a finaliser (NOTE [ Where a pass ends ] in
``loader.passes``): at exit the peers may be gone or exiting too. Besides the hook, only
local clean-up runs at exit, file operations that wait on nothing: the shared-memory
arenas' (``transport.shm``: a writer unlinks its segments but those a live reader has yet
to map, and a process sweeps those whose writer died and that no live reader awaits).
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

from tensorcast.transport.agreement import EXITED

__all__ = [
    "MARK_S",
    "WARN_AFTER_S",
    "Stoppable",
    "Waiter",
    "Withdrawn",
    "asking",
    "refusal",
    "refuse",
    "register",
]

#: how long the hook waits for threads before it says what it waits for
WARN_AFTER_S = 2.0
#: the most the hook gives its one store request (step 3)
MARK_S = 1.0

_lock = threading.Lock()
_owners: weakref.WeakSet[Stoppable] = weakref.WeakSet()  # a registry: see STYLE
#: threads of tensorcast's inside a store request that may hang (a diagnosis's)
_asking: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # a registry: see STYLE
state = {"registered": False, "ran": False}


@dataclass(frozen=True, slots=True)
class Waiter:
    """A thread the hook joins, for at most ``limit_s`` seconds, doing ``what``."""

    thread: threading.Thread | None
    limit_s: float
    what: str
    #: where ``limit_s`` comes from, said with it
    bound: str = "its own bound"


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


def asking(thread: threading.Thread) -> None:
    """``thread`` makes a store request that may never return: while it lives, the hook
    sends none (NOTE [ Interpreter exit ], step 3)."""
    _asking.add(thread)


class Withdrawn(RuntimeError):
    """A job taken out of its lane's queue unrun, at exit (step 1)."""


def refusal(error: RuntimeError) -> BaseException:
    """``error`` as the calling thread raises it at exit: itself on the main thread (an
    atexit hook or a finaliser called tensorcast: loud); elsewhere (a daemon thread still
    inside ``next()`` when the program ends, a prefetch thread) a plain ``SystemExit``,
    which ends that thread quietly, its ``finally`` blocks run (threading prints no
    traceback for it): the hook's one line says what exit waits for."""
    if threading.current_thread() is threading.main_thread():
        return error
    return SystemExit(str(error))


def refuse(ranks: str) -> None:
    """Raise once the interpreter exits (``RuntimeError``, or ``SystemExit`` off the main
    thread: :func:`refusal`): a job queued or run then, on tensorcast's group over ``ranks``, would
    wait on peers that are exiting too."""
    if state["ran"] or sys.is_finalizing():
        raise refusal(
            RuntimeError(
                f"tensorcast: no transfer starts on its group over ranks {ranks} any more: "
                f"the interpreter is exiting. A loader's next() or tensorcast.broadcast was "
                f"called from an atexit hook, a finaliser or a thread still running at exit; "
                f"finish them before the program ends"
            )
        )


def _at_exit() -> None:
    with _lock:
        state["ran"] = True
        owners = list(_owners)
    waiters = [owner.stop_at_exit() for owner in owners]  # step 1
    del owners
    if _join(waiters):  # step 2
        _mark_exited()  # step 3


def _join(waiters: list[Waiter]) -> bool:
    """Join the waiters' threads, each within its bound; whether every one left."""
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
                    f"tensorcast: at exit, waiting for {waiter.what} to end: at most "
                    f"{waiter.limit_s:g} s in all ({waiter.bound}); a transfer ends at once "
                    f"when a peer exits",
                    file=sys.stderr,
                    flush=True,
                )
            thread.join(min(0.1, waiter.limit_s - waited))
    return not any(w.thread is not None and w.thread.is_alive() for w in waiters)


def _mark_exited() -> None:
    """Step 3: say in the store that this process exited, within ``MARK_S`` seconds."""
    if any(t.is_alive() for t in list(_asking)):
        return  # a request of ours hangs: this one would queue behind it
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        store: Any = dist.distributed_c10d._get_default_store()
        rank = dist.get_rank()
    except Exception:  # a group torn down under us: nothing to say
        return

    def mark() -> None:
        with contextlib.suppress(Exception):  # a store that is gone is no one's problem
            store.set(f"{EXITED}{rank}", "exited")

    helper = threading.Thread(target=mark, name="tensorcast-exit-mark", daemon=True)
    helper.start()
    helper.join(MARK_S)
