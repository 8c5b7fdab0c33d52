"""One pass of a loader, end to end, over the library's fake wire (``FakeWire.pair()``):
a ``Pass`` on each side, its steps (``loader.steps``) run on real lanes, the roles
(``Sender`` / ``Receiver``) sending and receiving real frames. No process group: the
source's messages wait in the fake wire until the receiver's pass reads them, so each
side's pass runs to its end on the test's thread, the source's first."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from trees import assert_same

from tensorcast import DesyncError, SourceError
from tensorcast.loader.passes import Ledger, Pass
from tensorcast.loader.stats import Recorder
from tensorcast.transport.groups import Group
from tensorcast.transport.lane import Lane
from tensorcast.transport.receiver import Receiver
from tensorcast.transport.sender import Sender
from tensorcast.transport.testing import FakeWire


def batch(i: int) -> dict[str, Any]:
    return {"x": torch.arange(6.0) + i, "audio": torch.full((70_000,), float(i)), "i": i}


class Counter:
    """A resumable source of ``n`` batches that fails at ``fail_at`` (if given)."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at, self.pos = n, fail_at, 0
        self.error = ValueError("shard 3 is corrupt")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.pos < self.n:
            if self.pos == self.fail_at:
                raise self.error
            self.pos += 1
            yield batch(self.pos - 1)

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}


def roles() -> tuple[Sender, Receiver]:
    wires = FakeWire.pair()
    groups = [Group((0, 1), w, Lane(f"pass{w.rank}", w.abort, idle_exit_s=0.2)) for w in wires]
    return Sender(groups[0], 0, 5), Receiver(groups[1], 0, rank=1, channel_id=5)


def passes(source: Any, prefetch: int, index: int = 1) -> tuple[Pass, Pass, Ledger]:
    sender, receiver = roles()
    ledger = Ledger()

    def make(role: Any, source: Any, ledger: Ledger) -> Pass:
        return Pass(
            role, index, source=source, prefetch=prefetch, device=None, ledger=ledger,
            stats=Recorder(),
        )  # fmt: skip

    return make(sender, source, ledger), make(receiver, None, Ledger()), ledger


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_every_batch_reaches_both_sides_then_both_stop(prefetch: int) -> None:
    source_pass, receiver_pass, ledger = passes(Counter(5), prefetch)
    sent = list(source_pass)
    got = list(receiver_pass)
    want = [batch(i) for i in range(5)]
    assert_same(sent, want, "the source's own trees")
    assert_same(got, want, "the receiver's")
    if prefetch:  # the state after the last batch handed out, not after the prefetched ones
        assert ledger.state == {"pos": 5}
    else:
        assert ledger.state is None


def test_the_state_describes_the_last_batch_yielded_with_steps_prefetched() -> None:
    source_pass, _, ledger = passes(Counter(5), prefetch=2)
    assert next(source_pass)["i"] == 0
    assert ledger.state == {"pos": 1}, "two more pulled ahead, the state is after batch 0"
    assert next(source_pass)["i"] == 1
    assert ledger.state == {"pos": 2}


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_failing_source_is_raised_there_and_a_source_error_elsewhere(prefetch: int) -> None:
    source = Counter(5, fail_at=2)
    source_pass, receiver_pass, _ = passes(source, prefetch)
    assert [b["i"] for b in (next(source_pass), next(source_pass))] == [0, 1]
    with pytest.raises(ValueError) as raised:
        next(source_pass)
    assert raised.value is source.error, "the very exception object"
    assert [b["i"] for b in (next(receiver_pass), next(receiver_pass))] == [0, 1]
    with pytest.raises(SourceError, match="source iterator failed: ValueError: shard 3"):
        next(receiver_pass)
    with pytest.raises(StopIteration):
        next(receiver_pass)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_pass_left_after_the_same_batch_closes_on_both_sides(prefetch: int) -> None:
    source_pass, receiver_pass, _ = passes(Counter(8), prefetch)
    assert next(source_pass)["i"] == 0
    source_pass.close()
    assert next(receiver_pass)["i"] == 0
    receiver_pass.close()  # expects the CLOSE frame after the steps it owes
    assert receiver_pass._lane.broken is None and source_pass._lane.broken is None


def test_a_receiver_that_goes_on_past_the_source_s_close_is_a_desync() -> None:
    source_pass, receiver_pass, _ = passes(Counter(8), prefetch=0)
    assert next(source_pass)["i"] == 0
    source_pass.close()
    assert next(receiver_pass)["i"] == 0
    with pytest.raises(DesyncError, match="broke out of its loop and closed the pass at step 1"):
        next(receiver_pass)
    assert receiver_pass._lane.broken is not None, "the lane breaks on a desync"
