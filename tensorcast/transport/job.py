"""A job: one transfer submitted to a lane (``transport.lane``), and its result."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["Job"]

T = TypeVar("T")


class Job(Generic[T]):
    """A transfer submitted to a lane; :meth:`result` waits for it.

    ``_taken`` is set, under the lane's lock, when a thread starts running it: with its
    presence in the lane's queue it tells whether a job is still owed a run (see
    :meth:`Lane.settle`).
    """

    __slots__ = ("_error", "_fn", "_taken", "_value", "_waited", "done", "frames")

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        # Held until the job is done. Not a threading.Event: its wait enters a Condition in
        # Python, and a signal handler that raises there leaves the Event's lock held, so
        # the job could never be marked done (a hang under a storm of signals). A waiter
        # blocks in the C acquire, which a handler interrupts cleanly.
        self._waited = threading.Lock()
        self._waited.acquire()
        #: set once the job has run (its value or error is then there)
        self.done = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._taken = False
        #: the channel's frame count when the job ran inline (None: on the worker)
        self.frames: int | None = None

    @property
    def error(self) -> BaseException | None:
        """What the job raised, once it is done."""
        return self._error

    def result(self) -> T:
        """The job's value, or its exception raised here; waits until it has run."""
        if not self.done:
            self._waited.acquire()  # let go at once: every later waiter sees done
            self._waited.release()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as e:  # handed to whoever waits, never swallowed
            self._error = e
        finally:
            self._fn = None  # type: ignore[assignment]
            self.done = True
            self._waited.release()
