"""Checkpoints, lengths, samplers and epochs of BroadcastingDataLoader, through the public API.

The resume test is torchdata's ``_run_and_checkpoint``: run k steps, save, restore into
FRESH loaders on every rank (new DataLoader, new lhotse sampler, new BroadcastingDataLoader),
run to the end; the two halves equal one uninterrupted epoch on every rank. Each rank
function checks several things, so the pool calls (and group set-ups) stay few.
"""

from __future__ import annotations

import io
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cuts import memory_cut
from lhotse import CutSet
from lhotse.cut import Cut
from lhotse.dataset import DynamicBucketingSampler
from lhotse.lazy import LazyMapper
from rankpool import RankPool
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import tensorcast as tc

TIMEOUT = 120.0
TP = ("tp",)


def _cut(i: int) -> Cut:
    return memory_cut(i, 0.2 + 0.05 * (i % 9))


class CutIds(Dataset[list[str]]):
    """A lhotse-style dataset: a mini-batch of cuts to their ids."""

    def __getitem__(self, cuts: CutSet) -> list[str]:
        return [cut.id for cut in cuts]


def _mesh() -> Any:
    return init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))


def _lhotse_loader(mesh: Any, prefetch: int) -> tc.BroadcastingDataLoader:
    source = None
    if tc.is_dp_source_rank(mesh, TP):
        sampler = DynamicBucketingSampler(
            CutSet(LazyMapper(range(24), _cut)),
            max_duration=1.0,
            num_buckets=2,
            shuffle=True,
            seed=3,
            world_size=1,
            rank=0,
        )
        source = DataLoader(CutIds(), sampler=sampler, batch_size=None, num_workers=0)
    return tc.BroadcastingDataLoader(source, device_mesh=mesh, axes=TP, prefetch=prefetch)


def _save(state: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    torch.save(state, out)
    return out.getvalue()


def _load(checkpoint: bytes) -> dict[str, Any]:
    return torch.load(io.BytesIO(checkpoint), weights_only=True)  # type: ignore[no-any-return]


def _resume(rank: int, world: int, stop_after: int) -> dict[int, dict[str, Any]]:
    mesh = _mesh()
    results = {}
    for prefetch in (0, 2):
        whole = _lhotse_loader(mesh, prefetch)
        whole.set_epoch(1)
        epoch = list(whole)
        first = _lhotse_loader(mesh, prefetch)
        first.set_epoch(1)
        head = []
        for batch in first:
            head.append(batch)
            if len(head) == stop_after:
                break  # every rank, after the same batch
        checkpoint = _save(first.state_dict())  # a file per rank in a real job
        kept = iter(first)  # a framework makes the next pass's iterator, then saves
        if first.sampler is not None and prefetch:  # the dropped pass's steps drew ahead:
            deadline = time.monotonic() + 30  # the sampler's own state moved past the save
            while first.sampler.state_dict() == _load(checkpoint):
                assert time.monotonic() < deadline, "the dropped pass's steps never ran"
                time.sleep(0.01)
        again = _load(_save(first.state_dict()))
        del kept
        restored = _lhotse_loader(mesh, prefetch)  # as after a restart: nothing reused
        restored.load_state_dict(_load(checkpoint))
        results[prefetch] = {
            "whole": epoch,
            "head": head,
            "tail": list(restored),
            "state": _load(checkpoint),
            "state after iter()": again,
        }
    return results


def test_resume_from_a_fresh_loader_equals_one_uninterrupted_epoch(pool2: RankPool) -> None:
    """Contract 3.8 and 3.10: a plain DataLoader over a lhotse sampler, its state the
    sampler's; prefetch 0 and 2 resume after the last batch yielded, on every rank."""
    stop_after = 3
    results = pool2.run(_resume, stop_after, timeout=TIMEOUT)
    for prefetch in (0, 2):
        source, receiver = (r[prefetch] for r in results)
        whole = source["whole"]
        cut_ids = [i for batch in whole for i in batch]
        assert len(whole) > stop_after + 1 and len(cut_ids) == len(set(cut_ids)) == 24
        assert source["state"]["epoch"] == 1 and receiver["state"] == {}
        # iter() before the save moves nothing: the state is still after the last batch yielded
        assert source["state after iter()"] == source["state"], f"prefetch={prefetch}"
        for r in (source, receiver):
            assert r["whole"] == whole, f"prefetch={prefetch}: ranks saw different epochs"
            assert len(r["head"]) == stop_after
            assert r["head"] + r["tail"] == whole, f"prefetch={prefetch}: resume not exact"
    assert results[0][0]["whole"] == results[0][2]["whole"]  # same seed and epoch: same order


# -- len, sampler, batch_sampler, set_epoch, and a source with no state ----------------------


class Numbers(Dataset[int]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        return i


class Unsized:
    """An iterable without ``__len__`` and without any state."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.tensor([i]) for i in range(3))


def _api(rank: int, world: int) -> dict[str, Any]:
    mesh = _mesh()
    is_source = tc.is_dp_source_rank(mesh, TP)
    out: dict[str, Any] = {}

    # A DataLoader over a DistributedSampler: len, sampler, batch_sampler, set_epoch.
    ds = Numbers()
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    source = DataLoader(ds, batch_size=4, sampler=sampler)
    loader = tc.BroadcastingDataLoader(source if is_source else None, device_mesh=mesh, axes=TP)
    out["len"] = len(loader)
    out["sampler is the source's"] = loader.sampler is source.sampler
    out["batch_sampler is the source's"] = loader.batch_sampler is source.batch_sampler
    out["sampler, batch_sampler"] = (
        (loader.sampler, loader.batch_sampler) if not is_source else None
    )
    orders = []
    for epoch in (0, 1, 0):
        loader.set_epoch(epoch)
        orders.append([i for batch in loader for i in batch.tolist()])
    out["orders"] = orders
    out["sampler epoch"] = sampler.epoch

    # Nothing under this loader has a state: {} with one UserWarning on the source, none
    # on the receiver (which never holds a state).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if is_source:
            with pytest.warns(UserWarning, match="restarts the pass") as record:
                states = [loader.state_dict(), loader.state_dict()]
            out["warnings"] = [str(w.message) for w in record]
        else:
            states = [loader.state_dict(), loader.state_dict()]
    out["other warnings"] = [str(w.message) for w in caught]
    out["states"] = states

    # An unsized source: TypeError on every rank.
    unsized = tc.BroadcastingDataLoader(Unsized() if is_source else None, device_mesh=mesh, axes=TP)
    with pytest.raises(TypeError) as excinfo:
        len(unsized)
    out["unsized"] = str(excinfo.value)
    out["unsized batches"] = [b.tolist() for b in unsized]
    return out


def test_len_samplers_epochs_and_stateless_sources_on_every_rank(pool2: RankPool) -> None:
    """Contract 3.7, 3.9 and 3.10 on a real 2-rank group."""
    source, receiver = pool2.run(_api, timeout=TIMEOUT)
    assert source["len"] == receiver["len"] == 4
    assert source["sampler is the source's"] and source["batch_sampler is the source's"]
    assert receiver["sampler, batch_sampler"] == (None, None)
    # set_epoch reaches the DistributedSampler: epochs 0 and 1 differ, epoch 0 comes back
    epoch0, epoch1, epoch0_again = source["orders"]
    assert sorted(epoch0) == sorted(epoch1) == list(range(16))
    assert epoch0 != epoch1 and epoch0 == epoch0_again
    assert receiver["orders"] == source["orders"]
    assert source["sampler epoch"] == 0
    # no state: {} everywhere, one warning on the source only
    assert source["states"] == receiver["states"] == [{}, {}]
    assert len(source["warnings"]) == 1
    assert "nothing under this BroadcastingDataLoader has a state_dict()" in source["warnings"][0]
    assert source["other warnings"] == receiver["other warnings"] == []
    assert "has no len()" in source["unsized"] and "has no len()" in receiver["unsized"]
    assert source["unsized batches"] == receiver["unsized batches"] == [[0], [1], [2]]


# -- a state saved at the end of a pass ---------------------------------------------------------


class Epochs:
    """A resumable source whose state says when its pass is over, as torchdata's
    ``StatefulDataLoader``'s does: a resume from there starts the next pass whole; a resume
    from just after the last batch, whose pass is not over yet, yields nothing."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0
        self.over = False
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.over:
            self.pos, self.over = 0, False
        while self.pos < self.n:
            self.pos += 1
            yield torch.tensor([self.pos - 1])
        self.over = True

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "over": self.over, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos, self.over, self.epoch = state["pos"], state["over"], state["epoch"]


def _epochs_loader(rank: int, prefetch: int) -> tc.BroadcastingDataLoader:
    source = Epochs(4) if rank == 0 else None
    return tc.BroadcastingDataLoader(source, group=dist.group.WORLD, src=0, prefetch=prefetch)


def _rank_end_state(rank: int, world: int) -> dict[int, Any]:
    out = {}
    for prefetch in (0, 1, 2):
        first = _epochs_loader(rank, prefetch)
        whole = [int(b) for b in first]
        first.set_epoch(1)  # between passes, as a framework does
        state = first.state_dict()
        resumed = _epochs_loader(rank, prefetch)
        resumed.load_state_dict(state)
        out[prefetch] = (whole, state, [int(b) for b in resumed])
    return out


def test_a_state_saved_after_a_whole_pass_resumes_into_the_next_one(pool2: RankPool) -> None:
    """Contract 3.8 at the end of a pass: the state is the source's own once exhausted (its
    pass is over), so a resume starts the next pass whole, as the bare source does, at
    every prefetch; it was the state after the last batch, and the resumed pass was empty.
    It stays the source's own until the next pass: a ``set_epoch`` between passes is in it
    (it was the state when the source ran out, and the resume skipped an epoch)."""
    bare = Epochs(4)
    list(bare)
    again = Epochs(4)
    again.load_state_dict(bare.state_dict())
    want = [int(b) for b in again]
    assert want == [0, 1, 2, 3]
    for rank, out in enumerate(pool2.run(_rank_end_state, timeout=TIMEOUT)):
        for prefetch, (whole, state, resumed) in out.items():
            assert whole == [0, 1, 2, 3], (rank, prefetch, whole)
            if rank == 0:
                assert state == {"pos": 4, "over": True, "epoch": 1}, (prefetch, state)
            assert resumed == want, (rank, prefetch, resumed)
