"""Lightning: log the data stall, the time ``training_step`` waited for its batch.

Run it (``Trainer(accelerator="cpu", devices=2, strategy="ddp")``; Lightning re-runs this
script for the second rank)::

    python examples/lightning_stall.py --quick

Both ranks share one batch per step (a tensor-parallel pair): rank 0 iterates a loader
that takes 10 ms per batch, the loader broadcasts it with ``prefetch=1``, and each step
logs ``loader.stats()`` of its last 10 steps with ``self.log``. A stall near 0 means data
loading is not the bottleneck; ``log_every`` also writes a line to the ``tensorcast``
logger on the source rank.
"""

from __future__ import annotations

import argparse
import logging
import time

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import tensorcast as tc


class SlowData(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.005)  # decoding, augmenting...: 10 ms per batch of 2
        return torch.randn(4, generator=torch.Generator().manual_seed(i))


class Model(L.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.steps = steps
        self.loader: tc.BroadcastingDataLoader | None = None
        self.stalls: list[float] = []

    def train_dataloader(self) -> tc.BroadcastingDataLoader:
        source = DataLoader(SlowData(), batch_size=2) if dist.get_rank() == 0 else None
        self.loader = tc.BroadcastingDataLoader(
            source, group=dist.group.WORLD, src=0, prefetch=1, log_every=self.steps
        )
        return self.loader

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        assert self.loader is not None
        recent = self.loader.stats(last=10).recent
        assert recent is not None
        self.log("data_stall_ms", recent.stall.median * 1e3, on_step=True, prog_bar=True)
        self.log("data_stall_share", recent.stall_share, on_step=True)
        self.stalls.append(recent.stall.median)
        time.sleep(0.02)  # the step's compute: 20 ms, under which the next batch loads
        return self.layer(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 steps, for tests")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    steps = 8 if args.quick else 32
    model = Model(steps)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    logged = "data_stall_ms" in trainer.callback_metrics
    assert model.loader is not None
    stats = model.loader.stats()
    if dist.get_rank() == 0:
        print(f"data stall logged with self.log: {logged}")
        print(f"steps: {stats.steps}")
        print(f"data stall: {stats.stall.median * 1e3:.1f} ms median over the pass, "
              f"{100 * stats.stall_share:.0f}% of the step")  # fmt: skip


if __name__ == "__main__":
    main()
