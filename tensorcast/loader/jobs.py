"""The jobs of a pass: what each step runs on the lane, and what it hands back.

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
the consumer as it is.

# NOTE [ An early close ]
A pass left before its end (a ``for ... break``) runs one more job on every rank, after
the steps it owes: the source sends a CLOSE frame stamped with its step, and each
receiver expects exactly that frame at its own next step. Ranks that broke out of the
loop after the same batch agree on it. A receiver that asked for more steps than the
source sent is handed the CLOSE frame by a step and raises ``DesyncError`` at once (it
waits for nothing); one that stopped earlier than the source is handed a batch (or the
END) where the CLOSE was due. Either breaks the lane, whose group is aborted, so a
source still sending fails at once and one that left fails at its next use.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

from tensorcast._errors import DesyncError, SourceError
from tensorcast.transport import interrupts as _interrupts
from tensorcast.transport.channel import Channel
from tensorcast.transport.frame import Kind

__all__ = ["END", "End", "Failure", "Item", "Steps", "stateful"]

_FIX = (
    "break on every rank after the same batch (decide the break together, e.g. with an "
    "all_reduce of a stop flag)"
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


class End:
    """The source is exhausted."""


END = End()
_NOTHING = object()  # no batch pulled and kept


class Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Item:
    """A step's batch (this rank's tree), the source's state after it, and what the step
    spent, recorded as the batch is handed out (NOTE [ Where a step's time goes ])."""

    __slots__ = ("nbytes", "source_s", "state", "tree", "wire_s")

    def __init__(self, tree: Any, state: Any, source_s: float, wire_s: float, nbytes: int) -> None:
        self.tree = tree
        self.state = state
        self.source_s = source_s
        self.wire_s = wire_s
        self.nbytes = nbytes


class Steps:
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
        # A batch pulled whose frame an interrupt kept from going out: the next step sends
        # it (NOTE [ Interrupts ], ``step.pulled``).
        self.pulled: Any = _NOTHING

    def source(self) -> Any:
        channel = self.channel
        if self.ended:
            return END
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
                return END
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
        started = time.perf_counter()
        channel.send(frame)  # a failure in it breaks the lane
        self.pulled = _NOTHING
        if _interrupts.hook is not None:
            _interrupts.hook("step.took")
        return Item(own, state, pulled, time.perf_counter() - started, frame.plan.payload_len)

    def _fail(self, error: BaseException, message: str) -> Failure:
        self.ended = True
        self.pulled = _NOTHING
        self.channel.send_error(message)
        return Failure(error)

    def receiver(self) -> Any:
        if self.ended:
            return END
        started = time.perf_counter()
        kind, value = self.channel.recv(self.device)
        if _interrupts.hook is not None:
            _interrupts.hook("step.took")
        if kind == Kind.DATA:
            return Item(
                value, None, 0.0, time.perf_counter() - started, self.channel.received_nbytes
            )
        self.ended = True
        if kind == Kind.CLOSE:
            channel = self.channel
            raise self._desync(
                f"the source rank {channel.src} broke out of its loop and closed the pass "
                f"at step {channel.step - 1}, and rank {channel.rank} asked for that step: "
                f"it went on past the batch the source stopped at"
            )
        if kind == Kind.END:
            return END
        return Failure(SourceError(f"source rank {self.channel.src} reported: {value}"))

    def close(self) -> None:
        """A pass left early: the CLOSE frame, sent or expected (NOTE [ An early close ])."""
        channel = self.channel
        if self.ended or channel.group.lane.broken is not None:
            return  # every rank saw the same END or ERROR frame; or every rank fails anyway
        self.ended = True
        if channel.is_source:
            channel.send_close()
            return
        kind, _ = channel.recv(self.device)
        if kind != Kind.CLOSE:
            what = "a batch" if kind == Kind.DATA else f"its {kind.name} frame"
            raise self._desync(
                f"rank {channel.rank} broke out of its loop and closed the pass at step "
                f"{channel.step - 1}, but the source rank {channel.src} went on: it sent "
                f"{what} there"
            )

    def _desync(self, what: str) -> DesyncError:
        """The ranks left a pass after different batches: the lane breaks on every rank."""
        channel = self.channel
        error = DesyncError(
            f"ranks {list(channel.ranks)}, pass {channel.pass_index}: {what}. The ranks left "
            f"the pass (broke out of the loop, or called iter(loader) again) after different "
            f"batches; {_FIX}"
        )
        channel.group.lane.break_(error)
        return error
