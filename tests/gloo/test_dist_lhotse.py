"""lhotse batches through BroadcastingDataLoader on real gloo groups.

- The batch shapes speech datasets yield travel as they are, to every rank of a (cp, tp)
  mesh: NeMo's ASR tuple, a prompted-ASR dataclass, a dict of metadata, lhotse's
  K2SpeechRecognitionDataset with ``return_cuts=True``, and ``None``.
- Resume: a pass stopped mid-epoch, saved and restored into fresh loaders on every rank,
  equals one uninterrupted pass on every rank (torchdata's ``_run_and_checkpoint``).
"""

from __future__ import annotations

import gc
import hashlib
import io
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from cuts import memory_cut, same
from lhotse import CutSet
from lhotse.cut import Cut
from lhotse.dataset import DynamicBucketingSampler, K2SpeechRecognitionDataset
from lhotse.dataset.collation import collate_audio, collate_vectors
from lhotse.dataset.input_strategies import AudioSamples
from rankpool import RankPool, may_start_workers
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

import tensorcast as tc

TIMEOUT = 120.0


@dataclass
class PromptedAudioBatch:
    """The shape of NeMo's prompted ASR mini-batch (canary-style)."""

    audio: torch.Tensor
    audio_lens: torch.Tensor
    prompt: torch.Tensor
    prompt_lens: torch.Tensor
    transcript: list[str]
    languages: list[str]
    cuts: CutSet


# Both sides register the type; the rank processes import this module to run its functions.
tc.register_type(PromptedAudioBatch, name="tests.PromptedAudioBatch")


def corpus(n: int, *, seed: int = 0) -> CutSet:
    """In-memory cuts of 0.1-0.5 s with token ids in ``custom``, as NeMo keeps them."""
    rng = np.random.default_rng(seed)
    return CutSet(
        [
            memory_cut(
                seed * 1000 + i, float(rng.integers(1, 6)) / 10, tokens=int(rng.integers(2, 9))
            )
            for i in range(n)
        ]
    )


def speech_batches() -> list[Any]:
    """One batch of each shape; built the same way on every rank (ids are deterministic)."""
    cuts = corpus(6)
    padded = cuts[0].pad(duration=0.8)
    padded.id = "padded-0"  # MixedCut and PaddingCut ids are random by default
    padded.tracks[1].cut.id = "padding-0"
    part = CutSet([*cuts.subset(first=3), padded])
    audio, audio_lens = collate_audio(part)
    token_list = [torch.from_numpy(c.custom["tokens"]) for c in cuts.subset(first=3)]
    tokens = collate_vectors(token_list, padding_value=0)
    token_lens = torch.tensor([t.numel() for t in token_list])
    nemo_asr = (audio[:3], audio_lens[:3], tokens, token_lens, cuts.subset(first=3))
    prompted = PromptedAudioBatch(
        audio=audio,
        audio_lens=audio_lens,
        prompt=torch.tensor([[4, 8, 15], [16, 23, 42], [1, 2, 3], [0, 0, 0]]),
        prompt_lens=torch.tensor([3, 3, 3, 0]),
        transcript=[
            c.supervisions[0].text if isinstance(c, Cut) and c.supervisions else "" for c in part
        ],
        languages=["en", "de", "en", "fr"],
        cuts=part,
    )
    metadata = {
        "audio": audio,
        "audio_lens": audio_lens,
        "ids": [c.id for c in part],
        "metadata": [
            {
                "duration": c.duration,
                "num_samples": c.num_samples,
                "lang": "en",
                "speaker": None,
                "offset": 0.0,
            }
            for c in part
        ],
    }
    k2 = K2SpeechRecognitionDataset(return_cuts=True, input_strategy=AudioSamples())
    k2_batch = k2[cuts.subset(last=3)]
    return [nemo_asr, prompted, None, metadata, k2_batch, None]


def digest(tree: Any) -> str:
    """A fingerprint of a batch: structure, types, every byte, and every cut's audio."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        h.update(type(x).__qualname__.encode())
        if isinstance(x, dict):
            for k, v in x.items():
                h.update(repr(k).encode())
                walk(v)
        elif isinstance(x, (list, tuple)):
            h.update(str(len(x)).encode())
            for v in x:
                walk(v)
        elif isinstance(x, torch.Tensor):
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, np.ndarray):
            h.update(f"{x.dtype}{x.shape}".encode() + x.tobytes())
        elif isinstance(x, Cut):
            walk(x.to_dict())
            walk(x.load_audio())
        elif isinstance(x, CutSet):
            walk(list(x))
        elif is_dataclass(x):
            for f in fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, float):
            h.update(struct.pack("<d", x))
        else:
            h.update(repr(x).encode())

    walk(tree)
    return h.hexdigest()


def _speech_shapes(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    want = speech_batches()
    source = want if tc.is_dp_source_rank(mesh) else None
    loader = tc.BroadcastingDataLoader(
        source=source, device_mesh=mesh, axes=("cp", "tp"), prefetch=1
    )
    got = list(loader)
    assert len(got) == len(want), (len(got), len(want))
    for i, (w, g) in enumerate(zip(want, got)):
        same(w, g, f"batch{i}")  # against this rank's own copy of what the source sent
    nemo, prompted, none, meta, k2, _ = got
    assert none is None and type(nemo) is tuple and type(prompted) is PromptedAudioBatch
    assert isinstance(nemo[4], CutSet) and isinstance(prompted.cuts, CutSet)
    assert all(isinstance(c, Cut) for c in k2["supervisions"]["cut"])
    assert type(meta["metadata"][0]) is dict and type(meta["ids"][0]) is str
    return [digest(b) for b in got]


def test_speech_batch_shapes_reach_every_rank_of_a_cp_tp_mesh(pool4: RankPool) -> None:
    results = pool4.run(_speech_shapes, timeout=TIMEOUT)
    assert results == [[digest(b) for b in speech_batches()]] * 4


# -- resume ---------------------------------------------------------------------------------


class SamplerStateLoader:
    """A ``DataLoader(num_workers=0)`` whose checkpoint is its lhotse sampler's state.

    With no workers, the DataLoader asks the sampler for a batch only when it yields one,
    so the sampler's state is exactly the position of the loop.
    """

    def __init__(self, loader: DataLoader[Any], sampler: DynamicBucketingSampler) -> None:
        if loader.num_workers:
            raise ValueError("with workers the sampler runs ahead; use StatefulDataLoader")
        self.loader = loader
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(dict(state))  # lhotse pops the keys it reads


def _source(kind: str) -> Any:
    # Under TP/CP the sampler shards by DP slot: lhotse's default would be the global world.
    sampler = DynamicBucketingSampler(
        corpus(24, seed=1),
        max_duration=1.2,
        num_buckets=2,
        shuffle=True,
        seed=7,
        world_size=1,
        rank=0,
    )
    dataset = K2SpeechRecognitionDataset(return_cuts=True, input_strategy=AudioSamples())
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        # fork: spawned workers would import torch again, seconds each on a busy machine
        return StatefulDataLoader(
            dataset, sampler=sampler, batch_size=None, num_workers=2, multiprocessing_context="fork"
        )
    return SamplerStateLoader(DataLoader(dataset, sampler=sampler, batch_size=None), sampler)


def _checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """What a trainer does with the state: torch.save, then torch.load(weights_only=True)."""
    out = io.BytesIO()
    torch.save(state, out)
    out.seek(0)
    return torch.load(out, weights_only=True)  # type: ignore[no-any-return]


def _resume(rank: int, world: int, kind: str, stop_after: int, save_s: float) -> dict[str, Any]:
    with may_start_workers():
        return _resume_pass(kind, stop_after, save_s)


def _resume_pass(kind: str, stop_after: int, save_s: float) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("cp", "tp"))

    def fresh() -> tc.BroadcastingDataLoader:
        return tc.BroadcastingDataLoader(
            source=_source(kind) if tc.is_dp_source_rank(mesh) else None,
            device_mesh=mesh,
            axes=("cp", "tp"),
            prefetch=1,
        )

    whole = [digest(b) for b in fresh()]
    loader = fresh()
    it = iter(loader)
    taken = [b for _, b in zip(range(stop_after), it)]
    state = loader.state_dict()
    if loader.is_source:
        time.sleep(save_s)  # writing the checkpoint takes a while; the receivers have none
    it.close()  # stop mid-epoch on every rank after the same batch
    first = [digest(b) for b in taken]
    state = _checkpoint(state)
    restored = fresh()
    restored.load_state_dict(state)
    second = [digest(b) for b in restored]
    del loader, restored  # shuts the first half's DataLoader workers down
    gc.collect()
    return {"whole": whole, "first": first, "second": second, "state": state}


@pytest.mark.parametrize(
    ("kind", "save_s"),
    [("dataloader", 0.0), ("dataloader", 0.3), ("stateful", 0.0)],
    ids=["dataloader", "dataloader-slow-save", "stateful-dataloader-2-workers"],
)
def test_resume_mid_epoch_equals_one_uninterrupted_epoch(
    pool2: RankPool, kind: str, save_s: float
) -> None:
    """Stop after 3 batches, checkpoint, restore into fresh loaders on every rank: the two
    halves equal one uninterrupted epoch on every rank, with prefetch=1."""
    if kind == "stateful":
        pytest.importorskip("torchdata.stateful_dataloader")
    stop_after = 3
    results = pool2.run(_resume, kind, stop_after, save_s, timeout=TIMEOUT)
    whole = results[0]["whole"]
    assert len(whole) > stop_after + 1
    assert len(set(whole)) == len(whole)  # distinct batches: a skip or repeat would show
    for r in results:
        assert r["whole"] == whole  # every rank received the same epoch
        assert r["first"] + r["second"] == whole
    assert results[0]["state"] and results[1]["state"] == {}  # the source holds the state


# -- a source loader that cannot start --------------------------------------------------------


class _CannotStart:
    """A loader whose ``iter()`` raises, as a DataLoader does when its workers cannot start."""

    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("DataLoader worker (pid 4242) exited unexpectedly")


def _cannot_start(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("cp", "tp"))
    source = _CannotStart() if tc.is_dp_source_rank(mesh) else None
    # a short collective timeout: a receiver left waiting fails in seconds, not minutes
    loader = tc.BroadcastingDataLoader(source=source, device_mesh=mesh, timeout=10.0)
    try:
        for _ in loader:
            raise AssertionError("no batch was expected")
    except tc.SourceError as e:
        return f"SourceError: {e}"
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()  # a receiver that timed out leaves the group unusable
    return "no error"


def test_source_loader_that_cannot_start_is_reported_to_receivers(pool2: RankPool) -> None:
    """Contract 3.4: the source re-raises; receivers get SourceError, not a timeout."""
    source, receiver = pool2.run(_cannot_start, timeout=TIMEOUT)
    assert source == "RuntimeError: DataLoader worker (pid 4242) exited unexpectedly"
    assert receiver.startswith("SourceError: ")
    assert "source iterator failed" in receiver and "RuntimeError" in receiver
    assert "DataLoader worker (pid 4242) exited unexpectedly" in receiver
