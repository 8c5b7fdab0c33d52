"""Set-up mistakes on real gloo groups: never a silent no-op, a silent skip or a bare error.

- A mesh without dim names is a ``TypeError``; axes that miss a mesh with a TP-like dim of
  size > 1 stay a no-op with one ``UserWarning`` per process (the contract, "Broadcast"), for
  ``is_dp_source_rank``, ``broadcast_batch`` and ``BroadcastingDataLoader``.
- A loader built before ``init_process_group`` raises at ``iter()`` (contract 3.1).
- A resume taken from a sampler under DataLoader workers warns that it will skip batches,
  naming ``StatefulDataLoader`` (contract 3.10).
- ``packed_collate()`` under ``batch_size=None`` (lhotse's samplers) and ``device="cuda"``
  on a build of torch without CUDA.

Each warning is once per process for one mesh layout and axes, and the pool's ranks live
for the whole session: the dim names used here are used nowhere else.
"""

from __future__ import annotations

import datetime
import os
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from lhotse import CutSet
from lhotse.dataset import DynamicBucketingSampler
from rankpool import RankPool, may_start_workers
from test_dist_lhotse import corpus, digest
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, Dataset

import tensorcast as tc

TIMEOUT = 120.0


# -- axes and meshes ---------------------------------------------------------------------------


def _rank_axes(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    batch = {"x": torch.full((3,), float(rank))}
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tensor"))
    for what, call in {
        "is_dp_source_rank": lambda: tc.is_dp_source_rank(mesh),
        "broadcast_batch": lambda: tc.broadcast_batch(batch, mesh, axes="TP") is batch,
        "loader": lambda: [
            b["x"].tolist()
            for b in tc.BroadcastingDataLoader([batch], mesh, axes=("cp", "tp", "sp"))
        ],
    }.items():
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            first, again = call(), call()
        out[what] = (first, again, [str(w.message) for w in record])
    unnamed = init_device_mesh("cpu", (world,))
    errors = []
    for call in (
        lambda: tc.is_dp_source_rank(unnamed),
        lambda: tc.broadcast_batch(batch, unnamed),
        lambda: tc.BroadcastingDataLoader([batch], unnamed),
    ):
        try:
            call()
            errors.append("no error")
        except TypeError as e:
            errors.append(str(e))
    out["unnamed"] = errors
    return out


def test_axes_that_miss_the_mesh_warn_once_and_unnamed_meshes_raise(pool2: RankPool) -> None:
    """Contract 2: a quiet no-op would hand TP peers different batches."""
    for r, out in enumerate(pool2.run(_rank_axes, timeout=TIMEOUT)):
        first, again, caught = out["is_dp_source_rank"]
        assert first is again is True
        assert len(caught) == 1, caught
        assert "tensorcast.is_dp_source_rank" in caught[0]
        assert "('dp', 'tensor')" in caught[0] and "('cp', 'tp')" in caught[0]
        assert "axes=('tensor',)" in caught[0]  # how to fix it
        first, again, caught = out["broadcast_batch"]
        assert first is again is True  # the very same object: still a no-op
        assert len(caught) == 1 and "tensorcast.broadcast_batch" in caught[0]
        assert "('TP',)" in caught[0]
        first, again, caught = out["loader"]
        assert first == again == [[float(r)] * 3]  # every rank its own batch, as warned
        assert len(caught) == 1 and "BroadcastingDataLoader" in caught[0]
        assert "('cp', 'tp', 'sp')" in caught[0]
        assert len(out["unnamed"]) == 3
        for message, what in zip(
            out["unnamed"],
            [
                "tensorcast.is_dp_source_rank",
                "tensorcast.broadcast_batch",
                "BroadcastingDataLoader",
            ],
        ):
            assert message.startswith(f"{what} needs a device mesh with named dimensions")
            assert "mesh_dim_names=" in message


# -- a loader built before init_process_group ----------------------------------------------------


def _rank_built_too_early(rank: int, world: int, store_dir: str) -> list[str]:
    dist.destroy_process_group()  # as before init_process_group in a real script
    early = tc.BroadcastingDataLoader([torch.zeros(1)] if rank == 0 else None)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.path.join(store_dir, "store"), world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    out = []
    try:
        for _ in range(2):  # every pass, not only the first
            try:
                iter(early)
                out.append("no error")
            except RuntimeError as e:
                out.append(str(e))
        late = tc.BroadcastingDataLoader([torch.zeros(1)] * 2)  # built after: a plain no-op
        out.append(f"late: {len(list(late))}")
    finally:
        dist.destroy_process_group()  # the pool makes its own group again
    return out


def test_a_loader_built_before_init_process_group_raises_at_iter(
    pool2: RankPool, tmp_path: Any
) -> None:
    """Contract 3.1: it would be a no-op on every rank (rank 1 yielding nothing)."""
    for r, out in enumerate(pool2.run(_rank_built_too_early, str(tmp_path), timeout=TIMEOUT)):
        assert len(out) == 3
        for message in out[:2]:
            assert message.startswith("this BroadcastingDataLoader was built before "), message
            assert f"on rank {r} of a group of 2" in message
            assert "Build the loader after init_process_group()" in message
        assert out[2] == "late: 2"


# -- state from a sampler under DataLoader workers; packed_collate under batch_size=None ----------


class CutBatches(Dataset[dict[str, Any]]):
    """A lhotse-style dataset: a mini-batch of cuts to a collated dict (and the cuts)."""

    def __getitem__(self, cuts: CutSet) -> dict[str, Any]:
        lens = torch.tensor([c.num_samples for c in cuts])
        return {"lens": lens, "ids": [c.id for c in cuts], "cuts": cuts}


def _sampler() -> DynamicBucketingSampler:
    return DynamicBucketingSampler(
        corpus(16, seed=5),
        max_duration=1.0,
        num_buckets=2,
        shuffle=True,
        seed=2,
        world_size=1,
        rank=0,
    )


def _rank_workers_and_collate(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    is_source = tc.is_dp_source_rank(mesh)
    out: dict[str, Any] = {}
    with may_start_workers():
        plain = [digest(b) for b in DataLoader(CutBatches(), sampler=_sampler(), batch_size=None)]
        for workers in (0, 2):
            source = DataLoader(
                CutBatches(),
                sampler=_sampler(),
                batch_size=None,
                num_workers=workers,
                collate_fn=tc.packed_collate(),  # a whole batch per item: nothing to collate
                multiprocessing_context="fork" if workers else None,
            )
            loader = tc.BroadcastingDataLoader(source if is_source else None, mesh, prefetch=1)
            got = []
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                for step, b in enumerate(loader):
                    # the model: its own collective on the mesh's group, at its own moments
                    time.sleep(0.01 * ((rank + step) % 2))
                    dist.all_reduce(torch.ones(1), group=tp)
                    got.append(digest(b))
                    if step in (1, 2):
                        loader.state_dict()
            out[workers] = {"same": got == plain, "warnings": [str(w.message) for w in record]}
        del source, loader
    return out


def test_sampler_state_under_workers_warns_and_packed_collate_takes_whole_batches(
    pool2: RankPool,
) -> None:
    """Contract 3.10 (a resume from the sampler's state under workers skips batches: say
    so, once, naming the exact path) and packed_collate() with lhotse's batch_size=None."""
    source, receiver = pool2.run(_rank_workers_and_collate, timeout=TIMEOUT)
    for r in (source, receiver):
        assert r[0]["same"] and r[2]["same"]  # packed in the workers, equal to a plain loader
        assert r[0]["warnings"] == []  # exact without workers
    assert receiver[2]["warnings"] == []  # receivers hold no state
    caught = source[2]["warnings"]
    assert len(caught) == 1, caught
    assert "num_workers=2" in caught[0] and "will skip batches" in caught[0]
    assert "torchdata.stateful_dataloader.StatefulDataLoader" in caught[0]
    assert "DynamicBucketingSampler" in caught[0]


# -- device="cuda" without CUDA -----------------------------------------------------------------


def _rank_cuda_without_cuda(rank: int, world: int) -> list[str]:
    out = []
    for call in (
        lambda: tc.broadcast(torch.ones(2) if rank == 0 else None, 0, device="cuda"),
        lambda: tc.BroadcastingDataLoader([torch.ones(2)] if rank == 0 else None, device="cuda"),
    ):
        try:
            call()
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    # nothing was left half set up: the same ranks broadcast right after
    out.append(str(tc.broadcast(torch.ones(2) if rank == 0 else None, 0).tolist()))
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_device_without_cuda_says_what_to_change(pool2: RankPool) -> None:
    for out in pool2.run(_rank_cuda_without_cuda, timeout=TIMEOUT):
        for message in out[:2]:
            assert message.startswith("device='cuda' asks for CUDA, but torch "), message
            assert "pass device=None" in message
        assert out[2] == "[1.0, 1.0]"


# -- a source whose len() fails -----------------------------------------------------------------


class Length:
    """A source whose ``__len__`` raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __iter__(self) -> Any:
        return iter([torch.ones(2), torch.zeros(2)])

    def __len__(self) -> int:
        raise self.error


def _rank_len_fails(rank: int, world: int) -> list[Any]:
    out: list[Any] = []
    # NotImplementedError: the source has no length, as TypeError says (Lightning reads both so)
    loader = tc.BroadcastingDataLoader(
        Length(NotImplementedError("unknown")) if rank == 0 else None,
        group=dist.group.WORLD, src=0, timeout=20,
    )  # fmt: skip
    with pytest.raises(TypeError, match="has no len"):
        len(loader)
    out.append([b.tolist() for b in loader])
    # any other error fails every rank at once, the source with its own
    started = time.monotonic()
    try:
        tc.BroadcastingDataLoader(
            Length(ValueError("manifest unreadable")) if rank == 0 else None,
            group=dist.group.WORLD, src=0, timeout=20,
        )  # fmt: skip
    except Exception as e:
        out.append((type(e).__name__, str(e)))
    out.append(time.monotonic() - started)
    return out


def test_a_source_whose_len_fails_fails_every_rank_at_once(pool2: RankPool) -> None:
    source, receiver = pool2.run(_rank_len_fails, timeout=TIMEOUT)
    assert source[0] == receiver[0] == [[1.0, 1.0], [0.0, 0.0]]
    assert source[1] == ("ValueError", "manifest unreadable")
    name, message = receiver[1]
    assert name == "SourceError" and "len(source): ValueError: manifest unreadable" in message
    assert "on rank 0" in message and "NotImplementedError" in message, message
    assert receiver[2] < 10 and source[2] < 10, "not at the 20 s timeout"


# -- a source that iterates a loader on its own ranks -------------------------------------------


def _rank_nested(rank: int, world: int) -> list[str]:
    def loader(source: Any) -> tc.BroadcastingDataLoader:
        return tc.BroadcastingDataLoader(
            source if rank == 0 else None, group=dist.group.WORLD, src=0, prefetch=1, timeout=20
        )

    inner = loader([torch.tensor([i]) for i in range(4)])
    outer = loader(b for b in inner)  # a source that iterates another loader on its ranks
    started = time.monotonic()
    try:
        list(outer)
    except RuntimeError as e:
        return [type(e).__name__, str(e), f"{time.monotonic() - started:.1f}"]
    return ["no error"]


def test_a_source_that_iterates_a_loader_on_its_ranks_raises_at_once(pool2: RankPool) -> None:
    """Its steps run on the lane it would queue on: a RuntimeError naming the mistake on
    the source (the receivers a SourceError carrying it), never a wait on itself."""
    source, receiver = pool2.run(_rank_nested, timeout=TIMEOUT)
    assert source[0] == "RuntimeError" and receiver[0] == "SourceError", (source, receiver)
    for out in (source, receiver):
        assert "a source must not broadcast or iterate another" in out[1], out
        assert float(out[2]) < 10, out  # not at the 20 s timeout


# -- arguments a call cannot take ----------------------------------------------------------------


def _rank_bad_arguments(rank: int, world: int) -> list[str]:
    """Every rank passes the same bad argument: each call raises at once, naming what to
    change, before anything is sent; a rank outside a group that calls on it is told so,
    while the group's ranks broadcast; the same ranks broadcast right after."""
    tree = {"x": torch.arange(4.0)} if rank == 0 else None
    out = []
    for kw in (
        {"device": "meta"},
        {"timeout": float("nan")},
        {"timeout": float("inf")},
        {"timeout": datetime.timedelta(0)},
        {"timeout": 1e-9},  # was the default group's timeout: 1e-9 s is timedelta(0)
        {"timeout": datetime.timedelta(microseconds=400)},
        {"src": "0"},
        {"src": 0.0},
        {"group": "WORLD"},
        {"group": 0},
    ):
        args = {"src": 0, **kw}
        src = args.pop("src")
        try:
            tc.broadcast(tree, src, **args)
            out.append("no error")
        except (TypeError, ValueError) as e:
            out.append(f"{type(e).__name__}: {e}")
    pair = dist.new_group([0, 1])  # every rank calls new_group; 2 and 3 are not in it
    try:
        got = tc.broadcast(tree, 0, group=pair, timeout=20)
        out.append(str(got["x"].tolist()))
    except ValueError as e:
        out.append(f"{type(e).__name__}: {e}")
    out.append(str(tc.broadcast(tree, np.int64(0), timeout=20)["x"].tolist()))  # an integer
    return out


def test_bad_arguments_raise_before_anything_is_sent(pool4: RankPool) -> None:
    for rank, out in enumerate(pool4.run(_rank_bad_arguments, timeout=TIMEOUT)):
        device, nan, inf, zero, tiny, tiny_delta, src_str, src_float = out[:8]
        group_str, group_int, pair, after = out[8:]
        assert device.startswith("ValueError: device='meta': a batch lands on the CPU or a CUDA")
        for message in (nan, inf):
            assert message.startswith("ValueError: timeout must be a positive number of"), message
        assert zero.startswith("ValueError: timeout must be a timedelta of 1 ms to"), zero
        for message in (tiny, tiny_delta):
            assert message.startswith("ValueError: timeout must be"), message
        for message in (src_str, src_float):
            assert message.startswith("TypeError: src must be an int, a global rank"), message
        for message in (group_str, group_int):
            assert message.startswith("TypeError: group must be a torch.distributed"), message
        if rank < 2:
            assert pair == "[0.0, 1.0, 2.0, 3.0]"
        else:
            assert pair.startswith(f"ValueError: global rank {rank} is not a member"), pair
        assert after == "[0.0, 1.0, 2.0, 3.0]"


# -- a call that raises on one rank only (NOTE [ A call that does not take its part ]) ----------


def _rank_one_rank_mistypes(rank: int, world: int) -> list[str]:
    """Steps of ``tc.broadcast`` on an open channel where one rank's call has a bad
    argument, caught: the source's (its receivers are told), then a receiver's (it reads
    the frame and drops it). Every later step is the same batch on both ranks."""
    out = []
    for step, bad in ((1, None), (2, 0), (3, None), (4, 1), (5, None)):
        kw: dict[str, Any] = {}
        if bad == rank:
            kw = {"trim": "yes"} if rank == 0 else {"device": "nonsense"}
        try:
            got = tc.broadcast({"step": step} if rank == 0 else None, 0, timeout=20, **kw)
            out.append(f"{step}: {got['step']}")
        except Exception as e:
            out.append(f"{step}: {type(e).__name__}: {e}"[:90])
    return out


def test_a_call_that_fails_on_one_rank_still_takes_its_part(pool2: RankPool) -> None:
    """It used to return at once, unsent or unread, and every later step on the other rank
    was another step's batch, with no error anywhere."""
    source, receiver = pool2.run(_rank_one_rank_mistypes, timeout=TIMEOUT)
    assert source[0::2] == receiver[0::2] == ["1: 1", "3: 3", "5: 5"]
    assert source[1].startswith("2: TypeError: trim must be True or False"), source
    assert receiver[1].startswith("2: SourceError: source rank 0 reported: its call failed"), (
        receiver
    )
    assert source[3] == "4: 4" and receiver[3].startswith("4: RuntimeError: Expected one of")


def _rank_one_rank_mispicks(rank: int, world: int) -> list[str]:
    """As above, with an argument that picks the channel wrong on one rank (``src`` that
    is no int or no rank of the group, ``shm`` that is no bool), where this rank has one
    channel over the group's ranks, then on a mesh: the call can only have meant that one."""
    from torch.distributed.device_mesh import init_device_mesh

    out = []
    bad = {2: (0, {"src": True}), 4: (1, {"shm": "auto"}), 6: (1, {"src": 5}), 8: (0, {"src": "0"})}
    for step in range(1, 10):
        who, kw = bad.get(step, (None, {}))
        args: dict[str, Any] = {"src": 0, **(kw if who == rank else {})}
        try:
            got = tc.broadcast({"step": step} if rank == 0 else None, timeout=20, **args)
            out.append(f"{step}: {got['step']}")
        except Exception as e:
            out.append(f"{step}: {type(e).__name__}: {e}"[:120])
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    for step, shm in ((10, None), (11, "auto" if rank == 1 else None), (12, None)):
        try:
            got = tc.broadcast_batch({"step": step}, mesh, timeout=20, shm=shm)
            out.append(f"{step}: {got['step']}")
        except Exception as e:
            out.append(f"{step}: {type(e).__name__}: {e}"[:120])
    return out


def test_a_call_whose_channel_arguments_are_wrong_on_one_rank_takes_its_part_where_it_can(
    pool2: RankPool,
) -> None:
    """Such a call used to raise only, and the other rank's every later step was another
    step's batch, with no error anywhere (NOTE [ A call that does not take its part ])."""
    source, receiver = (
        dict(line.split(": ", 1) for line in out)
        for out in pool2.run(_rank_one_rank_mispicks, timeout=TIMEOUT)
    )
    for step in ("1", "3", "5", "7", "9", "10", "12"):
        assert source[step] == receiver[step] == step, (source, receiver)
    told = "SourceError: source rank 0 reported: its call failed before sending: "
    assert source["2"].startswith("TypeError: src must be an int"), source
    assert receiver["2"].startswith(told) and receiver["8"].startswith(told), receiver
    assert source["4"] == "4" and receiver["4"].startswith("TypeError: shm must be None")
    assert source["6"] == "6" and receiver["6"].startswith("ValueError: src=5 is not a rank")
    assert source["8"].startswith("TypeError: src must be an int"), source
    assert source["11"] == "11" and receiver["11"].startswith("TypeError: shm must be None")


def _rank_later_setup_alone(rank: int, world: int) -> list[str]:
    """After a step from rank 0, the last rank alone calls with itself as ``src`` (a new
    channel its peers never set up), then every rank calls from rank 0 again; the group is
    torn down after."""
    out = []
    last = world - 1
    try:
        for src in (0, last if rank == last else 0, 0):
            t0 = time.monotonic()
            try:
                got = tc.broadcast({"from": src} if rank == src else None, src, timeout=1)
                out.append(f"{got['from']}")
            except tc.TensorcastError as e:
                out.append(f"{type(e).__name__} after {time.monotonic() - t0:.0f} s: {e}"[:60])
        return out
    finally:
        if rank == 0:  # alive a moment, beating: its receivers' diagnosis says so at once
            time.sleep(1.5)
        dist.destroy_process_group()  # its channel over the ranks may be broken for good


def test_a_setup_a_rank_makes_alone_breaks_its_channels_over_the_same_ranks(
    pool4: RankPool,
) -> None:
    """The last rank's third call used to return the frame of rank 0's second, silently
    (its peers had gone on without it, and the source's send to it had gone through)."""
    *others, alone = pool4.run(_rank_later_setup_alone, timeout=TIMEOUT)
    assert alone[0] == "0" and alone[1].startswith("DesyncError after 1 s: rank 3: rank(s)")
    assert alone[2].startswith("PeerError"), alone
    for out in others:
        assert out[0] == "0" and "PeerError" in out[1] + out[2], out
