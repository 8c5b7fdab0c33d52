"""One ordered lane per group: every tensorcast transfer on a set of ranks, in order.

# NOTE [ One ordered lane ]
Collectives match by order. tensorcast's traffic runs on process groups that it owns
(see ``transport.groups``), one per set of ranks, and every transfer on such a group is a
*job* in one FIFO, run one at a time: inline on the caller's thread when nothing is queued
or running (:meth:`Lane.start`), else by the lane's worker thread. Jobs are submitted only
from the caller's thread, at points that are the same on every rank (a loader's
``next()``, a ``tensorcast.broadcast`` call), so every rank runs the same jobs in the same
order, whatever mix of loaders, prefetch depths, early breaks and broadcasts the caller
makes, and whatever the model does on its own groups in between. A loader's ``prefetch=k`` is
simply "k jobs submitted ahead of the consumer".

A job that fails after its first message went out leaves the group in an unknown state:
the lane is then *broken* on this rank (its group aborted, so that peers blocked on it
fail now rather than at their timeout), and every later job fails with ``PeerError``
naming the first failure. The abort runs on a thread of its own, waited for a bounded
time: an NCCL abort can itself block (NVIDIA/nccl #829, #549), and the thread that broke
the lane (the caller's, or the worker with the jobs queued behind) must go on to raise.
A job's exception is handed to whoever waits for it; a caller interrupted while waiting
(Ctrl-C, a signal handler that raises) leaves the job running to the end of its frame,
and waiting again picks up its result.

The worker leaves after a few idle seconds and comes back with the next job, so idle
lanes hold no thread. While device work of a frame is in flight (NOTE [ Device work at
next() ]) it stays, to break the lane if that work is not done by its deadline. At
interpreter exit a lane takes no new job, drops those queued and lets its worker finish
the one it runs (NOTE [ Interpreter exit ] in ``transport.exits``).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import torch

from tensorcast._errors import PeerError, TensorcastError, UnsupportedLeafError
from tensorcast.transport import exits as _exits
from tensorcast.transport.device import Inflight, apart_from_captures
from tensorcast.transport.interrupts import points as _interrupts

__all__ = ["Job", "Lane"]

T = TypeVar("T")
_IDLE_EXIT_S = 5.0
_ABORT_WAIT_S = 5.0


class Job(Generic[T]):
    """A transfer submitted to a lane; :meth:`result` waits for it.

    ``_taken`` is set, under the lane's lock, when a thread starts running it: with its
    presence in the lane's queue it tells whether a job is still owed a run (see
    :meth:`Lane.settle`). A ``guarded`` job (a pass's step) does not run on a broken
    lane: it fails with the lane's ``PeerError`` before it does anything (before a source
    pulls a batch it could not send).
    """

    __slots__ = (
        "__weakref__",
        "_error",
        "_fn",
        "_taken",
        "_value",
        "_waited",
        "done",
        "frames_at_start",
        "guarded",
    )

    def __init__(self, fn: Callable[[], T], *, guarded: bool = False) -> None:
        self._fn = fn
        self.guarded = guarded
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
        #: the role's ``frames_taken()`` when the job ran inline (None: on the worker)
        self.frames_at_start: int | None = None

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
            if type(self._error) is _exits.Withdrawn:  # at exit: NOTE [ Interpreter exit ]
                raise _exits.refusal(self._error)
            raise self._error
        return self._value  # type: ignore[no-any-return]

    def _run(self, guard: Callable[[], None] | None = None) -> None:
        try:
            if guard is not None:
                guard()  # a guarded job on a broken lane: the lane's PeerError is its error
            self._value = self._fn()
        except BaseException as e:  # handed to whoever waits, never swallowed
            self._error = e
        finally:
            self._fn = None  # type: ignore[assignment]
            self.done = True
            self._waited.release()

    def _withdrawn(self, error: BaseException) -> None:
        """Taken out of the queue unrun (at exit): whoever waits for it gets ``error``."""
        self._error = error
        self._fn = None  # type: ignore[assignment]
        self.done = True
        self._waited.release()


class Lane:
    """A FIFO of jobs on one of tensorcast's groups, run in order, one at a time (NOTE
    [ One ordered lane ]).

    Args:
        name: names the lane's thread and its errors (e.g. the group's ranks).
        abort: tears the group down; called once, when the lane breaks.
        cuda_device: the CUDA device the worker sets, if any; on a device group (one
            whose payloads travel on it, ``device_group``) the worker also packs with
            one intra-op thread, as torch's pin-memory thread does.
        idle_exit_s: how long the worker waits for a job before it leaves.
        abort_wait_s: how long breaking the lane waits for ``abort`` to return.
        exit_wait_s: how long interpreter exit waits for the job running then.
    """

    def __init__(
        self,
        name: str,
        abort: Callable[[], None],
        cuda_device: int | None = None,
        *,
        device_group: bool = False,
        idle_exit_s: float = _IDLE_EXIT_S,
        abort_wait_s: float = _ABORT_WAIT_S,
        exit_wait_s: float = 30 * 60.0,
    ) -> None:
        self.name = name
        self._exit_wait_s = exit_wait_s
        self._idle_exit_s = idle_exit_s
        self._abort = _Abort(abort, f"tensorcast-abort-{name}", abort_wait_s)
        self._cuda_device = cuda_device
        self._device_group = device_group
        #: device work posted by the caller's thread, watched here until its deadline
        self.inflight = Inflight(self._watch)
        self._jobs: collections.deque[Job[Any]] = collections.deque()
        # The state below is read and set under the lock; the worker waits on the condition.
        # A plain lock where no wait is needed: entering a Condition runs Python code.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._worker: threading.Thread | None = None
        self._inline: int | None = None  # the thread running a job inline
        self._worker_id: int | None = None
        self.broken: BaseException | None = None
        self.suspects: list[tuple[BaseException, Callable[[], bool]]] = []  # settle_suspects
        #: jobs queued or started so far: only the caller's thread adds one (tests read it)
        self.submitted = 0
        self._current: Job[Any] | None = None  # the job running, on the worker or inline
        _exits.register(self)

    def last(self) -> Job[Any] | None:
        """The job queued last, else the one running, else None. Jobs run in order: once
        it is done, so is every job before it, of any loader or broadcast here.

        Raises:
            RuntimeError: called from a job (a source that iterates a loader on its ranks).
        """
        self._not_from_a_job()
        with self._lock:
            return self._jobs[-1] if self._jobs else self._current

    def enqueue(self, job: Job[Any]) -> None:
        """Queue ``job`` behind every job queued before it; it runs on the worker."""
        self._not_from_a_job()
        if self.suspects:
            settle_suspects(self)
        with self._lock:
            self._queue(job)

    def _queue(self, job: Job[Any]) -> None:  # under the lock
        if _exits.state["ran"] or sys.is_finalizing():  # no job once the interpreter exits
            _exits.refuse(self.name)
        self._jobs.append(job)
        self.submitted += 1
        self._start_worker()

    def _watch(self) -> None:
        """Device work was posted: make sure a worker watches its deadline."""
        with self._lock:
            self._start_worker()

    def wake(self) -> None:
        """Wake the worker, if any, to look again (it leaves when nothing is left)."""
        with self._lock:
            self._cond.notify()

    def stop_at_exit(self) -> _exits.Waiter:
        """NOTE [ Interpreter exit ]: withdraw the jobs queued and not started (locally; a
        waiter gets ``RuntimeError``); the worker leaves once its running job ends."""
        with self._lock:  # the hook ran: nothing is queued from now on (exits.refuse)
            withdrawn, self._jobs = self._jobs, collections.deque()
            self._idle_exit_s = 0.0
            self._cond.notify_all()
            worker = self._worker
        self.inflight.clear()  # no deadline keeps the worker
        error = _exits.Withdrawn(f"the interpreter exited before this job ran ({self.name})")
        for job in withdrawn:
            job._withdrawn(error)
        what = (
            f"the job running on tensorcast's group over ranks {self.name} (a transfer, or "
            f"a loader source's next(source) before one)"
        )
        return _exits.Waiter(worker, self._exit_wait_s, what, "the process group's timeout")

    def _start_worker(self) -> None:  # under the lock
        self._cond.notify()
        if self._worker is None:
            if _exits.state["ran"] or sys.is_finalizing():
                _exits.refuse(self.name)
            # Recorded once started: an interrupt inside start() leaves None, and the next
            # job starts another. Two workers still run one job at a time, in order.
            worker = threading.Thread(
                target=self._run, name=f"tensorcast-lane-{self.name}", daemon=True
            )
            worker.start()
            self._worker = worker

    def settle(self, jobs: Iterable[Job[Any]]) -> None:
        """Queue, in order, those of ``jobs`` that are owed a run and are not queued: what
        an interrupt left between recording a job and queuing it (NOTE [ Interrupts ]).
        And make sure a worker runs what is queued: an interrupt inside
        ``Thread.start()`` may have left a job queued and no worker started."""
        with self._lock:
            for job in jobs:
                if not job._taken and not job.done and job not in self._jobs:
                    self._queue(job)
            if self._jobs:
                self._start_worker()

    def withdraw(self, job: Job[Any]) -> bool:
        """Take ``job`` out of the queue if it has not started; whether it was there."""
        with self._lock:
            if job._taken or job not in self._jobs:
                return False
            self._jobs.remove(job)
            return True

    def _not_from_a_job(self) -> None:
        if self.on_lane_thread():
            raise RuntimeError(
                "tensorcast was called from inside a loader's source iterator on the same "
                "ranks; a source must not broadcast or iterate another BroadcastingDataLoader"
            )

    def idle(self) -> bool:
        """Whether nothing is queued or running (a job submitted now would run at once)."""
        with self._lock:
            return not self._jobs and self._current is None

    def on_lane_thread(self) -> bool:
        """Whether the calling thread is running one of this lane's jobs."""
        return threading.get_ident() in (self._inline, self._worker_id)

    def run(self, fn: Callable[[], T], frames_taken: Callable[[], int]) -> T:
        """Run ``fn`` in its turn and return its result (``tensorcast.broadcast``), as
        :meth:`start` runs a job: right here when the lane is idle, else on the worker.

        An interrupt here leaves no job for a retry to wait on (NOTE [ Interrupts ]): one
        before ``fn`` started leaves nothing (it is withdrawn from the queue, or never ran
        inline); one after it took its frame breaks the lane, and so does one that lost a
        job waited for on the worker.
        """
        job: Job[T] = Job(fn)
        try:
            self.start(job, frames_taken)
            if _interrupts.hook is not None:
                _interrupts.hook("broadcast.wait")
            return job.result()
        except BaseException as e:
            if job.frames_at_start is not None:  # it ran here, or was to
                if job.done:
                    self.break_if_lost(job, e, frames_taken)
            elif not job.done:
                if not self.withdraw(job):
                    self.break_(e)  # it runs on the worker: its frame would pair with no call
            elif job.error is not e:
                self.break_(e)  # it took its frame and this call loses the result
            raise

    def start(self, job: Job[Any], frames_taken: Callable[[], int]) -> None:
        """Run ``job`` in its turn: right here when nothing is queued or running, else on
        the worker (:meth:`Job.result` waits for it either way).

        Inline, the job runs on the caller's thread, with no hop to the worker and back
        (``docs/design.md``, "One ordered lane per group"). ``frames_taken()``, the count of frames its role
        has taken (NOTE [ A frame is atomic ]), is read first: a job whose count moved and
        whose result an interrupt then took breaks the lane (:meth:`break_if_lost`). A job
        that an interrupt kept from running is freed for the worker (:meth:`settle`).
        """
        me = threading.get_ident()
        if me == self._inline or me == self._worker_id:
            self._not_from_a_job()
        if self.suspects:
            settle_suspects(self)
        with self._lock:
            if _exits.state["ran"] or sys.is_finalizing():
                _exits.refuse(self.name)
            inline = not self._jobs and self._current is None
            if inline:
                self.submitted += 1
                self._current = job
                self._inline = me
                job._taken = True
                job.frames_at_start = frames_taken()  # a C call: no interrupt lands in it
            else:
                self._queue(job)
        if not inline:
            return
        try:
            if _interrupts.hook is not None:
                _interrupts.hook("lane.busy")
            guard = self.check if job.guarded else None
            if torch.is_inference_mode_enabled():  # buffers made here must not be inference tensors
                with torch.inference_mode(False):
                    job._run(guard)
            else:
                job._run(guard)
        finally:
            with self._lock:
                if self._inline == me:
                    self._current = self._inline = None
                    if not job.done:  # interrupted before it ran: owed a run
                        job._taken = False
                    if self._jobs:
                        self._cond.notify()

    def break_if_lost(
        self, job: Job[Any], error: BaseException, frames_taken: Callable[[], int]
    ) -> None:
        """Break the lane when an inline ``job`` took its frame and an interrupt then took
        its result (its error is no failure tensorcast raised)."""
        if (
            job.frames_at_start is not None
            and frames_taken() != job.frames_at_start
            and not _own(error)
        ):
            self.break_(error)

    def break_(self, cause: BaseException) -> None:
        """Mark the lane broken after a failure in the middle of a frame (first cause
        wins), then abort its group off this thread, waiting ``abort_wait_s`` at most
        (NOTE [ One ordered lane ])."""
        if self.broken is None:
            self.broken = cause
        self._abort.once()

    def check(self) -> None:
        """Raise ``PeerError`` if the lane is broken (and abort its group, if no abort has
        begun yet)."""
        if self.broken is not None:
            self._abort.once()
            raise PeerError(
                f"tensorcast's channel on ranks {self.name} failed earlier and cannot be "
                f"trusted any more ({type(self.broken).__name__}: {self.broken}); "
                f"restart the job (every rank learns of the failure within its timeout)"
            )

    def _run(self) -> None:
        me = threading.current_thread()
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
            apart_from_captures()  # NOTE [ Device work at next() ]
        if self._device_group:  # this thread's packing only: the loader's workers need the cores
            torch.set_num_threads(1)
        while True:
            with self._cond:
                if not self._jobs or self._current is not None:
                    self._cond.wait(_sleep_s(self.inflight, self._idle_exit_s))
                if not self._jobs and not len(self.inflight):
                    if self._worker is me or self._worker is None:
                        self._worker = self._worker_id = None
                    return
                if self._current is not None or not self._jobs:  # inline job, or device work only
                    job = None
                else:
                    job = self._current = self._jobs.popleft()
                    job._taken = True
                    self._worker_id = me.ident
            if job is None:
                self._check_deadlines()
                continue
            try:
                job._run(self.check if job.guarded else None)
            finally:
                job = None  # type: ignore[assignment]  # keeps no batch alive while idle
                with self._cond:
                    self._current = None

    def _check_deadlines(self) -> None:
        """Break the lane when device work is past its deadline and not done: a peer
        died, or never posted its side (NOTE [ Device work at next() ])."""
        late = self.inflight.overdue()
        if late is None:
            return
        self.inflight.clear()
        self.break_(
            TimeoutError(
                f"a payload posted on the GPU was not done {late:.1f} s after its deadline "
                f"(the channel's timeout): a peer died, or did not post its side of the frame"
            )
        )


def _sleep_s(inflight: Inflight, idle_exit_s: float) -> float:
    """How long a lane's worker may sleep: until a job, its idle exit, or the deadline of
    the device work in flight."""
    deadline = inflight.next_deadline()
    if deadline is None:
        return idle_exit_s
    return min(idle_exit_s, max(0.0, deadline - time.monotonic()) + 0.01)


class _Abort:
    """A broken lane's abort of its group: on a thread of its own, waited for a bounded
    time (NOTE [ One ordered lane ]), begun once. An interrupt inside ``Thread.start()``
    can leave a thread that never runs its target: the abort says itself that it began,
    and until it has, every :meth:`once` starts it again (aborting twice is harmless)."""

    def __init__(self, abort: Callable[[], None], name: str, wait_s: float) -> None:
        self._abort = abort
        self._name = name
        self._wait_s = wait_s
        self._began = False  # set by the abort's own thread

    def once(self) -> None:
        """Abort unless an abort has begun; wait for it ``wait_s`` at most (on a plain
        lock, as a job's wait is: see ``Job``)."""
        if self._began:
            return
        done = threading.Lock()
        done.acquire()

        def run() -> None:
            self._began = True
            try:
                with contextlib.suppress(RuntimeError):  # one that cannot is broken all the same
                    self._abort()
            finally:
                done.release()

        aborting = threading.Thread(target=run, name=self._name, daemon=True)
        try:
            aborting.start()
        except RuntimeError:  # no thread starts any more (the interpreter is exiting)
            run()
            return
        if done.acquire(timeout=self._wait_s):
            done.release()


def _own(error: BaseException) -> bool:
    """Whether ``error`` is a failure tensorcast raises itself (then a job's result): a
    frame refused, a batch that cannot travel, a broken channel."""
    return isinstance(error, (TensorcastError, UnsupportedLeafError, ValueError))


def settle_suspects(lane: Lane) -> None:
    """At the lane's first job after setups over its ranks failed here for want of peers
    (``lane.suspects``: each failure, and whether its peers came to it since): where any
    still have not, they went on without this rank, and what it would read or send here
    next would pair with another call, so the lane breaks (NOTE [ A call that does not
    take its part ] in ``loader/broadcast.py``). On the caller's thread; each ``came()``
    is a store read, given up after the default group's timeout (``diagnosis.Asker``)."""
    with lane._lock:
        suspects, lane.suspects = lane.suspects, []
    for cause, came in suspects:
        try:
            ok = came()
        except Exception:  # the store cannot say: as if they had not
            ok = False
        if not ok:
            lane.break_(cause)
            return
