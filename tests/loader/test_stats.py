"""``loader.stats()`` without a process group: the recorder's laws, and a no-op loader's pass.

The multi-process behaviour (stalls with and without prefetch, on real gloo ranks) is in
``test_dist_stats.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorcast as tc
from tensorcast.loader.stats import Recorder


class Sleepy:
    """A source that takes ``delay`` seconds per batch, with a length."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for i in range(self.n):
            time.sleep(self.delay)
            yield {"x": torch.full((4,), float(i))}


def test_stats_is_a_frozen_dataclass_of_zeros_before_a_pass() -> None:
    stats = tc.BroadcastingDataLoader([]).stats()
    assert isinstance(stats, tc.LoaderStats)
    assert stats.steps == 0 and stats.bytes == 0 and stats.stall == tc.Timings()
    assert stats.recent is not None and stats.recent.steps == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.steps = 3  # type: ignore[misc]


def test_a_no_op_loader_counts_its_source_as_the_stall() -> None:
    loader = tc.BroadcastingDataLoader(Sleepy(5, 0.01))
    batches = list(loader)
    stats = loader.stats(last=3)
    assert len(batches) == 5 and batches[4]["x"][0] == 4.0
    assert stats.steps == 5 and stats.recent is not None and stats.recent.steps == 3
    assert stats.stall.median >= 0.009 and stats.source.median >= 0.009
    assert stats.stall.max >= stats.stall.p90 >= stats.stall.median > 0
    assert 0.9 <= stats.stall_share <= 1.0  # the loop does nothing but wait


def test_a_new_pass_starts_new_stats() -> None:
    loader = tc.BroadcastingDataLoader(Sleepy(3, 0.0))
    list(loader)
    it = iter(loader)
    next(it)
    assert loader.stats().steps == 1


@pytest.mark.parametrize("last", [0, 1001, 2.0, None])
def test_last_out_of_range_is_a_value_error(last: object) -> None:
    with pytest.raises(ValueError, match="last must be an int from 1 to 1000"):
        tc.BroadcastingDataLoader([]).stats(last=last)  # type: ignore[arg-type]


@pytest.mark.parametrize("log_every", [0, -1, 1.5, "2"])
def test_log_every_must_be_a_positive_int(log_every: object) -> None:
    with pytest.raises(ValueError, match="log_every must be an int >= 1"):
        tc.BroadcastingDataLoader([], log_every=log_every)  # type: ignore[arg-type]


def test_log_every_logs_every_k_steps(caplog: pytest.LogCaptureFixture) -> None:
    loader = tc.BroadcastingDataLoader(Sleepy(7, 0.0), log_every=3)
    with caplog.at_level(logging.INFO, logger="tensorcast"):
        list(loader)
    lines = [r.getMessage() for r in caplog.records if r.name == "tensorcast"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("loader step 3: data stall")
    assert "last 3 steps" in lines[1]


# The law: the pass's median and p90 come from 2%-wide bins: each is within 2% of the
# sample of rank ceil(q * n), over more steps than the window keeps too; its max, total
# and count are exact, and ``recent`` is exact over the last steps.
@settings(deadline=None, print_blob=True, max_examples=25)
@given(st.lists(st.floats(min_value=1e-5, max_value=10.0), min_size=1, max_size=2500))
def test_pass_quantiles_are_within_two_percent(stalls: list[float]) -> None:
    recorder = Recorder()
    now = 0.0
    for s in stalls:
        recorder.handed_out(now, now=now + s)  # a next() that waited s, right after the last
        now += s
    stats = recorder.stats(last=10)
    exact = np.asarray(stalls)
    ordered = np.sort(exact)
    assert stats.steps == len(stalls)
    assert stats.stall.max == pytest.approx(exact.max())  # (now + s) - now, in floats
    assert stats.stall.total == pytest.approx(exact.sum())
    for got, q in ((stats.stall.median, 0.5), (stats.stall.p90, 0.9)):
        want = ordered[max(math.ceil(q * len(stalls)), 1) - 1]
        assert abs(got - want) <= 0.021 * want, (got, want)
    assert stats.recent is not None and stats.recent.steps == min(10, len(stalls))
    assert stats.recent.stall.max == pytest.approx(exact[-10:].max())
    assert stats.stall_share == pytest.approx(1.0)  # every step was all stall
