"""One pass of a loader, end to end, over the library's fake wire (``FakeWire.pair()``):
a ``Pass`` on each side, its steps (``loader.steps``) run on real lanes, the roles
(``Sender`` / ``Receiver``) sending and receiving real frames. No process group: the
source's messages wait in the fake wire until the receiver's pass reads them, so each
side's pass runs to its end on the test's thread, the source's first."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pass_pairs import Counter, batch, passes, roles
from trees import assert_same

from tensorcast import HeaderError
from tensorcast.loader.passes import Ledger, Pass
from tensorcast.loader.stats import Recorder
from tensorcast.transport.testing import FakeWire, fake_roles


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_every_batch_reaches_both_sides_then_both_stop(prefetch: int) -> None:
    source_pass, receiver_pass, ledger = passes(Counter(5), prefetch)
    sent = list(source_pass)
    got = list(receiver_pass)
    want = [batch(i) for i in range(5)]
    assert_same(sent, want, "the source's own trees")
    assert_same(got, want, "the receiver's")
    # exhausted, nothing drawn past it: the position is the source's own state, read when
    # asked (a set_epoch before the next pass is in it), at every prefetch
    assert ledger.state is None


def test_the_state_describes_the_last_batch_yielded_with_steps_prefetched() -> None:
    source_pass, _, ledger = passes(Counter(5), prefetch=2)
    assert next(source_pass)["i"] == 0
    assert ledger.state == {"pos": 1}, "two more pulled ahead, the state is after batch 0"
    assert next(source_pass)["i"] == 1
    assert ledger.state == {"pos": 2}


def test_a_batch_refused_on_one_rank_skips_no_post_its_peers_make() -> None:
    """``prefetch=2`` on a device wire, ``verify=True``, one payload corrupted on its way
    to the receiver: at every ``next()``, the refused one included, both ranks have posted
    the same payloads (this batch's and the next one's, NOTE [ Device work at next() ]),
    so the group's next payload pairs with the same one on every rank, whoever posts it."""
    sender, receiver = fake_roles(5, streams=True, idle_exit_s=0.2, verify=True)
    wires = [sender.group.wire, receiver.group.wire]

    def make(role: Any, source: Any) -> Pass:
        return Pass(
            role, 1, source=source, prefetch=2, device=None, ledger=Ledger(), stats=Recorder()
        )

    source_pass = make(sender, Counter(6))
    receiver_pass = make(receiver, None)

    def posted(wire: FakeWire) -> int:
        assert wire.streams is not None
        return sum(op == "payload" for op, _ in wire.streams.calls)

    source_posts = []
    for _ in source_pass:
        source_posts.append(posted(wires[0]))
    receiver_posts, refused = [], []
    for step in range(6):
        if step == 2:
            wires[1].corrupt_next_payload = True  # step 3's, posted ahead at this next()
        try:
            assert next(receiver_pass)["i"] == step
        except HeaderError:
            refused.append(step)
        receiver_posts.append(posted(wires[1]))
    assert refused == [3]
    assert receiver_posts == source_posts == [2, 3, 4, 5, 6, 6]
    with pytest.raises(StopIteration):
        next(receiver_pass)
    assert receiver.group.lane.broken is None


def _make(role: Any, source: Any, prefetch: int, index: int, ledger: Ledger | None = None) -> Pass:
    return Pass(
        role, index, source=source, prefetch=prefetch, device=None, ledger=ledger or Ledger(),
        stats=Recorder(),
    )  # fmt: skip


@pytest.mark.parametrize("prefetch", [0, 2])
def test_passes_of_one_channel_interleave_each_numbered_alone(prefetch: int) -> None:
    """Two passes of one loader, their ``next()`` calls interleaved as ``zip(loader,
    loader)`` makes them, the same on both sides: each is whole (NOTE [ Where a pass
    ends ])."""
    sender, receiver = roles()
    sources = [Counter(4), Counter(4)]
    sent = [_make(sender, sources[k], prefetch, index=k + 1) for k in range(2)]
    got = [_make(receiver, None, prefetch, index=k + 1) for k in range(2)]
    for ends in (sent, got):  # the source's side first: its frames wait in the fake wire
        pairs = [(a["i"], b["i"]) for a, b in zip(*ends)]
        assert pairs == [(i, i) for i in range(4)]
    assert sender.group.lane.broken is None and receiver.group.lane.broken is None


def test_a_dropped_pass_queues_nothing_more_and_its_steps_still_run() -> None:
    """A pass dropped after a batch sends no CLOSE frame: its queued steps run on both
    sides (their batches dropped), and the next pass is whole."""
    sender, receiver = roles()
    for role, source in ((sender, Counter(8)), (receiver, None)):
        run = _make(role, source, 2, index=1)
        assert next(run)["i"] == 0
        del run  # steps 1 and 2 are queued
        assert [b["i"] for b in _make(role, [batch(i) for i in range(3)], 1, index=2)] == [0, 1, 2]
    assert receiver.group.lane.broken is None


def test_no_collection_queues_a_job_or_sends_a_frame() -> None:
    """Passes left after the same batches on both sides, kept in reference cycles, freed
    by the cyclic collector: no collection adds a job to a lane or a message to the wire
    (NOTE [ Where a pass ends ]: nothing is queued from a finaliser)."""
    sender, receiver = roles()
    lanes = [sender.group.lane, receiver.group.lane]
    log = sender.group.wire.log  # type: ignore[attr-defined]
    counts: list[tuple[str, tuple[int, ...], int]] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        counts.append((phase, tuple(lane.submitted for lane in lanes), len(log)))

    gc.collect()
    gc.disable()
    gc.callbacks.append(callback)
    try:
        for role, source in ((sender, Counter(100)), (receiver, None)):
            for k in range(6):
                run = _make(role, source, k % 3, index=k + 1)
                for _ in range(k % 2 + 1):
                    next(run)
                run.cycle = run  # type: ignore[attr-defined]  # only the collector frees it
                del run
        for lane in lanes:  # the steps the passes queued have run
            deadline = time.monotonic() + 10
            while not lane.idle():
                assert time.monotonic() < deadline
                time.sleep(0.01)
        before = (tuple(lane.submitted for lane in lanes), len(log))
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
        gc.enable()
    assert counts, "the collector ran"
    for start, stop in zip(counts[::2], counts[1::2]):
        assert start[0] == "start" and stop[0] == "stop"
        assert start[1:] == stop[1:], f"a collection queued a job or sent a frame: {counts}"
    assert (tuple(lane.submitted for lane in lanes), len(log)) == before
    # Each side queued exactly the steps its next() calls asked for: 1 or 2, plus prefetch.
    steps = sum(k % 2 + 1 + k % 3 for k in range(6))
    assert before[0] == (steps, steps)


def test_next_from_a_second_thread_while_one_is_inside_raises() -> None:
    """``next()`` while another thread is inside ``next()`` on the same iterator raises a
    RuntimeError naming the cause; the first call still hands out its batch, and nothing
    is skipped."""
    entered, release = threading.Event(), threading.Event()

    class Gated:
        def __iter__(self) -> Iterator[dict[str, Any]]:
            for i in range(3):
                if i == 1:
                    entered.set()
                    release.wait(10)
                yield batch(i)

    sender, _ = roles()
    run = _make(sender, Gated(), 0, index=1)
    assert next(run)["i"] == 0
    got: list[Any] = []
    first = threading.Thread(target=lambda: got.append(next(run)["i"]))
    first.start()
    assert entered.wait(10)
    with pytest.raises(RuntimeError, match="already running on it, in another thread"):
        next(run)
    with pytest.raises(RuntimeError, match="already running"):
        run.close()
    release.set()
    first.join(10)
    assert got == [1]
    assert [b["i"] for b in run] == [2]
