"""The device path end to end on real gloo ranks: every wire wrapped in a ``DeviceTap``.

A ``DeviceTap`` makes a group's payloads travel as NCCL payloads do (posted by the
caller's thread at ``next()`` / ``broadcast()``, inside tensorcast's transfer stream) and
records the thread of every device call. With a model's collectives between steps at
rank-dependent moments, the law: every batch arrives whole, every device call is made by
the training thread (none by a lane's worker), every payload inside the transfer stream,
and with ``prefetch >= 2`` the next batch's payload is posted before the step runs.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rankpool import RankPool, in_a_new_process_group

import tensorcast as tc
from tensorcast.transport import groups as _groups
from tensorcast.transport.testing import DeviceTap

TIMEOUT = 60.0
STEPS = 6


def _batch(step: int) -> dict[str, Any]:
    return {
        "audio": torch.full((4, 20_000), float(step)),
        "lens": torch.arange(4) + step,
        "ids": [f"cut-{step}-{i}" for i in range(4)],
        "step": step,
    }


class _Source:
    def __len__(self) -> int:
        return STEPS

    def __iter__(self):
        for step in range(STEPS):
            time.sleep(0.005)
            yield _batch(step)


@in_a_new_process_group
def _loader_on_device_wires(rank: int, world: int, prefetch: int) -> dict[str, Any]:
    taps: list[DeviceTap] = []

    def tap(wire: Any) -> DeviceTap:
        taps.append(DeviceTap(wire))
        return taps[-1]

    main = threading.current_thread().name
    with _groups.wrapping_wires(tap):
        loader = tc.BroadcastingDataLoader(
            _Source() if rank == 0 else None,
            group=dist.group.WORLD,
            src=0,
            prefetch=prefetch,
            timeout=TIMEOUT,
        )
        posted_before_step = []
        steps = []
        for batch in loader:
            (tap_,) = taps
            posted_before_step.append(sum(op == "payload" for op, _ in tap_.streams.calls))
            steps.append(batch["step"])
            assert torch.equal(batch["audio"], _batch(batch["step"])["audio"])
            assert batch["ids"] == _batch(batch["step"])["ids"]
            time.sleep(0.002 * rank)  # the step's compute, at a rank-dependent moment
            grad = torch.ones(8) * rank
            dist.all_reduce(grad)  # the model's own collective, between two next()
        own = tc.broadcast({"x": torch.arange(5000.0) + rank} if rank == 0 else None, src=0)
    (tap_,) = taps
    threads = {
        op: sorted(tap_.streams.threads(op))
        for op in ("payload", "transfer", "empty", "wait", "hand_over", "done")
    }
    return {
        "steps": steps,
        "own": own["x"][:3].tolist(),
        "threads": threads,
        "main": main,
        "strays": tap_.strays,
        "posted": posted_before_step,
    }


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_device_work_is_posted_by_the_training_thread(pool4: RankPool, prefetch: int) -> None:
    results = pool4.run(_loader_on_device_wires, prefetch, timeout=TIMEOUT + 60)
    for rank, got in enumerate(results):
        assert got["steps"] == list(range(STEPS)), rank
        assert got["own"] == [0.0, 1.0, 2.0]
        assert got["strays"] == 0
        for op, threads in got["threads"].items():
            assert threads in ([], [got["main"]]), (rank, op, threads)
        assert got["threads"]["payload"] == [got["main"]]
        if prefetch >= 2:
            # at each hand-out, this batch's payload and the next one's are posted already
            assert got["posted"] == [min(i + 2, STEPS) for i in range(STEPS)], got["posted"]
        else:
            assert got["posted"] == [i + 1 for i in range(STEPS)], got["posted"]
