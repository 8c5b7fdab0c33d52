"""A real lhotse pipeline with trimmed leaves, on 2 gloo ranks (issue 34).

WAV files of different durations, lhotse cuts read from them, ``K2SpeechRecognitionDataset``
(and ``collate_audio`` in a collate function), a DataLoader with 2 workers that hand out
``tc.packed_collate()`` batches, through ``BroadcastingDataLoader``: every rank gets every
batch bit for bit, cuts included, with trimming on; and ``loader.stats().bytes`` shows the
padding did not travel (fewer bytes than with ``trim=False``).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cuts import SR, same, wav_bytes
from lhotse import CutSet, Recording, SupervisionSegment
from lhotse.cut import Cut
from lhotse.dataset import K2SpeechRecognitionDataset, SimpleCutSampler
from lhotse.dataset.collation import collate_audio
from lhotse.dataset.input_strategies import AudioSamples
from rankpool import RankPool, may_start_workers
from torch.utils.data import DataLoader

import tensorcast as tc

pytestmark = pytest.mark.dist
TIMEOUT = 90.0
#: seconds per file: batches of 4 whose audio (1-1.2 MB) is 40-50% padding, enough for a
#: host receiver's rule to trim it (it must save 256 KiB plus 24 KiB a row, and 35%)
DURATIONS = [1.6, 8.0, 2.4, 6.4, 1.2, 9.6, 3.2, 4.8]


@pytest.fixture(scope="module")
def wav_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("wavs")
    for i, seconds in enumerate(DURATIONS):
        (root / f"utt-{i:02d}.wav").write_bytes(wav_bytes(500 + i, round(seconds * SR)))
    return str(root)


def corpus(root: str) -> CutSet:
    """Cuts of the WAV files, each with a supervision: the same on every rank."""
    cuts = []
    for path in sorted(Path(root).glob("*.wav")):
        rec = Recording.from_file(path)
        cut = rec.to_cut()
        cut.supervisions = [
            SupervisionSegment(
                id=f"sup-{rec.id}", recording_id=rec.id, start=0.0, duration=rec.duration,
                channel=0, text=f"text of {rec.id}", language="en",
            )
        ]  # fmt: skip
        cuts.append(cut)
    return CutSet(cuts)


def collate_cuts(cuts: list[Cut]) -> dict[str, Any]:
    """A NeMo-style collate: lhotse's ``collate_audio`` (zeros after each cut's samples)."""
    audio, audio_lens = collate_audio(CutSet(cuts))
    return {"audio": audio, "audio_lens": audio_lens, "ids": [c.id for c in cuts]}


def _k2_source(root: str, workers: int, collate: Any) -> DataLoader[Any]:
    dataset = K2SpeechRecognitionDataset(return_cuts=True, input_strategy=AudioSamples())
    # the whole corpus: lhotse's default would shard it by the global world's rank
    sampler = SimpleCutSampler(corpus(root), max_cuts=4, shuffle=False, world_size=1, rank=0)
    # fork: spawned workers would import torch again, seconds each on a busy machine
    context = "fork" if workers else None
    return DataLoader(
        dataset, sampler=sampler, batch_size=None, num_workers=workers, collate_fn=collate,
        multiprocessing_context=context,
    )  # fmt: skip


def _audio_source(root: str, workers: int, collate: Any) -> DataLoader[Any]:
    context = "fork" if workers else None
    return DataLoader(
        list(corpus(root)), batch_size=4, num_workers=workers, collate_fn=collate,
        multiprocessing_context=context,
    )  # fmt: skip


SOURCES = {"k2": _k2_source, "collate_audio": _audio_source}


def _pipeline(rank: int, world: int, root: str, kind: str) -> dict[str, Any]:
    """Every rank: the expected batches built here (no workers, no packing), then the
    pipeline through the loader with trim on and off, checked batch by batch."""
    plain = {"k2": lambda batch: batch, "collate_audio": collate_cuts}[kind]
    want = list(SOURCES[kind](root, 0, plain))
    out: dict[str, Any] = {"batches": len(want), "tensor_bytes": 0}
    for batch in want:
        leaves = [batch["inputs"]] if kind == "k2" else [batch["audio"], batch["audio_lens"]]
        out["tensor_bytes"] += sum(t.nbytes for t in leaves)
    with may_start_workers():
        for trim in (True, False):
            packed = tc.packed_collate(None if kind == "k2" else collate_cuts, trim=trim)
            source = SOURCES[kind](root, 2, packed) if rank == 0 else None
            loader = tc.BroadcastingDataLoader(
                source, group=dist.group.WORLD, src=0, prefetch=1, trim=trim
            )
            got = list(loader)  # every batch kept: none overwrites an earlier one
            assert len(got) == len(want), (len(got), len(want))
            for i, (g, w) in enumerate(zip(got, want)):
                same(g, w, f"rank {rank} trim={trim} batch {i}")
            out[trim] = loader.stats().bytes
            del loader, source, got
            gc.collect()  # the DataLoader's workers go now
    return out


@pytest.mark.parametrize("kind", list(SOURCES))
def test_a_lhotse_pipeline_is_bit_identical_with_trimming(
    pool2: RankPool, wav_dir: str, kind: str
) -> None:
    results = pool2.run(_pipeline, wav_dir, kind, timeout=TIMEOUT)
    assert results[0]["batches"] == 2
    for rank, r in enumerate(results):
        assert r[False] >= r["tensor_bytes"], (rank, r)  # every padded byte travelled
        assert r[True] <= 0.75 * r[False], (rank, r)  # the padding (40-50%) did not
    assert results[0][True] == results[1][True] and results[0][False] == results[1][False]


def test_the_batches_are_padded_as_the_test_says(wav_dir: str) -> None:
    """The premise: each batch's audio is 40-50% zeros after the cuts' samples."""
    for batch in _audio_source(wav_dir, 0, collate_cuts):
        audio, lens = batch["audio"], batch["audio_lens"]
        share = 1 - lens.sum().item() / audio.numel()
        assert 0.4 <= share <= 0.55, share
        assert torch.all(audio[torch.arange(audio.shape[1]) >= lens[:, None]] == 0)
