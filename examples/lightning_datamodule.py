"""Lightning: a LightningDataModule whose loaders are BroadcastingDataLoaders.

Run it (it launches ``Trainer(accelerator="cpu", devices=4, strategy="ddp")`` itself;
Lightning re-runs this script once per extra rank)::

    python examples/lightning_datamodule.py
    python examples/lightning_datamodule.py --quick

Lightning initialises the process group; the datamodule's ``setup()`` then builds a
``(dp=2, tp=2)`` mesh on it. To DDP all 4 ranks are data-parallel; here each tp pair shares
its batches (one source rank per pair), as under a tensor-parallel strategy, and
``training_step`` runs an ``all_reduce`` on the tp group. ``val_dataloader()`` returns a
dict of two loaders, which Lightning wraps in a ``CombinedLoader``.

Each training step logs the data stall, the time it waited for its batch, with
``self.log`` (``loader.stats(last=10)``: a stall near 0 means data loading is not the
bottleneck), and the train loader's ``log_every`` writes a line to the ``tensorcast``
logger on each source rank at the end of every epoch.

The run fits 2 epochs with a checkpoint in the middle of epoch 1, then fits again from that
checkpoint in a fresh Trainer, model and datamodule. What Lightning 2.x does with the loaders:

- it calls ``len(loader)`` on every rank and all-reduces it; every rank has the same length.
- it calls ``set_epoch`` on ``loader.sampler`` and ``loader.batch_sampler.sampler``
  (``_set_sampler_epoch``): the source's own on the source rank, so epochs reshuffle.
- it only re-wraps ``torch.utils.data.DataLoader`` objects with a ``DistributedSampler``:
  shard by ``tc.dp_rank_and_size`` yourself, as below.
- the resume mid-epoch is exact. The fit loop saves ``state_dict()`` of each train loader
  that has ``state_dict``/``load_state_dict`` (``CombinedLoader._state_dicts()``, under
  ``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]``) and calls
  ``load_state_dict`` before its first ``iter()`` on resume. The loader's state delegates
  to its sampler (exact with ``num_workers=0``). Lightning writes the checkpoint on global
  rank 0 only and every rank loads that file, so the sampler's state must not depend on the
  DP slot: here it is (epoch, samples yielded), equal on every slot (lhotse's samplers drop
  their rank on load for the same reason). It holds the epoch because Lightning calls
  ``iter()`` before ``set_epoch`` in a run's first epoch. Lightning also calls ``iter()``
  once on anything that is not a ``DataLoader``, to check that it is iterable, and drops
  that iterator: the loader draws nothing until a pass's first ``next()``, so that costs
  no batch.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import tensorcast as tc

FEATURES = 4
TP = ("tp",)  # the mesh axis whose ranks share one batch
WORKDIR = "TENSORCAST_LIGHTNING_EXAMPLE_DIR"  # inherited by the ranks Lightning starts


class Regression(Dataset[dict[str, torch.Tensor]]):
    """``y = x @ w``; sample ``i`` is the same in every process."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i += self.offset
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(i))
        return {"idx": torch.tensor(i), "x": x, "y": x.sum(0, keepdim=True)}


class ResumableDistributedSampler(DistributedSampler[Any]):
    """A ``DistributedSampler`` that resumes mid-epoch, as torchdata's
    ``StatefulDistributedSampler``: its state is (epoch, samples yielded), the same on every
    DP slot, and a restored position is used by the next pass only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.yielded = 0
        self._resume_at = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.yielded = 0
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        # A new pass starts at 0: Lightning calls iter() once just to check that it works.
        start, self._resume_at = self._resume_at, 0
        self.yielded = start
        for index in list(super().__iter__())[start:]:
            self.yielded += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        super().set_epoch(state["epoch"])
        self.yielded = self._resume_at = state["yielded"]


class BroadcastDataModule(L.LightningDataModule):
    def __init__(self, steps_per_epoch: int, batch_size: int = 2) -> None:
        super().__init__()
        self.steps_per_epoch = steps_per_epoch
        self.batch_size = batch_size
        self.train_set = Regression(2 * steps_per_epoch * batch_size)  # 2 DP slots
        self.val_sets = {"clean": Regression(8, 1000), "noisy": Regression(12, 2000)}
        self.mesh: Any = None
        self.train_loader: tc.BroadcastingDataLoader | None = None

    def setup(self, stage: str) -> None:
        # Lightning has initialised the process group by now, on every rank.
        self.mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def _loader(self, ds: Dataset[Any], *, train: bool) -> tc.BroadcastingDataLoader:
        source = None
        if tc.is_dp_source_rank(self.mesh, TP):
            dp_rank, dp_size = tc.dp_rank_and_size(self.mesh, TP)
            kind = ResumableDistributedSampler if train else DistributedSampler
            sampler = kind(ds, num_replicas=dp_size, rank=dp_rank, shuffle=train, seed=0)
            source = DataLoader(ds, self.batch_size, sampler=sampler, num_workers=0)
        log_every = self.steps_per_epoch if train else None  # a line per epoch, on the source
        return tc.BroadcastingDataLoader(
            source, device_mesh=self.mesh, axes=TP, prefetch=1, log_every=log_every
        )

    def train_dataloader(self) -> tc.BroadcastingDataLoader:
        self.train_loader = self._loader(self.train_set, train=True)
        return self.train_loader

    def val_dataloader(self) -> dict[str, tc.BroadcastingDataLoader]:
        return {name: self._loader(ds, train=False) for name, ds in self.val_sets.items()}


class TinyModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(FEATURES, 1)
        self.train_ids: list[list[int]] = []  # the sample ids of each step, in order
        self.val_batches: Counter[int] = Counter()
        self.stall_logged = False

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # A collective of the model's own between two batches of the loader: the tp pair
        # holds the same batch, so the sum over the pair is twice the local one.
        tp_group = self.trainer.datamodule.mesh.get_group("tp")
        total = batch["idx"].sum()
        dist.all_reduce(total, group=tp_group)
        if total != dist.get_world_size(tp_group) * batch["idx"].sum():
            raise RuntimeError(f"the tp group holds different batches at step {batch_idx}")
        self.train_ids.append(batch["idx"].tolist())
        # The data stall of the last 10 steps, this one included.
        recent = self.trainer.datamodule.train_loader.stats(last=10).recent
        self.log("data_stall_ms", recent.stall.median * 1e3, on_step=True)
        self.log("data_stall_share", recent.stall_share, on_step=True)
        return torch.nn.functional.mse_loss(self.layer(batch["x"]), batch["y"])

    def on_train_end(self) -> None:
        self.stall_logged = "data_stall_ms" in self.trainer.callback_metrics

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.val_batches[dataloader_idx] += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(dm: BroadcastDataModule, workdir: str, every: int, ckpt_path: str | None) -> TinyModel:
    model = TinyModel()
    keep = -1 if ckpt_path is None else 0
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy="ddp",
        max_epochs=2,
        # The resumed fit keeps the callback (its state is in the checkpoint) but saves nothing.
        callbacks=[ModelCheckpoint(workdir, "mid", every_n_train_steps=every, save_top_k=keep)],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 steps per epoch, for tests")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("tensorcast").setLevel(logging.INFO)  # the loader's log_every lines
    created = WORKDIR not in os.environ  # the launching process, not a rank Lightning started
    if created:
        os.environ[WORKDIR] = tempfile.mkdtemp(prefix="tensorcast-lightning-")
    workdir = os.environ[WORKDIR]

    steps = 4 if args.quick else 24  # per epoch, per DP slot
    every = steps + steps // 2  # one checkpoint, in the middle of epoch 1
    dm = BroadcastDataModule(steps)
    whole = fit(dm, workdir, every, None)
    assert dm.train_loader is not None
    stall = dm.train_loader.stats()  # the last pass: epoch 1
    ckpt = os.path.join(workdir, "mid.ckpt")
    resumed = fit(BroadcastDataModule(steps), workdir, every, ckpt)  # as after a restart

    # The summary: every rank's steps, gathered as tensors (shapes agree by construction).
    epoch0, epoch1 = whole.train_ids[:steps], whole.train_ids[steps:]
    exact = resumed.train_ids == whole.train_ids[every:]
    mine = torch.tensor([epoch0, epoch1])
    every_rank = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every_rank, mine)
    flags = torch.tensor([int(exact), int(epoch0 != epoch1)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        state = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]["state_dict"]
        orders = [t.tolist() for t in every_rank]
        rows = dm.mesh.mesh.tolist()  # the global ranks of each tp pair
        same_in_tp = all(orders[r] == orders[row[0]] for row in rows for r in row)
        val = {name: whole.val_batches[i] for i, name in enumerate(dm.val_sets)}
        print(f"ranks: 4, mesh (dp=2, tp=2), 2 epochs x {steps} steps, checkpoint at step {every}")
        print(f"loader state in checkpoint: {state.get('combined_loader')}")
        print(f"epochs reshuffled: {bool(flags[1])}")
        print(f"same batches within each tp pair: {same_in_tp}")
        print(f"validation batches per loader: {val}")
        print(f"resume exact: {bool(flags[0])} ({len(resumed.train_ids)} steps after resuming)")
        print(f"data stall logged with self.log: {whole.stall_logged}")
        print(f"data stall over epoch 1's {stall.steps} steps: {stall.stall.median * 1e3:.1f} ms "
              f"median, {100 * stall.stall_share:.0f}% of the step")  # fmt: skip
        if created:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
