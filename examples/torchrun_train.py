"""Train under torchrun: one real DataLoader per DP slot, its batches broadcast to its TP peers.

Run it (gloo on CPU is the default; ``--cuda`` uses NCCL, one GPU per rank)::

    torchrun --standalone --nproc_per_node 4 examples/torchrun_train.py
    torchrun --standalone --nproc_per_node 4 examples/torchrun_train.py --quick
    torchrun --standalone --nproc_per_node 4 examples/torchrun_train.py --cuda

The 4 ranks form a ``(dp=2, tp=2)`` mesh. The first rank of each tp pair builds a real
``DataLoader`` (2 worker processes that pack every batch with ``tc.packed_collate``), sharded
by its DP slot (``tc.dp_rank_and_size``), not by global rank; its peer builds no loader and
receives the same batches. The model's linear layer is split across the tp pair, so the
model runs its own ``all_reduce`` on the tp group every step, between two batches of the
loader, and a DP gradient ``all_reduce`` on the dp group. Two epochs, ``set_epoch`` each.

Then a mid-epoch checkpoint. A plain ``DataLoader`` has no ``state_dict()``; the loader's
``state_dict()`` delegates to its batch sampler (a small resumable one, below). Run
``--steps`` steps, save, build fresh loaders, load, run the rest: the two halves equal one
uninterrupted epoch on every rank. The resume is exact with ``num_workers=0``: worker
processes draw from the sampler ahead of the batches the loop has seen.
"""

from __future__ import annotations

import argparse
import io
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

import tensorcast as tc

FEATURES = 8
TP = ("tp",)  # the mesh axis whose ranks share one batch


class Regression(Dataset[dict[str, torch.Tensor]]):
    """``y = x @ w`` for a fixed ``w``; sample ``i`` is the same in every process."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.w = torch.linspace(-1.0, 1.0, FEATURES)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(i))
        return {"idx": torch.tensor(i), "x": x, "y": (x @ self.w).unsqueeze(0)}


class _SumOverTP(torch.autograd.Function):
    """Sum partial products over the tp group; every tp rank already holds the whole loss's
    gradient, so the backward is the identity (Megatron's reduce-from-TP-region)."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = partial.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class RowParallelLinear(torch.nn.Module):
    """``x @ w.T`` with ``w``'s input columns split over the tp group. It is only right when
    every tp rank multiplies the same ``x``: the batch the loader broadcast."""

    def __init__(self, in_features: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.cols = slice(rank * in_features // size, (rank + 1) * in_features // size)
        self.weight = torch.nn.Parameter(torch.zeros(1, in_features // size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SumOverTP.apply(x[:, self.cols] @ self.weight.T, self.group)  # type: ignore[no-any-return]


class ResumableBatchSampler(Sampler[list[int]]):
    """Batches of ``sampler``'s indices whose state is (epoch, batches yielded); a restored
    position is used by the next pass only (as torchdata's ``StatefulDistributedSampler``)."""

    def __init__(self, sampler: DistributedSampler[Any], batch_size: int) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.yielded = 0
        self._resume_at = 0

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.sampler.epoch:
            self.yielded = 0
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        start, self._resume_at = self._resume_at, 0
        self.yielded = start
        indices = list(self.sampler)
        for at in range(start * self.batch_size, len(indices), self.batch_size):
            self.yielded += 1
            yield indices[at : at + self.batch_size]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.set_epoch(state["epoch"])
        self.yielded = self._resume_at = state["yielded"]


def train_loader(ds: Regression, mesh: DeviceMesh, batch_size: int) -> tc.BroadcastingDataLoader:
    source = None
    if tc.is_dp_source_rank(mesh, TP):
        dp_rank, dp_size = tc.dp_rank_and_size(mesh, TP)
        sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
        source = DataLoader(
            ds, batch_size, sampler=sampler, num_workers=2, collate_fn=tc.packed_collate()
        )
    return tc.BroadcastingDataLoader(source, device_mesh=mesh, axes=TP, prefetch=1)


def resumable_loader(
    ds: Regression, mesh: DeviceMesh, batch_size: int
) -> tc.BroadcastingDataLoader:
    source = None
    if tc.is_dp_source_rank(mesh, TP):
        dp_rank, dp_size = tc.dp_rank_and_size(mesh, TP)
        sampler = DistributedSampler(ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
        batches = ResumableBatchSampler(sampler, batch_size)
        source = DataLoader(
            ds, batch_sampler=batches, num_workers=0, collate_fn=tc.packed_collate()
        )
    return tc.BroadcastingDataLoader(source, device_mesh=mesh, axes=TP, prefetch=1)


def train(
    ds: Regression, mesh: DeviceMesh, args: argparse.Namespace, device: torch.device
) -> tuple[list[list[int]], float]:
    """Two epochs; returns the sample ids seen in each epoch, in order, and the last loss."""
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    loader = train_loader(ds, mesh, args.batch_size)
    model = RowParallelLinear(FEATURES, tp_group).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[list[int]] = []
    loss = torch.zeros(())
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen.append([])
        for batch in loader:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            optimizer.zero_grad()
            loss.backward()
            for p in model.parameters():  # plain DP: average the gradients over the dp slots
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= dist.get_world_size(dp_group)
            optimizer.step()
            seen[-1] += batch["idx"].tolist()
    return seen, loss.detach().item()


def resume(ds: Regression, mesh: DeviceMesh, args: argparse.Namespace) -> bool:
    """Stop epoch 1 after ``--steps`` batches, checkpoint, resume in fresh loaders."""

    def ids(loader: tc.BroadcastingDataLoader) -> Iterator[list[int]]:
        return (batch["idx"].tolist() for batch in loader)

    whole = resumable_loader(ds, mesh, args.batch_size)
    whole.set_epoch(1)
    epoch = list(ids(whole))

    first = resumable_loader(ds, mesh, args.batch_size)
    first.set_epoch(1)
    head = []
    for batch_ids in ids(first):
        head.append(batch_ids)
        if len(head) == args.steps:
            break  # every rank stops after the same batch
    checkpoint = io.BytesIO()  # one file per rank in a real job; {} on the tp peers
    torch.save({"loader": first.state_dict()}, checkpoint)

    checkpoint.seek(0)
    restored = resumable_loader(ds, mesh, args.batch_size)  # as after a restart
    restored.load_state_dict(torch.load(checkpoint, weights_only=True)["loader"])
    restored.set_epoch(1)  # what a training loop calls anyway: keeps the restored position
    tail = list(ids(restored))
    return 0 < len(head) < len(epoch) and head + tail == epoch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small data set, for tests")
    parser.add_argument("--steps", type=int, default=None, help="steps before the checkpoint")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2, help="ranks that share one batch")
    parser.add_argument("--cuda", action="store_true", help="NCCL on one GPU per rank")
    args = parser.parse_args()

    if args.cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.cuda else "gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    _, dp_size = tc.dp_rank_and_size(mesh, TP)
    ds = Regression(dp_size * args.batch_size * (4 if args.quick else 32))
    steps_per_epoch = len(ds) // (dp_size * args.batch_size)
    args.steps = args.steps or steps_per_epoch // 2

    seen, loss = train(ds, mesh, args, device)
    exact = resume(ds, mesh, args)

    # The summary: every rank's epochs, gathered as tensors (shapes agree by construction).
    mine = torch.tensor(seen, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    flag = torch.tensor([int(exact)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        rows = mesh.mesh.tolist()  # the global ranks of each dp slot's tp group
        orders = [every[r].tolist() for r in range(world)]
        same_in_tp = all(orders[r] == orders[row[0]] for row in rows for r in row)
        disjoint = all(
            sorted(i for row in rows for i in orders[row[0]][epoch]) == list(range(len(ds)))
            for epoch in range(2)
        )
        reshuffled = all(o[0] != o[1] for o in orders)
        print(
            f"ranks: {world}, mesh (dp={len(rows)}, tp={args.tp}), 2 epochs x "
            f"{steps_per_epoch} steps, one source rank per dp slot"
        )
        print(f"same batches within each tp group: {same_in_tp}")
        print(f"dp slots disjoint, together the whole data set each epoch: {disjoint}")
        print(f"epochs reshuffled: {reshuffled}")
        print(f"resume exact: {bool(flag.item())} (checkpoint after {args.steps} steps)")
        print(f"final loss: {loss:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
