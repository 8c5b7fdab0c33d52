"""The steps of a pass: what each one runs on the lane, and what it hands back.

Each step is one job (see NOTE [ One ordered lane ]): on the source it pulls the next
batch and sends its frame, on a receiver it receives a frame. A step whose pass already
ended (an END or ERROR frame came before it) does nothing on any rank: every rank
learns of the end from the same frame, so all of them skip alike.

What a step hands back to the consumer:

    ============  ================================  ====================================
    result        source                            receivers
    ============  ================================  ====================================
    ``Item``      the batch was sent                a batch arrived
    ``END``       the source is exhausted           an END frame arrived
    ``Failure``   the source raised: that very      an ERROR frame arrived: a
                  exception, raised again there     ``SourceError``
    ============  ================================  ====================================

A job's own exception (``PeerError``, ``DesyncError``, ``HeaderError``) is raised to
the consumer as it is. The steps know the roles (``transport.sender`` /
``transport.receiver``) and nothing of frames: a receiver's role hands back a batch,
``END`` or ``CLOSE``, and raises ``SourceError`` for the source's failure.

Each pass's frames carry its own :class:`Stamp` (its index and its next step), moved by
its steps alone: passes of one loader may interleave on the lane (NOTE [ Where a pass
ends ] in ``loader.passes``).

# NOTE [ An early close ]
A pass that the program closes before its end (``close()`` on its iterator, on every rank
after the same batch) runs one more job on every rank, after the steps it owes: the
source sends a CLOSE frame stamped with the pass's next step, and each receiver expects
exactly that frame at its own next step. Ranks that closed after the same batch agree
on it. A receiver that asked for more steps than the source sent is handed the CLOSE
frame by a step and raises ``DesyncError`` at once (it waits for nothing); one that
stopped earlier than the source is handed a batch (or the END) where the CLOSE was due.
Either breaks the lane, whose group is aborted, so a source still sending fails at once
and one that left fails at its next use. A pass that is only dropped (a ``for ...
break``, an iterator let go) sends and expects no CLOSE: its queued steps run, and a
break after different batches is caught by the next frame's stamp (NOTE [ Where a pass
ends ]).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

from tensorcast._errors import DesyncError, SourceError, describe
from tensorcast.transport import CLOSE, END, End, Receiver, Role, Sender, Stamp
from tensorcast.transport import interrupt_points as _interrupts

__all__ = [
    "END",
    "End",
    "Failure",
    "Item",
    "ReceiverSteps",
    "SourceSteps",
    "Steps",
    "drawn_from",
    "stateful",
    "steps_for",
]

_FIX = (
    "close (or break) on every rank after the same batch (decide it together, e.g. with "
    "an all_reduce of a stop flag)"
)


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


_NOTHING = object()  # no batch pulled and kept


class Failure:
    """The source failed: its very exception on the source, ``SourceError`` elsewhere
    (deleted once the pass raised it: nothing of the pass refers to it after)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Item:
    """A step's batch (this rank's tree), the source's state after it, and what the step
    spent (in ``next(source)``, waiting for the source's frame, moving it), recorded as
    the batch is handed out (NOTE [ Where a step's time goes ])."""

    __slots__ = ("nbytes", "shm_nbytes", "source_s", "state", "transfer_s", "tree", "wait_s")

    def __init__(
        self,
        tree: Any,
        state: Any,
        source_s: float,
        wait_s: float,
        transfer_s: float,
        nbytes: int,
        shm_nbytes: int = 0,
    ) -> None:
        self.tree = tree
        self.state = state
        self.source_s = source_s
        self.wait_s = wait_s
        self.transfer_s = transfer_s
        self.nbytes = nbytes
        self.shm_nbytes = shm_nbytes  # of nbytes, those in shared memory


class Steps:
    """The job side of a pass: what its steps share, run on the lane.

    Kept apart from the caller's side (``loader.passes.Pass``) so that queued steps hold
    no reference to it: a ``for ... break`` then frees the pass at once, on the caller's
    thread.
    """

    def __init__(self, role: Role, device: Any, index: int) -> None:
        self.role = role
        self.device = device
        self.stamp = Stamp(index)  # the pass's frames: only these steps move it
        self.ended = False  # the pass's END or ERROR frame went by
        #: on the source, the later pass that draws from what this one draws from (NOTE
        #: [ Where a pass ends ]): this pass draws no more
        self.taken_over: int | None = None

    def step(self) -> Any:
        """One step: an :class:`Item`, ``END`` or a :class:`Failure`."""
        raise NotImplementedError

    def close(self) -> None:
        """A pass left early: the CLOSE frame, sent or expected (NOTE [ An early close ])."""
        raise NotImplementedError

    def _desync(self, what: str) -> DesyncError:
        """The ranks left a pass after different batches: the lane breaks on every rank."""
        role = self.role
        error = DesyncError(
            f"ranks {list(role.ranks)}, pass {self.stamp.pass_index}: {what}. The ranks "
            f"closed the pass after different batches; {_FIX}"
        )
        role.group.lane.break_(error)
        return error


class SourceSteps(Steps):
    """The steps of a pass on the source: pull a batch, send its frame."""

    def __init__(self, role: Sender, device: Any, index: int, source: Any, depth: int) -> None:
        super().__init__(role, device, index)
        self.sender = role
        self.source_iter: Iterator[Any] | None = None
        self.start_error: BaseException | None = None
        self.stateful = stateful(source) if depth else None
        # A batch pulled whose frame an interrupt kept from going out: the next step sends
        # it (NOTE [ Interrupts ], ``step.pulled``).
        self.pulled: Any = _NOTHING
        #: what this pass's batches are drawn from (see :func:`drawn_from`), once started
        self.drawing: Any = None

    def step(self) -> Any:
        sender = self.sender
        if self.ended:
            return END
        batch = self.pulled  # on a whole lane: the step's job is guarded (``Job``)
        pulled = 0.0
        if batch is _NOTHING:
            try:
                if self.start_error is not None:
                    raise self._start_failed()
                if self.taken_over is not None:
                    raise self._taken_over(self.taken_over)
                with sender.pulling:
                    started = time.perf_counter()
                    batch = next(self.source_iter)  # type: ignore[arg-type]
                    pulled = time.perf_counter() - started
            except StopIteration:
                return self._exhausted()
            except BaseException as e:
                return self._fail(e, f"source iterator failed: {describe(e)}")
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
            return self._fail(e, f"source state_dict() failed: {describe(e)}")
        try:
            out, own = sender.write(batch, self.device)
        except Exception as e:
            return self._fail(e, f"batch serialization failed: {describe(e)}")
        started = time.perf_counter()
        sender.send(out, stamp=self.stamp)  # a failure in it breaks the lane
        self.pulled = _NOTHING
        if _interrupts.hook is not None:
            _interrupts.hook("step.took")
        sent = time.perf_counter() - started
        n = out.cut.payload_len
        return Item(own, state, pulled, 0.0, sent, n, n if out.cut.shm else 0)

    def _exhausted(self) -> Any:
        """The source is exhausted: the END frame."""
        self.ended = True
        self.sender.send_end(stamp=self.stamp)
        return END

    def _taken_over(self, later: int) -> RuntimeError:
        kind = type(self.drawing).__name__
        return RuntimeError(
            f"pass {self.stamp.pass_index} of this BroadcastingDataLoader cannot draw another "
            f"batch: pass {later} called iter() on the same source, and draws from what this "
            f"pass draws from (a {kind}). A source that hands out one iterator (a lhotse "
            f"sampler, alone or under a DataLoader; a DataLoader with persistent_workers="
            f"True; a generator) restarts or shares it at iter(), so the two passes would "
            f"take each other's batches. Over such a source run one pass at a time (finish "
            f"or close() this one first), or give each pass a source of its own"
        )

    def _start_failed(self) -> BaseException:
        """How ``iter(source)`` failed, given up: these steps keep no reference to it, as its
        traceback's frames refer to them (a cycle would keep the pass until a collection)."""
        error, self.start_error = self.start_error, None
        assert error is not None, "asked only when iter(source) failed"
        return error

    def _fail(self, error: BaseException, message: str) -> Failure:
        self.ended = True
        self.pulled = _NOTHING
        self.sender.send_error(message, stamp=self.stamp)
        return Failure(error)

    def close(self) -> None:
        if self.ended or self.role.group.lane.broken is not None:
            return  # every rank saw the same END or ERROR frame; or every rank fails anyway
        self.ended = True
        self.sender.send_close(stamp=self.stamp)


class ReceiverSteps(Steps):
    """The steps of a pass on a receiver: receive a frame."""

    def __init__(self, role: Receiver, device: Any, index: int) -> None:
        super().__init__(role, device, index)
        self.receiver = role

    def step(self) -> Any:
        if self.ended:
            return END
        receiver = self.receiver
        started = time.perf_counter()
        try:
            value = receiver.recv(self.device, stamp=self.stamp)
        except SourceError as e:  # the source's ERROR frame
            value = Failure(e)
        if _interrupts.hook is not None:
            _interrupts.hook("step.took")
        if value is END or value is CLOSE or isinstance(value, Failure):
            self.ended = True
            if value is CLOSE:
                raise self._desync(
                    f"the source rank {receiver.src} closed the pass at step "
                    f"{self.stamp.step - 1}, and rank {receiver.rank} asked for that step: "
                    f"it went on past the batch the source stopped at"
                )
            return value
        # Until the frame's first message came, this rank waited for the source (its
        # next(source), its packing); the rest is the frame's own transfer.
        first, done = receiver.first_at, time.perf_counter()
        n = receiver.last_nbytes
        return Item(
            value, None, 0.0, first - started, done - first, n, n if receiver.last_shm else 0
        )

    def close(self) -> None:
        receiver = self.receiver
        if self.ended or receiver.group.lane.broken is not None:
            return  # every rank saw the same END or ERROR frame; or every rank fails anyway
        self.ended = True
        try:
            value = receiver.recv(self.device, stamp=self.stamp)
        except SourceError:
            what = "its ERROR frame"
        else:
            if value is CLOSE:
                return
            what = "its END frame" if value is END else "a batch"
        raise self._desync(
            f"rank {receiver.rank} closed the pass at step {self.stamp.step - 1}, but the "
            f"source rank {receiver.src} went on: it sent {what} there"
        )


def drawn_from(source: Any, iterator: Any) -> Any:
    """What a pass over ``source`` draws its batches from, given the ``iterator`` its
    ``iter(source)`` returned: a sampler of the source's that is its own iterator (a lhotse
    sampler under a ``DataLoader``: every iterator of the loader draws from it, and its
    ``iter()`` restarts it), else that iterator (the same object again where the source
    hands out one: a lhotse sampler itself, persistent workers, a generator)."""
    for name in ("batch_sampler", "sampler"):
        sampler = getattr(source, name, None)
        if sampler is not None and hasattr(type(sampler), "__next__"):
            return sampler
    return iterator


def steps_for(role: Role, device: Any, index: int, source: Any, depth: int) -> Steps:
    """The steps of pass ``index`` for this rank's ``role``."""
    if isinstance(role, Sender):
        return SourceSteps(role, device, index, source, depth)
    return ReceiverSteps(role, device, index)
