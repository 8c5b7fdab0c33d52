"""One pass of a BroadcastingDataLoader: its steps, queued on the lane, handed out in order.

The steps themselves, and what they hand back, are in ``loader.steps``; a pass left early
runs one more (NOTE [ An early close ]). What a pass leaves its loader (the source's
state, a failure to raise later) goes through a :class:`Ledger`.
"""

from __future__ import annotations

import collections
import copy
import functools
import time
import warnings
from typing import Any

from tensorcast.loader.stats import Recorder
from tensorcast.loader.steps import End, Failure, Item, SourceSteps, steps_for
from tensorcast.transport import interrupts as _interrupts
from tensorcast.transport.device import DevicePart, hand_out, post
from tensorcast.transport.groups import Role
from tensorcast.transport.lane import Job

__all__ = ["Ledger", "Pass"]


class Ledger:
    """What the passes of one loader leave it, read at its next use (``iter()``,
    ``state_dict()``): written only by the pass, on the caller's thread."""

    __slots__ = ("deferred", "orphans", "state")

    def __init__(self) -> None:
        #: the source's state after the last batch yielded (``prefetch > 0``; else None)
        self.state: Any = None
        #: a failure of a pass that was let go, raised at the loader's next use
        self.deferred: BaseException | None = None
        #: the steps of a pass freed on a lane thread, finished at the loader's next use
        self.orphans: list[Job[Any]] = []


class Pass:
    """An iterator over one pass; made by ``iter(loader)`` on every rank together.

    Every step is recorded in ``_pending`` before it is queued on the lane, and leaves it
    only as its batch is handed out, so an interrupt anywhere in ``next()`` leaves a state
    the retry picks up from (NOTE [ Interrupts ]): ``_unsettled`` says that a step may be
    recorded and not queued, and :meth:`Lane.settle` queues what is owed.
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
        self._opening: Job[Any] | None = None  # the job that numbers the pass's frames
        self._closing: Job[Any] | None = None  # NOTE [ An early close ]
        self._ending: End | Failure | None = None  # how the pass ended, until raised
        self._started = self._finished = self._unsettled = False
        steps = self._steps = steps_for(role, device, source, self._depth)
        self._stats = stats  # NOTE [ Where a step's time goes ]
        self._called = 0.0  # when the current next() began
        # The role's count of frames taken, for the lane's interrupt rules; a C call.
        self._frames_taken = functools.partial(getattr, role, "step")
        self._step = steps.step

    def _start(self) -> None:
        """The pass's first ``next()``: ``iter(source)`` and the first ``prefetch`` steps.

        Not at ``iter()``: frameworks make an iterator only to check that one can be made
        (Lightning does) and drop it, and a source's iterator may consume a restored
        state (lhotse's samplers do) or pull batches ahead. Each part runs once, whatever
        interrupts it: ``_started`` is set last.
        """
        steps, role, index = self._steps, self._role, self._index
        if (
            isinstance(steps, SourceSteps)
            and steps.source_iter is None
            and steps.start_error is None
        ):
            # On the caller's thread, as a plain loop would call it; a failure (an interrupt
            # included) is announced to the receivers by the first step.
            try:
                steps.source_iter = iter(self._source)
                if steps.stateful is not None:  # the position before the first batch
                    self._ledger.state = copy.deepcopy(steps.stateful.state_dict())
            except BaseException as e:
                steps.start_error = e
        if _interrupts.hook is not None:
            _interrupts.hook("next.start")
        if self._opening is None:
            self._unsettled = True
            self._opening = Job(lambda: role.start_pass(index))
            self._lane.enqueue(self._opening)
            self._unsettled = False
        self._refill()
        self._started = True

    def __iter__(self) -> Pass:
        return self

    def __next__(self) -> Any:
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
            if not self._depth and self._lane.idle():
                self._run_inline()
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
        jobs = [self._opening, *self._pending] if self._opening is not None else self._pending
        self._lane.settle(jobs)
        self._unsettled = False

    def _submit(self) -> None:
        """One more step: recorded, then queued (an interrupt between the two is settled)."""
        self._unsettled = True
        job: Job[Any] = Job(self._step)
        self._pending.append(job)
        if _interrupts.hook is not None:
            _interrupts.hook("next.recorded")
        self._lane.enqueue(job)
        if _interrupts.hook is not None:
            _interrupts.hook("next.queued")
        self._unsettled = False

    def _run_inline(self) -> None:
        """``prefetch=0`` on an idle lane: the step runs right here (see :meth:`Lane.start`)."""
        self._unsettled = True
        job: Job[Any] = Job(self._step)
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
                tree = self._take(item)
            if self._depth:
                self._refill(1)
                if self._ahead:
                    self._post_ahead()
            if item.state is not None:
                self._ledger.state = item.state
            self._stats.handed_out(self._called, item.source_s, item.wire_s, item.nbytes)
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
            return hand_out(item.tree, self._lane)
        except Exception:
            if self._lane.broken is None:
                del self._pending[0]
                self._refill()
            raise

    def _post_ahead(self) -> None:
        """With ``prefetch >= 2`` on a device, post the next batch's device work now, so that its
        transfer overlaps the step the caller is about to run; on every rank at the same
        ``next()``, in lane order. Waits for that batch's host work, which has had a step
        to run."""
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
        self.close()
        self._lane.inflight.reap()  # let go of what the device is done with, here and now
        self._ending = None
        if isinstance(item, Failure):
            raise item.error
        raise StopIteration

    def close(self) -> None:
        """Finish the steps owed to the peers (their batches are dropped); a pass left
        before its end then agrees with them on where (NOTE [ An early close ]). Safe to
        call again, also after an interrupt; raises what a step that was let go raised,
        if it broke the channel."""
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
        """Whether the pass was left early, not ended, and the channel still works: a
        broken one fails every rank anyway, and a pass freed by the garbage collector
        after a failure then has nothing to wait for."""
        return (
            not self._finished
            and self._ending is None
            and self._opening is not None
            and self._lane.broken is None
        )

    def _record_close(self) -> None:
        """The close job, recorded behind the steps owed, then queued; idempotent, so an
        interrupt anywhere here is repaired by the next close (``settle`` queues it).
        Queued from a lane thread too (``settle`` may be: see ``__del__``)."""
        self._unsettled = True
        if self._closing is None:
            self._closing = Job(self._steps.close)
        if self._closing not in self._pending:
            self._pending.append(self._closing)
        self._settle()

    def __del__(self) -> None:
        # A `for ... break` drops the pass: finish its steps now, so that no collective is
        # left pending, and keep a failure for the loader's next use (it cannot be raised
        # from here: it is warned of now). Freed on a lane thread (the garbage collector
        # runs anywhere), waiting would wait on itself: the loader then finishes the steps
        # at its next use.
        if self._lane.on_lane_thread():
            if self._owes_close():
                self._record_close()
            elif self._unsettled:
                self._settle()
            self._ledger.orphans.extend(self._pending)
            self._pending.clear()
            self._finished = True
            return
        try:
            self.close()
        except Exception as e:
            self._ledger.deferred = e
            role = self._role
            what = "the source" if role.is_source else f"a receiver of rank {role.src}"
            warnings.warn(
                f"tensorcast: rank {role.rank} ({what}) left pass {self._index} of a "
                f"BroadcastingDataLoader early, and closing it failed: "
                f"{type(e).__name__}: {e} (raised again at this loader's next use). Ranks "
                f"that break out of the loop must do so after the same batch, on every rank: "
                f"decide the break together, e.g. with an all_reduce of a stop flag",
                RuntimeWarning,
                stacklevel=2,
            )
