"""One ordered lane per group: every tensorcast transfer on a set of ranks, in order.

# NOTE [ One ordered lane ]
Collectives match by order. tensorcast's traffic runs on process groups that it owns
(see ``transport.groups``), one per set of ranks, and every transfer on such a group is a *job*
in one FIFO, run by one worker thread. Jobs are submitted only from the caller's thread,
at points that are the same on every rank (a loader's ``next()``, a
``tensorcast.broadcast`` call), so every rank runs the same jobs in the same order,
whatever mix of loaders, prefetch depths, early breaks and broadcasts the caller makes,
and whatever the model does on its own groups in between. A loader's ``prefetch=k`` is
simply "k jobs submitted ahead of the consumer".

A job that fails after its first message went out leaves the group in an unknown state:
the lane is then *broken* on this rank (its group aborted, so that peers blocked on it
fail now rather than at their timeout), and every later job fails with ``PeerError``
naming the first failure. A job's exception is handed to whoever waits for it; a caller
interrupted while waiting (Ctrl-C, a signal handler that raises) leaves the job running
to the end of its frame, and waiting again picks up its result.

The worker leaves after a few idle seconds and comes back with the next job, so idle
lanes hold no thread.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from tensorcast._errors import PeerError

__all__ = ["Job", "Lane"]

T = TypeVar("T")
_IDLE_EXIT_S = 5.0


class Job(Generic[T]):
    """A transfer submitted to a lane; :meth:`result` waits for it."""

    __slots__ = ("_done", "_error", "_fn", "_value")

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """What the job raised, once it is done."""
        return self._error

    def result(self) -> T:
        """The job's value, or its exception raised here; waits until it has run."""
        self._done.wait()
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
            self._done.set()


class Lane:
    """A FIFO of jobs on one of tensorcast's groups, run in order by one worker thread.

    Args:
        name: names the lane's thread and its errors (e.g. the group's ranks).
        abort: tears the group down; called once, when the lane breaks.
        cuda_device: the CUDA device jobs run on (the caller's current one), if any.
        idle_exit_s: how long the worker waits for a job before it leaves.
    """

    def __init__(
        self,
        name: str,
        abort: Callable[[], None],
        cuda_device: int | None = None,
        *,
        idle_exit_s: float = _IDLE_EXIT_S,
    ) -> None:
        self.name = name
        self._idle_exit_s = idle_exit_s
        self._abort = abort
        self._cuda_device = cuda_device
        self._jobs: collections.deque[Job[Any]] = collections.deque()
        # The state below is read and set under the lock; the worker waits on the condition.
        # A plain lock where no wait is needed: entering a Condition runs Python code.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._worker: threading.Thread | None = None
        self._running = False  # a job is running, on the worker or inline
        self._inline: int | None = None  # the thread running a job inline
        self._worker_id: int | None = None
        self.broken: BaseException | None = None

    def submit(self, fn: Callable[[], T]) -> Job[T]:
        """Queue ``fn`` behind every job submitted before it; it runs on the worker."""
        if self.on_lane_thread():
            raise RuntimeError(
                "tensorcast was called from inside a loader's source iterator on the same "
                "ranks; a source must not broadcast or iterate another BroadcastingDataLoader"
            )
        job: Job[T] = Job(fn)
        with self._lock:
            self._jobs.append(job)
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name=f"tensorcast-lane-{self.name}", daemon=True
                )
                self._worker.start()
            else:
                self._cond.notify()
        return job

    def idle(self) -> bool:
        """Whether nothing is queued or running (a job submitted now would run at once)."""
        with self._lock:
            return not self._jobs and not self._running

    def on_lane_thread(self) -> bool:
        """Whether the calling thread is running one of this lane's jobs."""
        return threading.get_ident() in (self._inline, self._worker_id)

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in its turn and return its result.

        When nothing is queued or running, ``fn`` runs right here on the caller's thread,
        still in its turn: the hop to the worker and back is a measurable share of a small
        batch's time (see ``docs/design.md``). A signal handler that raises there
        in the middle of a frame breaks the lane, as any failure does (NOTE [ A frame is
        atomic ]); on the worker it would only interrupt the wait.
        """
        me = threading.get_ident()
        with self._lock:
            inline = not self._jobs and not self._running and me != self._worker_id
            if inline:
                self._running = True
                self._inline = me
        if not inline:
            return self.submit(fn).result()
        try:
            if torch.is_inference_mode_enabled():  # buffers made here must not be inference tensors
                with torch.inference_mode(False):
                    return fn()
            return fn()
        finally:
            with self._lock:
                self._running = False
                self._inline = None
                if self._jobs:
                    self._cond.notify()

    def break_(self, cause: BaseException) -> None:
        """Mark the lane broken after a failure in the middle of a frame (first cause wins)."""
        if self.broken is not None:
            return
        self.broken = cause
        # A group that cannot abort is broken all the same, and the cause is what to report.
        with contextlib.suppress(RuntimeError):
            self._abort()

    def check(self) -> None:
        """Raise ``PeerError`` if the lane is broken."""
        if self.broken is not None:
            raise PeerError(
                f"tensorcast's channel on ranks {self.name} failed earlier and cannot be "
                f"trusted any more ({type(self.broken).__name__}: {self.broken}); "
                f"restart the job (every rank learns of the failure within its timeout)"
            )

    def _run(self) -> None:
        self._worker_id = threading.get_ident()
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        while True:
            with self._cond:
                if not self._jobs or self._running:
                    self._cond.wait(self._idle_exit_s)
                if not self._jobs:
                    self._worker = self._worker_id = None
                    return
                if self._running:  # a job runs inline; it notifies when it is done
                    continue
                job = self._jobs.popleft()
                self._running = True
            try:
                job._run()
            finally:
                with self._cond:
                    self._running = False
