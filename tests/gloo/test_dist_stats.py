"""``loader.stats()`` and ``log_every`` on real gloo ranks, with a model's collectives.

A source that sleeps 20 ms per batch with ``prefetch=0`` stalls every rank about 20 ms a
step; with ``prefetch=2`` and a consumer that works 40 ms a step, the loading hides under
the step and the stall is near 0. Times on a shared host vary: the tests compare the two
cases (an ordering), and check the 20 ms only from below.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

import tensorcast as tc

TIMEOUT = 120.0
N = 8  # batches per pass
PULL, WORK = 0.02, 0.04


class Sleepy:
    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for i in range(self.n):
            time.sleep(self.delay)
            yield {"x": torch.full((256,), float(i)), "step": i}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _pass(rank: int, prefetch: int, work: float, log_every: int | None) -> dict[str, Any]:
    source = Sleepy(N, PULL) if rank == 0 else None
    loader = tc.BroadcastingDataLoader(
        source, group=dist.group.WORLD, src=0, prefetch=prefetch, log_every=log_every
    )
    seen = []
    for batch in loader:
        seen.append(batch["step"])
        time.sleep(work + 0.001 * rank)  # the step's compute, at rank-dependent moments
        grad = torch.ones(1)
        dist.all_reduce(grad)  # the model's own collective, on the world group
    s = loader.stats(last=4)
    return {
        "seen": seen,
        "steps": s.steps,
        "bytes": s.bytes,
        "stall": s.stall.median,
        "stall_max": s.stall.max,
        "source": s.source.median,
        "wait": s.wait_for_source.median,
        "transfer": s.transfer.median,
        "share": s.stall_share,
        "recent_steps": s.recent.steps if s.recent else -1,
        "recent_bytes": s.recent.bytes if s.recent else -1,
    }


def _stall_ranks(rank: int, world: int) -> dict[str, Any]:
    handler = Lines()
    logger = logging.getLogger("tensorcast")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        slow = _pass(rank, 0, 0.0, log_every=4)
        hidden = _pass(rank, 2, WORK, log_every=None)
    finally:
        logger.removeHandler(handler)
    return {"slow": slow, "hidden": hidden, "lines": handler.lines}


def test_stall_shows_the_source_and_hides_under_prefetch(pool2) -> None:
    results = pool2.run(_stall_ranks, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        slow, hidden = r["slow"], r["hidden"]
        for case in (slow, hidden):
            assert case["seen"] == list(range(N)), (rank, case)
            assert case["steps"] == N and case["recent_steps"] == 4
            assert case["bytes"] == N * 256 * 4 and case["recent_bytes"] * N == case["bytes"] * 4
        # about 20 ms a step without prefetch, on the source and on the receiver
        assert slow["stall"] >= 0.8 * PULL, (rank, slow)
        assert slow["share"] >= 0.5, (rank, slow)
        # near 0 with prefetch=2 under a 40 ms step: well under the source's 20 ms
        assert hidden["stall"] < slow["stall"] / 4, (rank, slow, hidden)
        assert hidden["share"] < slow["share"] / 4, (rank, slow, hidden)
    source = results[0]
    assert source["slow"]["source"] >= 0.8 * PULL and source["hidden"]["source"] >= 0.8 * PULL
    assert results[1]["slow"]["source"] == 0.0  # receivers do not call next(source)
    # A receiver's wait for the source's next(source) is its own field, not the transfer's:
    # a 1 kB batch takes about 20 ms to come, and a fraction of a millisecond to move.
    receiver = results[1]["slow"]
    assert receiver["wait"] >= 0.8 * PULL, receiver
    assert receiver["transfer"] < PULL / 4, receiver
    assert source["slow"]["wait"] == 0.0, source["slow"]  # the source waits for no one's batch
    assert results[0]["slow"]["bytes"] == results[1]["slow"]["bytes"]
    # log_every=4: two lines on the source rank, none on the receiver
    assert len(source["lines"]) == 2 and "step 4: data stall" in source["lines"][0]
    assert results[1]["lines"] == []
