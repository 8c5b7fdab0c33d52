"""NeMo's speech data pattern, without NeMo: a lhotse sampler on one source rank per DP slot.

Run it (4 ranks on gloo; ``--cp 2 --tp 1`` puts the pairs on the cp axis instead)::

    torchrun --standalone --nproc_per_node 4 examples/nemo_style_datamodule.py
    torchrun --standalone --nproc_per_node 4 examples/nemo_style_datamodule.py --quick
    torchrun --standalone --nproc_per_node 4 examples/nemo_style_datamodule.py --cp 2 --tp 1

NeMo builds ``DataLoader(dataset, sampler=<lhotse sampler>, batch_size=None)`` on every rank.
Under CP/TP every rank of a ``(cp, tp)`` sub-mesh must see the same batch, and lhotse's
samplers are not deterministic across ranks, so here only ``tc.is_dp_source_rank(mesh)``
builds it, sharded by ``tc.dp_rank_and_size(mesh)`` (lhotse's ``world_size=``/``rank=``; its
default would be the global world), and its peers receive padded audio batches from it.
One ``(dp, cp, tp) = (2, 1, 2)`` mesh carries one training loader and two validation loaders.

A plain ``DataLoader`` has no ``state_dict()``; the loader's delegates to the lhotse sampler
(exact with ``num_workers=0``). Lhotse samplers are lazy, so ``len()`` raises ``TypeError``,
on every rank alike; every rank learns the end of a pass when the source stops.
"""

from __future__ import annotations

import argparse
import functools
import io
from typing import Any

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
from lhotse import CutSet, MonoCut, Recording, SupervisionSegment
from lhotse.dataset import DynamicBucketingSampler, SimpleCutSampler
from lhotse.dataset.collation import collate_audio, collate_vectors
from lhotse.lazy import LazyMapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.data import DataLoader, Dataset

import tensorcast as tc

SR = 8000


@functools.cache
def wav(seed: int) -> bytes:
    """0.2 to 1.0 s of noise as an in-memory WAV file."""
    rng = np.random.default_rng(seed)
    samples = (rng.standard_normal(int(SR * (0.2 + 0.8 * rng.random()))) * 0.1).astype(np.float32)
    out = io.BytesIO()
    sf.write(out, samples, SR, format="WAV", subtype="PCM_16")
    return out.getvalue()


def synthetic_cut(seed: int) -> MonoCut:
    rec = Recording.from_bytes(wav(seed), recording_id=f"utt-{seed}")
    cut = rec.to_cut()
    text = " ".join(["one", "two", "three", "four"][: 1 + seed % 4])
    cut.supervisions = [SupervisionSegment(f"utt-{seed}", rec.id, 0.0, rec.duration, text=text)]
    return cut


def corpus(first: int, n: int) -> CutSet:
    """A lazy CutSet, as read from a manifest with ``CutSet.from_jsonl_lazy``."""
    return CutSet(LazyMapper(range(first, first + n), synthetic_cut))


class AudioToTextDataset(Dataset[dict[str, Any]]):
    """A mini-batch of cuts to padded audio and character tokens (NeMo's ASR batch)."""

    def __getitem__(self, cuts: CutSet) -> dict[str, Any]:
        audio, audio_lens = collate_audio(cuts)
        tokens = [torch.tensor([ord(c) % 32 for c in cut.supervisions[0].text]) for cut in cuts]
        return {
            "audio": audio,
            "audio_lens": audio_lens,
            "tokens": collate_vectors(tokens, padding_value=0),
            "token_lens": torch.tensor([len(t) for t in tokens]),
            "cut_ids": [cut.id for cut in cuts],
        }


class SpeechDataModule:
    """What NeMo's data modules do, with the loaders built on source ranks only."""

    def __init__(self, mesh: DeviceMesh, train: CutSet, val: dict[str, CutSet]) -> None:
        self.mesh, self.train, self.val = mesh, train, val

    def _loader(self, cuts: CutSet, *, train: bool) -> tc.BroadcastingDataLoader:
        source = None
        if tc.is_dp_source_rank(self.mesh):  # axes ("cp", "tp")
            dp_rank, dp_size = tc.dp_rank_and_size(self.mesh)
            if train:
                sampler: Any = DynamicBucketingSampler(
                    cuts,
                    max_duration=2.0,
                    num_buckets=2,
                    shuffle=True,
                    seed=0,
                    world_size=dp_size,
                    rank=dp_rank,
                )
            else:
                sampler = SimpleCutSampler(cuts, max_duration=3.0, world_size=dp_size, rank=dp_rank)
            source = DataLoader(AudioToTextDataset(), sampler=sampler, batch_size=None)
        return tc.BroadcastingDataLoader(source, device_mesh=self.mesh, prefetch=1)

    def train_dataloader(self) -> tc.BroadcastingDataLoader:
        return self._loader(self.train, train=True)

    def val_dataloader(self) -> dict[str, tc.BroadcastingDataLoader]:
        return {name: self._loader(cuts, train=False) for name, cuts in self.val.items()}


def step(batch: dict[str, Any], mesh: DeviceMesh) -> None:
    """The model's own collectives: a sum over cp and over tp, between two batches."""
    energy = (batch["audio"] ** 2).sum()
    for axis in ("cp", "tp"):
        dist.all_reduce(energy, group=mesh.get_group(axis))


def ids(batches: Any) -> list[str]:
    return [cut_id for batch in batches for cut_id in batch["cut_ids"]]


def gather(values: list[str]) -> list[list[str]]:
    """Every rank's cut ids, sent as padded byte tensors (the lists' lengths may differ)."""
    mine = torch.frombuffer(bytearray("\n".join(values).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([len(mine)]))
    longest = int(max(sizes))
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(out, torch.cat([mine, mine.new_zeros(longest - len(mine))]))
    return [bytes(t[: int(n)].tolist()).decode().split("\n") for t, n in zip(out, sizes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small corpus, for tests")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dp = world // (args.cp * args.tp)
    mesh = init_device_mesh("cpu", (dp, args.cp, args.tp), mesh_dim_names=("dp", "cp", "tp"))
    n = 24 if args.quick else 200
    train, val = corpus(0, n), {"dev-clean": corpus(10_000, 12), "dev-other": corpus(20_000, 8)}

    # Epoch 0, then the validation loaders.
    dm = SpeechDataModule(mesh, train, val)
    loader = dm.train_dataloader()
    try:
        len(loader)
        unsized = torch.tensor([0])
    except TypeError:
        unsized = torch.tensor([1])
    dist.all_reduce(unsized, op=dist.ReduceOp.MIN)
    loader.set_epoch(0)
    epoch0 = []
    for batch in loader:
        step(batch, mesh)
        epoch0 += batch["cut_ids"]
    val_ids = {name: ids(v) for name, v in dm.val_dataloader().items()}

    # Epoch 1, whole; then again stopped after 2 batches, checkpointed, resumed fresh.
    whole = dm.train_dataloader()
    whole.set_epoch(1)
    epoch1 = [batch["cut_ids"] for batch in whole]
    first = SpeechDataModule(mesh, train, val).train_dataloader()
    first.set_epoch(1)
    head = []
    for batch in first:
        head.append(batch["cut_ids"])
        if len(head) == 2:
            break
    state = first.state_dict()  # the lhotse sampler's on source ranks, {} on the others
    held_by = type(first.sampler).__name__ if first.is_source else None
    checkpoint = io.BytesIO()
    torch.save({"train_loader": state}, checkpoint)
    checkpoint.seek(0)
    restored = SpeechDataModule(mesh, train, val).train_dataloader()  # as after a restart
    restored.load_state_dict(torch.load(checkpoint, weights_only=True)["train_loader"])
    tail = [batch["cut_ids"] for batch in restored]
    exact = torch.tensor([int(head + tail == epoch1)])
    dist.all_reduce(exact, op=dist.ReduceOp.MIN)

    everyone = {"epoch0": gather(epoch0), "epoch1": gather([i for b in epoch1 for i in b])}
    everyone.update({name: gather(v) for name, v in val_ids.items()})
    if dist.get_rank() == 0:
        flat = mesh.mesh.reshape(dp, -1).tolist()  # the global ranks of each (cp, tp) sub-mesh
        same = all(got[r] == got[row[0]] for got in everyone.values() for row in flat for r in row)
        reshuffled = all(everyone["epoch0"][r] != everyone["epoch1"][r] for r in range(world))
        seen = [i for row in flat for i in everyone["epoch0"][row[0]]]
        disjoint = len(seen) == len(set(seen))
        # Cuts each validation set yielded over all DP slots. They can exceed the set's size
        # (8 cuts may read 12): at the end of the data lhotse's sampler gives every DP
        # slot a batch, filling slots left short with copies of cuts (ids "..._dup0").
        counts = {name: sum(len(everyone[name][row[0]]) for row in flat) for name in val}
        print(f"ranks: {world}, mesh (dp={dp}, cp={args.cp}, tp={args.tp}), {n} training cuts")
        print(f"len(train loader) raises TypeError on every rank: {bool(unsized.item())}")
        print(f"same batches within each (cp, tp) sub-mesh: {same}")
        print(f"dp slots disjoint: {disjoint}")
        print(f"epochs reshuffled: {reshuffled}")
        print(f"validation cuts per loader: {counts}")
        print(f"state_dict held by: {held_by} ({len(state)} keys)")
        print(f"resume exact: {bool(exact.item())} (checkpoint after {len(head)} batches)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
