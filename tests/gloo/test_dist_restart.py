"""A new epoch after a ``break``: the old pass's queued steps never draw the new one's batches.

The source NeMo and lhotse recipes build, ``DataLoader(dataset, sampler=<lhotse sampler>,
batch_size=None)``, restarts its sampler at every ``iter()`` (lhotse's ``__iter__`` resets
the sampler and returns it), and a ``DataLoader`` with persistent workers resets its one
iterator: steps that a dropped pass queued and that still run would draw (and drop) the
new epoch's first batches, or trip torch's ``Invalid iterator state``. Every epoch here is
broken after k batches (as ``limit_train_batches`` does), then run in full, on every rank.
``benchmarks/restart_epochs.py`` runs the persistent-worker case many times.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from cuts import memory_cut
from lhotse import CutSet
from lhotse.dataset import SimpleCutSampler
from rankpool import RankPool, may_start_workers
from torch.utils.data import DataLoader, Dataset

import tensorcast as tc

TIMEOUT = 120.0
CUTS = 12  # 6 batches of 2 cuts
#: how each epoch ends: after k batches (a break), or None (a full epoch)
SCHEDULE = (1, None, 2, None, 3, None)


class CutIds(Dataset[Any]):
    """A lhotse-style dataset: the sampler hands it a CutSet, it returns the batch."""

    def __getitem__(self, cuts: CutSet) -> dict[str, Any]:
        return {"ids": [c.id for c in cuts]}


def source(workers: int) -> DataLoader[Any]:
    cuts = CutSet([memory_cut(i, 0.1) for i in range(CUTS)])
    sampler = SimpleCutSampler(cuts, max_cuts=2, shuffle=False, world_size=1, rank=0)
    extra: dict[str, Any] = {}
    if workers:  # fork: spawned workers would import torch again, seconds each here
        extra = {"persistent_workers": True, "multiprocessing_context": "fork"}
    return DataLoader(CutIds(), sampler=sampler, batch_size=None, num_workers=workers, **extra)


def epochs(rank: int, world: int, prefetches: list[int], workers: int) -> dict[int, Any]:
    """Per prefetch, the cut ids each epoch of SCHEDULE yielded on this rank."""
    group = dist.new_group([0, 1])
    out: dict[int, Any] = {}
    with may_start_workers():
        for prefetch in prefetches:
            loader = tc.BroadcastingDataLoader(
                source=source(workers) if rank == 0 else None,
                group=group,
                src=0,
                prefetch=prefetch,
                timeout=30.0,
            )
            seen = []
            for stop in SCHEDULE:
                ids: list[str] = []
                for i, batch in enumerate(loader):
                    ids += batch["ids"]
                    if stop is not None and i + 1 == stop:
                        break
                seen.append(ids)
            out[prefetch] = seen
            del loader  # persistent workers end with their DataLoader
    return out


def check(results: list[dict[int, Any]]) -> None:
    full = [memory_cut(i, 0.1).id for i in range(CUTS)]
    for rank, by_prefetch in enumerate(results):
        for prefetch, seen in by_prefetch.items():
            for stop, ids in zip(SCHEDULE, seen):
                want = full if stop is None else full[: 2 * stop]
                assert ids == want, (rank, prefetch, stop)


def test_a_lhotse_sampler_restarted_after_a_break_loses_no_batch(pool2: RankPool) -> None:
    """prefetch 0-3: every epoch yields every cut once, on every rank."""
    check(pool2.run(epochs, [0, 1, 2, 3], 0, timeout=TIMEOUT))


def test_persistent_workers_restarted_after_a_break(pool2: RankPool) -> None:
    """A DataLoader with persistent workers resets its one iterator at iter(): the old
    pass's steps are done by then (no ``Invalid iterator state``, no cut lost)."""
    check(pool2.run(epochs, [1, 3], 2, timeout=TIMEOUT))
