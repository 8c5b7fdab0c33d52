"""The source's heartbeat, in one process.

The heartbeat writes to a store the test hands it (a counting wrapper around a real
``HashStore``). Rates are checked on the pure ``Schedule`` with simulated time, and once
on the real thread. What a receiver says of it: ``test_diagnosis``.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from stalls import hold_gil

from tensorcast.transport.liveness import SLOW_MAX_S, Beat, Heartbeat, Schedule


class Counting:
    """A store that counts the writes made through it."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.sets = 0

    def set(self, key: str, value: str) -> None:
        self.sets += 1
        self.store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def simulate(timeout_s: float, states: list[float], seconds: float) -> list[float]:
    """When the heartbeat of a source writes, over ``seconds``, waking every fast period;
    ``states``: how long each state (inside or outside next(source)) lasts, cycled."""
    schedule = Schedule(timeout_s)
    writes = [0.0]
    now, since, k = 0.0, 0.0, 0
    while now < seconds:
        now += schedule.fast
        while now - since >= states[k % len(states)]:
            since += states[k % len(states)]
            k += 1
        if schedule.due(now, writes[-1], since, held=False):
            writes.append(now)
    return writes


@settings(deadline=None, print_blob=True)
@given(
    timeout_s=st.floats(0.5, 7200.0),
    states=st.lists(st.floats(0.001, 3600.0), min_size=1, max_size=5),
)
def test_writes_are_slow_when_healthy_and_never_far_apart(
    timeout_s: float, states: list[float]
) -> None:
    """Law: two writes are never further apart than the slow period (and a wake); when
    every state is shorter than ``timeout / 8``, writes come at most once per slow period
    (and a wake); once one state has lasted ``timeout / 8``, at least once a fast period."""
    schedule = Schedule(timeout_s)
    seconds = 10 * schedule.slow
    writes = simulate(timeout_s, states, seconds)
    gaps = [b - a for a, b in itertools.pairwise(writes)]
    assert max(gaps) <= schedule.slow + schedule.fast + 1e-9
    if max(states) < schedule.long - schedule.fast:
        assert min(gaps) >= schedule.slow - schedule.fast - 1e-9, gaps
    if len(states) == 1 and states[0] >= seconds:  # one state, for the whole run
        late = [
            g for w, g in zip(writes[1:], gaps, strict=True) if w > schedule.long + schedule.fast
        ]
        assert all(g <= schedule.fast + 1e-9 for g in late), late


def test_a_healthy_source_at_the_default_timeout_writes_every_30_s() -> None:
    """The figure docs/design.md gives for 16,384 ranks: one write per source per 30 s."""
    schedule = Schedule(1800.0)
    assert (schedule.fast, schedule.slow, schedule.long) == (1.0, SLOW_MAX_S, 225.0)
    writes = simulate(1800.0, [0.3, 0.7], 3600.0)  # 1 s steps, 30% in next(source)
    assert 110 <= len(writes) <= 121, len(writes)  # today's heartbeat: 3,600
    assert simulate(2.0, [0.3, 0.7], 60.0)[1] == pytest.approx(0.25)  # short timeouts


@settings(deadline=None, print_blob=True)
@given(
    beats=st.integers(1, 2**40),
    period=st.sampled_from([0.1, 0.25, 1.0, 30.0]),
    inside=st.booleans(),
    age=st.floats(0, 1e6).map(lambda x: round(x, 1)),
    channel=st.integers(0, 2**64 - 1),
    what=st.text(st.characters(codec="ascii", exclude_characters="\n"), min_size=1),
)
def test_a_beat_reads_back_as_written(
    beats: int, period: float, inside: bool, age: float, channel: int, what: str
) -> None:
    """Law: ``Beat.decode(b.encode()) == b`` (ages to a tenth of a second)."""
    beat = Beat(beats, period, inside, age, 1.5, 0.3, inside, channel, what)
    assert Beat.decode(beat.encode()) == beat


def test_the_thread_writes_once_while_the_source_steps_quickly() -> None:
    """On the real thread at a 600 s timeout (1 s wakes, 10 s slow period): a source
    stepping every 20 ms makes one write in 3 s, where the heartbeat of 0.2.0 made three.
    A second is allowed: a wake held up by two fast periods on a loaded machine writes at
    once (the rule ``Schedule`` is tested for, in simulated time, above)."""
    store = Counting(dist.HashStore())
    heartbeat = Heartbeat(store, 0, 600.0, lambda: True)
    mark = heartbeat.busy("next(source)", 7)
    heartbeat.start(600.0)
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        with mark:
            time.sleep(0.005)
        time.sleep(0.015)
    assert 1 <= store.sets <= 2, store.sets


def test_a_long_state_beats_fast_and_a_held_gil_is_reported() -> None:
    """At a 2 s timeout the thread writes every 0.25 s; one call that holds the GIL for
    about 3 s inside next(source) shows in the next beat, once the GIL is let go (a hold
    of 1 s counts: 3 s leaves room for a machine whose load changes under the timing)."""
    store = Counting(dist.HashStore())
    heartbeat = Heartbeat(store, 3, 2.0, lambda: True)
    mark = heartbeat.busy("next(source)", 5)
    heartbeat.start(2.0)
    with mark:
        time.sleep(1.0)
        fast_writes = store.sets
        hold_gil(3.0)
        # The next beat says so; on a loaded machine the thread may take a while to run.
        deadline = time.monotonic() + 5.0
        beat = Beat.decode(store.get("alive/3").decode())
        while beat.held < 1.0 and time.monotonic() < deadline:
            time.sleep(0.05)
            beat = Beat.decode(store.get("alive/3").decode())
    assert fast_writes >= 3, fast_writes
    assert beat.held >= 1.0 and beat.held_inside, beat
    assert beat.inside and beat.channel == 5 and beat.what == "next(source)", beat
