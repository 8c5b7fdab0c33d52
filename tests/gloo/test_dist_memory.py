"""Memory handed out is the caller's (``../shared/CONTRACT.md`` section 2), on real gloo
groups: batches the caller shares with another process are never written again, and what
a rank keeps for reuse stays bounded when every batch has another shape.

The laws::

    a batch put on a torch.multiprocessing queue (share_memory_() moves its storage)
    and dropped: the consumer sees that batch's values, the rank's heap stays sane
    RSS after k more batches of new shapes - RSS before  <  a few batches' bytes
"""

from __future__ import annotations

import gc
import multiprocessing as mp
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import tensorcast as tc

pytestmark = pytest.mark.dist
TIMEOUT = 60.0
STEPS = 6
ROWS, SAMPLES = 8, 120_000  # 3.8 MB of audio a batch, half of it padding: trimmed


def _batch(step: int, samples: int = SAMPLES) -> dict[str, Any]:
    """A batch whose every value says its step: a trimmed leaf, a pooled leaf of its own
    payload buffer, and a small one that travels inline in the first message."""
    audio = torch.full((ROWS, samples), float(step + 1))
    audio[1:, samples // 2 :] = 0.0
    return {
        "audio": audio,
        "tokens": torch.full((300_000,), step + 1, dtype=torch.int64),
        "ids": torch.full((16,), step + 1, dtype=torch.int32),
    }


def _digest(tree: dict[str, Any]) -> list[float]:
    return [float(tree[k].double().sum()) for k in ("audio", "tokens", "ids")]


def _consume(batches: Any, results: Any) -> None:
    """Hold every batch, then say what each holds: a batch reused under a consumer shows
    a later batch's values."""
    held = []
    while (tree := batches.get(timeout=TIMEOUT)) is not None:
        held.append(tree)
    results.put([_digest(tree) for tree in held])


def _queued(rank: int, world: int) -> list[list[float]]:
    # A rank is a daemon process, which multiprocessing lets have no children; forking one
    # by hand could deadlock on a lock a thread of the rank held. The consumer is spawned.
    me = mp.current_process()
    daemon = me._config.get("daemon")
    me._config["daemon"] = False
    ctx = tmp.get_context("spawn")
    batches, results = ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=_consume, args=(batches, results))
    try:
        consumer.start()
    finally:
        me._config["daemon"] = daemon
    try:
        for trim in (True, False):
            for step in range(STEPS):
                got = tc.broadcast(_batch(step) if rank == 0 else None, 0, trim=trim)
                batches.put(got)  # shares every tensor's storage: share_memory_() moves it
                del got
                gc.collect()
        batches.put(None)
        seen = results.get(timeout=TIMEOUT)
    finally:
        consumer.join(TIMEOUT)
        if consumer.is_alive():
            consumer.kill()
    dist.barrier()
    return seen


def test_batches_queued_to_another_process_keep_their_values(pool2: Any) -> None:
    """Source and receiver, trimmed and not: every batch a consumer process holds has its
    own values (not a later batch's), and the ranks neither crash nor desync."""
    want = [_digest(_batch(step)) for step in range(STEPS)] * 2
    for seen in pool2.run(_queued, timeout=TIMEOUT):
        assert seen == want


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _shapes_change(rank: int, world: int, steps: int, trim: bool) -> tuple[int, int]:
    """RSS growth over the second half of ``steps`` batches whose shapes all differ."""
    half = steps // 2
    before = 0
    for step in range(steps):
        batch = _batch(step, SAMPLES + 37 * step) if rank == 0 else None
        got = tc.broadcast(batch, 0, trim=trim)
        assert got["audio"].shape == (ROWS, SAMPLES + 37 * step)
        del got, batch
        if step == half:
            gc.collect()
            before = _rss()
    gc.collect()
    dist.barrier()
    return _rss() - before, 4 * ROWS * SAMPLES


def test_memory_kept_stays_bounded_when_every_batch_has_another_shape(pool2: Any) -> None:
    """Every batch has a shape of its own: trimmed leaves are rebuilt into memory taken
    by size, so the kept memory stops growing after the first batches."""
    for growth, batch_bytes in pool2.run(_shapes_change, 40, True, timeout=TIMEOUT):
        assert growth < 3 * batch_bytes, (growth, batch_bytes)
