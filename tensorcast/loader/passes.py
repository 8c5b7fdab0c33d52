"""One pass of a BroadcastingDataLoader: its steps, queued on the lane, handed out in order.

The steps themselves, and what they hand back, are in ``loader.steps``; a pass that the
program closes runs one more (NOTE [ An early close ]). What a pass leaves its loader (the
source's state, which pass draws from the source) goes through a :class:`Ledger`.

# NOTE [ Where a pass ends ]
Every job of a pass is queued from the caller's thread, at a point that is the same on
every rank: one of its ``next()`` calls, or its ``close()``. Nothing else ever queues one,
not ``__del__``, a weakref callback, the garbage collector nor ``atexit``: their moments
differ between processes, and at interpreter exit no thread can start. Hence:

- Each ``iter(loader)`` is a pass of its own, as with torch's ``DataLoader``
  (``zip(loader, loader)`` yields pairs of a re-iterable source): the loader numbers it,
  on every rank alike, and its frames carry that number and their step in it (its
  ``Stamp``), so passes of one loader may interleave on the lane, and a second ``iter()``
  never silently ends the first (over a source that hands out one iterator, see below).
- A pass that ends (its END or ERROR frame) or that the program closes (``close()`` on
  every rank after the same batch, NOTE [ An early close ]) finishes its steps there.
- A pass that is only *dropped* (a ``for ... break``, an iterator let go, whenever its
  last reference goes, by refcount or by the collector) does nothing: the steps it
  queued, at the same ``next()`` on every rank, run on the lane like any other, and
  their batches are dropped. No CLOSE frame is ever queued for it. Ranks that dropped it
  after different batches queued different steps: the channel's next frame then carries
  another pass or step than a receiver expects (``DesyncError``), or none comes (the
  receiver's timeout, with its diagnosis).
- A new pass, at its first ``next()`` and before it calls ``iter(source)``, waits on the
  source rank (locally, queuing nothing) for every job queued on its lane before it
  (:func:`finish_queued`): the steps of the passes before it, of this loader or of
  another built over the same source (a loader made anew each epoch), call ``next()`` on
  the old iterator, and a source that restarts itself at
  ``iter()`` (a lhotse sampler returns itself, a ``DataLoader`` with persistent workers
  resets its one iterator) would hand them the new epoch's first batches, or fail
  (torch's ``Invalid iterator state``). Their batches are dropped as before; their
  failures are the old pass's, not raised here. When the new pass then draws from what
  an open pass draws from (``iter(source)`` returned the very iterator, as such a source
  or a generator does; or the source's sampler is its own iterator, a lhotse sampler
  under a ``DataLoader``: ``steps.drawn_from``), that pass draws no more: its next step
  fails with a ``RuntimeError`` naming the new pass, on every rank (an ERROR frame),
  rather than take the new pass's batches, repeat its own after a restart, or share them.
  So ``zip(loader, loader)`` over such a source raises; a pass left by a ``break`` and
  kept alive is no obstacle to the next one. This is per loader (its ``Ledger``): a pass
  of another loader over the same source is not watched.
- ``load_state_dict()`` refuses while a pass of its loader is open (started, not ended,
  its iterator alive after a ``gc.collect()``, so that every rank decides alike), and
  waits, queuing nothing, for the jobs queued on its lane (its dropped passes' steps
  among them): they pull from the source, and a resume must start where the state says.
- ``next()`` on a pass admits one caller at a time; a second thread, or a signal handler
  inside it, gets a ``RuntimeError``, never ``None`` nor a batch skipped.
- At interpreter exit nothing is queued: the steps still queued are withdrawn, unsent,
  and only the one a lane runs then is let finish (NOTE [ Interpreter exit ] in
  ``transport.exits``).
"""

from __future__ import annotations

import collections
import copy
import functools
import time
import weakref
from collections.abc import Callable
from typing import Any

from tensorcast.loader.stats import Recorder
from tensorcast.loader.steps import End, Failure, Item, SourceSteps, drawn_from, steps_for
from tensorcast.transport import DevicePart, Job, Lane, Role, hand_out, post
from tensorcast.transport import interrupt_points as _interrupts

__all__ = ["Ledger", "NoOpPass", "Pass", "finish_queued"]


class Ledger:
    """What the passes of one loader leave it, read at its next use (``state_dict()``,
    ``load_state_dict()``): written only by the passes, on the caller's thread."""

    __slots__ = ("drawing", "state")

    def __init__(self) -> None:
        #: the source's state after the last batch yielded (``prefetch > 0``; else None),
        #: by whichever pass handed it out; before a pass's first batch, the state it
        #: starts from; once the source is exhausted, its state then
        self.state: Any = None
        #: on the source, the steps of the pass that called ``iter(source)`` last, while
        #: they live: a later pass that draws from what they draw from takes it over
        self.drawing: weakref.ReferenceType[SourceSteps] | None = None


def finish_queued(lane: Lane) -> BaseException | None:
    """Wait for every job queued so far on ``lane`` (a local wait: nothing is queued), by
    any loader or broadcast on its ranks: the steps of dropped passes, of this loader or
    another over the same source, draw from that source. The error of the last one, if it
    failed. An interrupt leaves the wait owed to the retry.

    Raises:
        RuntimeError: called from a job (a source that iterates a loader on its ranks).
    """
    job = lane.last()
    if job is None:
        return None
    try:
        job.result()
    except BaseException as e:
        if job.done and job.error is e:  # the job's own failure, not this wait's
            return e
        raise
    return None


class _OneCaller:
    """An iterator over a pass that serves one caller at a time: ``next()`` or ``close()``
    while another thread (or a signal handler that interrupted it) is inside either raises
    a ``RuntimeError``, never hands out ``None`` nor skips a batch."""

    _index: int
    _inside: bool  # a thread is inside next() or close()

    def __iter__(self) -> _OneCaller:
        return self

    def __next__(self) -> Any:
        # A flag, not a lock: between its test and its set, and in the `finally`, there is
        # no call, so no point where another thread or a signal handler runs (NOTE
        # [ Interrupts ]); releasing a lock is a call, and a handler that raised at its
        # return would lose the batch just handed out.
        if self._inside:
            raise _busy("next()", self._index)
        self._inside = True
        try:
            return self._next()
        finally:
            self._inside = False

    def close(self) -> None:
        """Close the pass here. On a group: finish the steps owed to the peers (their
        batches are dropped), and, left before its end, agree with them on where (NOTE
        [ An early close ]). Call it on every rank after the same batch, or not at all: a
        pass that is only dropped needs nothing (NOTE [ Where a pass ends ]). Safe to call
        again, also after an interrupt; raises what a step that was let go raised, if it
        broke the channel.

        Raises:
            RuntimeError: ``next()`` or ``close()`` is running on this iterator already.
            DesyncError: the ranks closed the pass after different batches.
        """
        if self._inside:
            raise _busy("close()", self._index)
        self._inside = True
        try:
            self._close()
        finally:
            self._inside = False

    def _next(self) -> Any:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


class Pass(_OneCaller):
    """An iterator over one pass; made by ``iter(loader)`` on every rank together (NOTE
    [ Where a pass ends ]).

    Every step is recorded in ``_pending`` before it is queued on the lane, and leaves it
    only as its batch is handed out, so an interrupt anywhere in ``next()`` leaves a state
    the retry picks up from (NOTE [ Interrupts ]): ``_unsettled`` says that a step may be
    recorded and not queued, and :meth:`Lane.settle` queues what is owed.

    It has no finaliser: dropped, it only stops queuing steps.
    """

    def __init__(
        self,
        role: Role,
        index: int,
        *,
        source: Any,
        prefetch: int,
        device: Any,
        ledger: Ledger,
        stats: Recorder,
    ) -> None:
        self._role = role
        self._index = index
        self._lane = role.group.lane
        self._depth = prefetch
        self._source = source
        self._ledger = ledger
        # Batches come as device parts only on a device wire or for a device output: then
        # with prefetch >= 2 the next one's device work is posted ahead (_post_ahead).
        on_device = role.group.wire.streams is not None or (
            device is not None and device.type != "cpu"
        )
        self._ahead = self._depth >= 2 and on_device
        self._pending: collections.deque[Job[Any]] = collections.deque()
        self._closing: Job[Any] | None = None  # NOTE [ An early close ]
        self._ending: End | Failure | None = None  # how the pass ended, until raised
        self._started = self._finished = self._unsettled = False
        self._opened = False  # a step was recorded: a close owes the peers its CLOSE frame
        self._inside = False  # a thread is inside next() or close() (see __next__)
        steps = self._steps = steps_for(role, device, index, source, self._depth)
        self._stats = stats  # NOTE [ Where a step's time goes ]
        self._called = 0.0  # when the current next() began
        # The role's count of frames taken, for the lane's interrupt rules; a C call.
        self._frames_taken = functools.partial(getattr, role, "frames")
        self._step = steps.step

    @property
    def open(self) -> bool:
        """Whether the pass started and has neither ended nor been closed."""
        return self._started and not self._finished and self._ending is None

    def _start(self) -> None:
        """The pass's first ``next()``: ``iter(source)`` and the first ``prefetch`` steps.

        Not at ``iter()``: frameworks make an iterator only to check that one can be made
        (Lightning does) and drop it, and a source's iterator may consume a restored
        state (lhotse's samplers do) or pull batches ahead. Each part runs once, whatever
        interrupts it: ``_started`` is set last.
        """
        steps = self._steps
        if (
            isinstance(steps, SourceSteps)
            and steps.source_iter is None
            and steps.start_error is None
        ):
            # The steps a dropped pass queued draw from the same source: done first, or
            # a source that restarts itself at iter() (a lhotse sampler, persistent workers)
            # would lose the new pass's first batches to them (NOTE [ Where a pass ends ]).
            finish_queued(self._lane)
            # On the caller's thread, as a plain loop would call it; a failure (an interrupt
            # included) is announced to the receivers by the first step.
            try:
                steps.source_iter = iter(self._source)
                steps.drawing = drawn_from(self._source, steps.source_iter)
                self._take_over(steps)
                if steps.stateful is not None:  # the position before the first batch
                    self._ledger.state = copy.deepcopy(steps.stateful.state_dict())
            except BaseException as e:
                steps.start_error = e
        if _interrupts.hook is not None:
            _interrupts.hook("next.start")
        self._refill()
        self._started = True

    def _take_over(self, steps: SourceSteps) -> None:
        """``steps`` draw from what ``steps.drawing`` is: an open pass that drew from that
        very object draws no more (NOTE [ Where a pass ends ])."""
        ledger = self._ledger
        before = ledger.drawing() if ledger.drawing is not None else None
        if before is not None and not before.ended and before.drawing is steps.drawing:
            before.taken_over = self._index
        ledger.drawing = weakref.ref(steps)

    def _next(self) -> Any:
        self._called = time.perf_counter()  # NOTE [ Where a step's time goes ]
        if self._ending is not None:
            return self._end()
        if self._finished:
            raise StopIteration
        if self._unsettled:
            self._settle()
        if not self._started:
            self._start()
        if not self._pending:
            if not self._depth:
                self._run_inline()  # queued by the lane if it is busy (Lane.start)
            else:
                self._submit()
        job = self._pending[0]
        try:
            if _interrupts.hook is not None:
                _interrupts.hook("next.wait")
            item = job.result()
        except BaseException as e:
            if job.done and job.error is e:  # the step's own failure, raised once
                self._lane.break_if_lost(job, e, self._frames_taken)
                if self._pending and self._pending[0] is job:
                    del self._pending[0]
                if self._lane.broken is None:  # a step refused on this rank only (a bad CRC):
                    self._refill()  # submit what every other rank submits at this next()
            raise  # else a signal interrupted the wait: the step stays, to wait on again
        return self._hand_out(item)

    def _settle(self) -> None:
        self._lane.settle(self._pending)
        self._unsettled = False

    def _submit(self) -> None:
        """One more step: recorded, then queued (an interrupt between the two is settled)."""
        self._unsettled = self._opened = True
        job: Job[Any] = Job(self._step, guarded=True)
        self._pending.append(job)
        if _interrupts.hook is not None:
            _interrupts.hook("next.recorded")
        self._lane.enqueue(job)
        if _interrupts.hook is not None:
            _interrupts.hook("next.queued")
        self._unsettled = False

    def _run_inline(self) -> None:
        """``prefetch=0``: the step runs right here when the lane is idle, else on its worker
        after what is queued (:meth:`Lane.start` decides, under the lane's lock)."""
        self._unsettled = self._opened = True
        job: Job[Any] = Job(self._step, guarded=True)
        self._pending.append(job)
        self._lane.start(job, self._frames_taken)
        self._unsettled = False

    def _refill(self, extra: int = 0) -> None:
        while len(self._pending) < self._depth + extra:
            self._submit()

    def _hand_out(self, item: Any) -> Any:
        # Until the step leaves the queue, an interruption hands out the same batch on the
        # next call: a caught Ctrl-C never skips a batch on one rank only.
        if isinstance(item, Item):
            if _interrupts.hook is not None:
                _interrupts.hook("next.hand_out")
            tree = item.tree
            if isinstance(tree, DevicePart):
                tree = self._take(item)  # the next batch's part is posted before this build
            elif self._ahead:
                self._post_ahead()
            if self._depth:
                self._refill(1)
            if item.state is not None and self._steps.taken_over is None:
                self._ledger.state = item.state  # a pass taken over is not the position
            self._stats.handed_out(
                self._called, item.source_s, item.wait_s, item.transfer_s, item.nbytes,
                shm_nbytes=item.shm_nbytes,
            )  # fmt: skip
            # From here to the return there is no call, so no point where a signal handler
            # runs (NOTE [ Interrupts ]); the pass keeps no reference to the batch after.
            item.tree = None
            del self._pending[0]
            return tree
        self._ending = item  # kept until raised: a retry after an interrupt raises it
        return self._end()

    def _take(self, item: Item) -> Any:
        """The batch for the caller's stream (NOTE [ Device work at next() ]). A device
        frame refused here on this rank only (a bad CRC, bad values) is its step's
        failure, as a job's is: the step leaves, and the next ``next()`` goes on."""
        try:
            return hand_out(item.tree, self._lane, self._post_ahead if self._ahead else None)
        except Exception:
            if self._lane.broken is None:
                del self._pending[0]
                self._refill()
            raise

    def _post_ahead(self) -> None:
        """With ``prefetch >= 2`` on a device, post the next batch's device work now, so that its
        transfer overlaps the step the caller is about to run; on every rank at the same
        ``next()``, in lane order, before this batch is built (a batch refused on this rank
        alone skips no post). Waits for that batch's host work, which has had a step to
        run."""
        if len(self._pending) < 2:
            return
        job = self._pending[1]
        try:
            ahead = job.result()
        except BaseException:
            if job.done:
                return  # the step's own failure: raised at its own next()
            raise
        if isinstance(ahead, Item):
            post(ahead.tree)

    def _end(self) -> Any:
        """The pass ended (END or ERROR): finish the steps owed, then raise the ending."""
        item = self._ending
        self._close()
        self._lane.inflight.reap()  # let go of what the device is done with, here and now
        steps, ledger = self._steps, self._ledger
        if isinstance(item, End) and ledger.drawing is not None and ledger.drawing() is steps:
            # The source exhausted and nothing drawn past it, no later pass started: its
            # own state is the position from now on (a resume from the end of the pass
            # starts there, which the last batch's does not say), and it stays current
            # through what the caller does before the next pass (a set_epoch).
            ledger.state = None
        self._ending = None
        if not isinstance(item, Failure):
            raise StopIteration
        # Raised once, and held by nothing here after: the frames of its traceback refer
        # to this pass and its items, so an item or a local that kept it would make a
        # cycle that keeps the pass (its groups, a mesh, their process groups) until the
        # garbage collector runs, possibly in a process forked meanwhile.
        error = item.error
        del item.error, item
        try:
            raise error
        finally:
            del error

    def _close(self) -> None:
        if self._finished and not self._pending:
            return
        if self._owes_close():
            self._record_close()
        self._finished = True
        if self._unsettled:
            self._settle()
        error: BaseException | None = None
        while self._pending:
            job = self._pending[0]
            if _interrupts.hook is not None:
                _interrupts.hook("close.wait")
            try:
                job.result()
            except Exception as e:
                error = error or e
            del self._pending[0]
        if error is not None and self._lane.broken is not None:
            raise error

    def _owes_close(self) -> bool:
        """Whether the pass queued steps, has not ended, and the channel still works (a
        broken one fails every rank anyway)."""
        return (
            not self._finished
            and self._ending is None
            and self._opened
            and self._lane.broken is None
        )

    def _record_close(self) -> None:
        """The close job, recorded behind the steps owed, then queued; idempotent, so an
        interrupt anywhere here is repaired by the next close (``settle`` queues it)."""
        self._unsettled = True
        if self._closing is None:
            self._closing = Job(self._steps.close)
        if self._closing not in self._pending:
            self._pending.append(self._closing)
        self._settle()


class NoOpPass(_OneCaller):
    """A no-op loader's pass (nothing spans its group): the source's batches as they come,
    each ``next(source)`` recorded as the step's stall and its source time (nothing
    travels). ``iter(source)`` at the first ``next()``, and one caller at a time, as
    :class:`Pass`; ``close()`` ends it."""

    def __init__(
        self, index: int, source: Any, stats: Recorder, rebuild: Callable[[Any], Any]
    ) -> None:
        self._index = index
        self._source = source
        self._stats = stats
        self._rebuild = rebuild
        self._iterator: Any = None
        self._inside = False
        self._finished = False

    @property
    def open(self) -> bool:
        """Whether the pass started and has neither ended nor been closed."""
        return self._iterator is not None and not self._finished

    def _next(self) -> Any:
        if self._finished:
            raise StopIteration
        called = time.perf_counter()
        try:
            if self._iterator is None:
                self._iterator = iter(self._source)
            batch = next(self._iterator)
        except Exception:  # the end, or the source's failure: the pass ends, as on a group
            self._finished = True
            raise
        pulled = time.perf_counter() - called
        out = self._rebuild(batch)
        self._stats.handed_out(called, pulled)
        return out

    def _close(self) -> None:
        self._finished = True


def _busy(what: str, index: int) -> RuntimeError:
    return RuntimeError(
        f"{what} on an iterator of pass {index} of a BroadcastingDataLoader was called "
        f"while next() or close() is already running on it, in another thread (or in a "
        f"signal handler that interrupted it). One iterator serves one caller at a time: "
        f"guard it with a lock, or call it from one thread"
    )
