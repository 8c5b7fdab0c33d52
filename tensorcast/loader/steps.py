"""One pass of a BroadcastingDataLoader: its steps as jobs on the lane, and their results.

Each step is one job (see NOTE [ One ordered lane ]): on the source it pulls the next
batch and sends its frame, on a receiver it receives a frame. A step whose pass already
ended (an END or ERROR frame came before it) does nothing on any rank: every rank
learns of the end from the same frame, so all of them skip alike.

What a step hands back to the consumer:

    ============  ================================  ====================================
    result        source                            receivers
    ============  ================================  ====================================
    ``_Item``     the batch was sent                a batch arrived
    ``_END``      the source is exhausted           an END frame arrived
    ``_Failure``  the source raised: that very      an ERROR frame arrived: a
                  exception, raised again there     ``SourceError``
    ============  ================================  ====================================

A job's own exception (``PeerError``, ``DesyncError``, ``HeaderError``) is raised to
the consumer as it is.
"""

from __future__ import annotations

import collections
import copy
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tensorcast._errors import SourceError
from tensorcast.loader.stats import Recorder
from tensorcast.transport import interrupts as _interrupts
from tensorcast.transport.channel import Channel
from tensorcast.transport.frame import Kind
from tensorcast.transport.lane import Job

if TYPE_CHECKING:
    from tensorcast.loader.dataloader import BroadcastingDataLoader

__all__ = ["Pass", "stateful"]


def stateful(source: Any) -> Any:
    """What holds the source's position: the source, or its batch sampler or sampler
    (a plain DataLoader over a lhotse sampler); None when nothing has a state."""
    for target in (
        source,
        getattr(source, "batch_sampler", None),
        getattr(source, "sampler", None),
    ):
        if target is not None and callable(getattr(target, "state_dict", None)):
            return target
    return None


class _End:
    """The source is exhausted."""


_END = _End()
_NOTHING = object()  # no batch pulled and kept


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Item:
    __slots__ = ("state", "tree")

    def __init__(self, tree: Any, state: Any) -> None:
        self.tree = tree
        self.state = state


class _Steps:
    """The job side of a pass: what its steps share, run on the lane's worker.

    Kept apart from :class:`Pass` so that queued steps hold no reference to it: a
    ``for ... break`` then frees the pass at once, on the caller's thread.
    """

    def __init__(self, channel: Channel, device: Any, source: Any, depth: int) -> None:
        self.channel = channel
        self.device = device
        self.ended = False  # the pass's END or ERROR frame went by
        self.source_iter: Iterator[Any] | None = None
        self.start_error: BaseException | None = None
        self.stateful = stateful(source) if depth and channel.is_source else None
        self.stats = Recorder()  # replaced by the pass's own
        # A batch pulled whose frame an interrupt kept from going out: the next step sends
        # it (NOTE [ Interrupts ], ``step.pulled``).
        self.pulled: Any = _NOTHING

    def source(self) -> Any:
        channel = self.channel
        if self.ended:
            return _END
        channel.group.lane.check()
        batch = self.pulled
        pulled = 0.0
        if batch is _NOTHING:
            try:
                if self.start_error is not None:
                    raise self.start_error
                with channel.pulling:
                    started = time.perf_counter()
                    batch = next(self.source_iter)  # type: ignore[arg-type]
                    pulled = time.perf_counter() - started
            except StopIteration:
                self.ended = True
                channel.send_end()
                return _END
            except BaseException as e:
                return self._fail(e, f"source iterator failed: {type(e).__name__}: {e}")
            self.pulled = batch
        if _interrupts.hook is not None:
            _interrupts.hook("step.pulled")
        try:
            # A deep copy: later steps advance the source before this batch is yielded.
            # `is not None`: a DataLoader's truth value calls its __len__, which an unsized
            # source (a lhotse sampler under StatefulDataLoader) raises from.
            target = self.stateful
            state = copy.deepcopy(target.state_dict()) if target is not None else None
        except Exception as e:
            return self._fail(e, f"source state_dict() failed: {type(e).__name__}: {e}")
        try:
            frame, own = channel.prepare(batch, self.device)
        except Exception as e:
            return self._fail(e, f"batch serialization failed: {type(e).__name__}: {e}")
        item = _Item(own, state)
        started = time.perf_counter()
        channel.send(frame)  # a failure in it breaks the lane
        self.pulled = _NOTHING
        if _interrupts.hook is not None:
            _interrupts.hook("step.took")
        self.stats.job(pulled, time.perf_counter() - started, frame.plan.payload_len)
        return item

    def _fail(self, error: BaseException, message: str) -> _Failure:
        self.ended = True
        self.pulled = _NOTHING
        self.channel.send_error(message)
        return _Failure(error)

    def receiver(self) -> Any:
        if self.ended:
            return _END
        started = time.perf_counter()
        kind, value = self.channel.recv(self.device)
        if _interrupts.hook is not None:
            _interrupts.hook("step.took")
        if kind == Kind.DATA:
            self.stats.job(0.0, time.perf_counter() - started, self.channel.received_nbytes)
            return _Item(value, None)
        self.ended = True
        if kind == Kind.END:
            return _END
        return _Failure(SourceError(f"source rank {self.channel.src} reported: {value}"))


class Pass:
    """An iterator over one pass; made by ``iter(loader)`` on every rank together.

    Every step is recorded in ``_pending`` before it is queued on the lane, and leaves it
    only as its batch is handed out, so an interrupt anywhere in ``next()`` leaves a state
    the retry picks up from (NOTE [ Interrupts ]): ``_unsettled`` says that a step may be
    recorded and not queued, and :meth:`Lane.settle` queues what is owed.
    """

    def __init__(self, loader: BroadcastingDataLoader, channel: Channel, index: int) -> None:
        self._loader = loader
        self._channel = channel
        self._index = index
        self._lane = channel.group.lane
        self._depth = loader.prefetch
        self._pending: collections.deque[Job[Any]] = collections.deque()
        self._opening: Job[Any] | None = None  # the job that numbers the pass's frames
        self._ending: _End | _Failure | None = None  # how the pass ended, until raised
        self._started = self._finished = self._unsettled = False
        steps = self._steps = _Steps(channel, loader.device, loader.source, self._depth)
        steps.stats = self._stats = loader._stats  # NOTE [ Where a step's time goes ]
        self._called = 0.0  # when the current next() began
        self._step = steps.source if channel.is_source else steps.receiver

    def _frames(self) -> int:
        return self._channel.step

    def _start(self) -> None:
        """The pass's first ``next()``: ``iter(source)`` and the first ``prefetch`` steps.

        Not at ``iter()``: frameworks make an iterator only to check that one can be made
        (Lightning does) and drop it, and a source's iterator may consume a restored
        state (lhotse's samplers do) or pull batches ahead. Each part runs once, whatever
        interrupts it: ``_started`` is set last.
        """
        steps, loader, channel, index = self._steps, self._loader, self._channel, self._index
        if channel.is_source and steps.source_iter is None and steps.start_error is None:
            # On the caller's thread, as a plain loop would call it; a failure (an interrupt
            # included) is announced to the receivers by the first step.
            try:
                steps.source_iter = iter(loader.source)  # type: ignore[arg-type]
                if steps.stateful is not None:  # the position before the first batch
                    loader._state = copy.deepcopy(steps.stateful.state_dict())
            except BaseException as e:
                steps.start_error = e
        if _interrupts.hook is not None:
            _interrupts.hook("next.start")
        if self._opening is None:
            self._unsettled = True
            self._opening = Job(lambda: channel.start_pass(index))
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
                self._lane.break_if_lost(job, e, self._frames)
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
        self._lane.start(job, self._frames)
        self._unsettled = False

    def _refill(self, extra: int = 0) -> None:
        while len(self._pending) < self._depth + extra:
            self._submit()

    def _hand_out(self, item: Any) -> Any:
        # Until the step leaves the queue, an interruption hands out the same batch on the
        # next call: a caught Ctrl-C never skips a batch on one rank only.
        if isinstance(item, _Item):
            if _interrupts.hook is not None:
                _interrupts.hook("next.hand_out")
            if self._depth:
                self._refill(1)
            if item.state is not None:
                self._loader._state = item.state
            self._stats.handed_out(self._called)
            # From here to the return there is no call, so no point where a signal handler
            # runs (NOTE [ Interrupts ]); the pass keeps no reference to the batch after.
            tree = item.tree
            item.tree = None
            del self._pending[0]
            return tree
        self._ending = item  # kept until raised: a retry after an interrupt raises it
        return self._end()

    def _end(self) -> Any:
        """The pass ended (END or ERROR): finish the steps owed, then raise the ending."""
        item = self._ending
        self.close()
        self._ending = None
        if isinstance(item, _Failure):
            raise item.error
        raise StopIteration

    def close(self) -> None:
        """Finish the steps owed to the peers (their batches are dropped). Safe to call
        again, also after an interrupt; raises what a step that was let go raised, if it
        broke the channel."""
        if self._finished and not self._pending:
            return
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

    def __del__(self) -> None:
        # A `for ... break` drops the pass: finish its steps now, so that no collective is
        # left pending, and keep a failure for the loader's next use (it cannot be raised
        # from here). Freed on a lane thread (the garbage collector runs anywhere), waiting
        # would wait on itself: the loader then finishes the steps at its next use.
        if self._lane.on_lane_thread():
            if self._unsettled:
                self._settle()
            self._loader._orphans.extend(self._pending)
            self._pending.clear()
            self._finished = True
            return
        try:
            self.close()
        except Exception as e:
            self._loader._deferred = e
