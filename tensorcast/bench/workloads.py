"""The built-in workloads: batches of the shapes that speech and language training send.

Every builder is deterministic (a seeded generator), so each rank can build the same
reference batch. ``quick=True`` builds the same structure at a fraction of the size,
for smoke runs in CI.

==============  ==================================================================
workload        what it is
==============  ==================================================================
audio_large     32 utterances of 30 s at 16 kHz (float32) with lengths, texts, ids
audio_medium    16 utterances of 10 s
many_small      200 small tensors of 8 dtypes in 20 groups, with small values
tiny            one step number and a 4-element tensor: the per-message overhead
gpt             a Megatron-style GPT batch: tokens, labels, loss_mask,
                attention_mask (b, 1, s, s), position_ids
audio_padded    a speech batch as lhotse's ``DynamicCutSampler`` (NeMo's default, no
                bucketing, ``max_duration=600``) and ``collate_audio`` make it:
                LibriSpeech-like durations, zero padding after ``audio_lens`` (59%)
audio_bucketed  the same from a 10-bucket ``DynamicBucketingSampler`` (10% padding)
fbank_padded    the cuts of audio_padded as ``(b, t, 80)`` log-mel features, padded
                with lhotse's ``LOG_EPSILON`` after ``features_lens`` (59%)
gpt_padded      an SFT batch padded to its longest sequence (rounded up to 64): token
                ids padded with a pad id, labels with -100, a bool attention mask (79%)
==============  ==================================================================

The padded workloads are drawn as a real loader draws them: a pass of a sampler over
20,000 drawn lengths, of which the batch whose padding share is nearest the pass's own
is the workload (:func:`padding_share` says how much of a batch's tensors is padding).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from tensorcast.codec import padding_bytes

__all__ = ["WORKLOADS", "make_workload", "next_step", "padding_share"]

WORKLOADS = (
    *("audio_large", "audio_medium", "many_small", "tiny", "gpt"),
    *("audio_padded", "audio_bucketed", "fbank_padded", "gpt_padded"),
)
_SPEECH = ("audio_large", "audio_medium", "audio_padded", "audio_bucketed", "fbank_padded")

#: what lhotse pads log-mel features with (``lhotse.features.base.LOG_EPSILON``)
LOG_EPSILON = math.log(1e-10)
PAD_ID = 50_256  # GPT-2's end of text, the usual pad of its tokenizer
IGNORE_INDEX = -100  # labels that take no loss

_WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "bold",
    "wizards",
    "quietly",
    "hum",
    "forty",
    "jazzy",
    "tunes",
    "near",
    "the",
    "old",
    "harbour",
    "at",
    "dawn",
]
_SMALL_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.float64,
)
_SMALL_SHAPES: tuple[tuple[int, ...], ...] = ((8,), (4, 16), (32,), (2, 3, 5), (), (64,), (16, 8))


def _sentence(i: int) -> str:
    words = [_WORDS[(i * 7 + k) % len(_WORDS)] for k in range(20)]
    return f"utt {i}: {' '.join(words)}"[:80]


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    low, high = (0, 256) if dtype == torch.uint8 else (-1000, 1000)
    return torch.randint(low, high, shape, generator=g).to(dtype)


def _cut_meta(n: int) -> dict[str, list[str]]:
    """The texts and cut ids of a speech batch of ``n`` cuts."""
    return {
        "text": [_sentence(i) for i in range(n)],
        "ids": [f"cut-{i:06d}-{i * 7919 % 10007:05d}" for i in range(n)],
    }


def _audio(n: int, samples: int, g: torch.Generator) -> dict[str, Any]:
    return {
        "audio": torch.randn(n, samples, generator=g),
        "audio_lens": torch.randint(samples // 2, samples + 1, (n,), generator=g),
        **_cut_meta(n),
    }


def _many_small(g: torch.Generator) -> dict[str, Any]:
    batch: dict[str, Any] = {}
    for grp in range(20):
        tensors = {}
        for j in range(10):
            k = grp * 10 + j
            shape = _SMALL_SHAPES[k % len(_SMALL_SHAPES)]
            tensors[f"t{j}"] = _random_tensor(shape, _SMALL_DTYPES[k % len(_SMALL_DTYPES)], g)
        batch[f"group{grp}"] = {
            "tensors": tensors,
            "meta": {"index": grp, "name": f"group-{grp}", "weight": grp * 10 + 3},
        }
    return batch


def _gpt(micro_batch: int, seq: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """What Megatron's ``get_batch`` hands the model: labels are the tokens shifted by one,
    a causal mask (True where attention is masked), positions 0..s-1."""
    text = torch.randint(0, 50_257, (micro_batch, seq + 1), generator=g)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)
    return {
        "tokens": text[:, :-1].contiguous(),
        "labels": text[:, 1:].contiguous(),
        "loss_mask": (text[:, 1:] != 0).float(),
        "attention_mask": causal.expand(micro_batch, 1, seq, seq).contiguous(),
        "position_ids": torch.arange(seq).expand(micro_batch, seq).contiguous(),
    }


def _librispeech_durations(rng: np.random.Generator, count: int = 20_000) -> np.ndarray:
    """Utterance durations (s) drawn like LibriSpeech's: lognormal around 12 s (median 11,
    mean about 12.2), clipped to [1, 35]."""
    return np.clip(rng.lognormal(math.log(11.0), 0.45, count), 1.0, 35.0)


def _dynamic_batches(durations: np.ndarray, max_duration: float) -> list[np.ndarray]:
    """The batches lhotse's ``DynamicCutSampler`` makes of cuts in this order: cuts are
    added while their total stays within ``max_duration``."""
    batches, start, total = [], 0, 0.0
    for i, d in enumerate(durations.tolist()):
        if i > start and total + d > max_duration:
            batches.append(durations[start:i])
            start, total = i, 0.0
        total += d
    batches.append(durations[start:])
    return batches


def _bucketed_batches(durations: np.ndarray, max_duration: float, buckets: int) -> list[np.ndarray]:
    """The batches of a ``DynamicBucketingSampler``: buckets of equal total duration
    (lhotse's ``estimate_duration_buckets``), each batched as :func:`_dynamic_batches`."""
    ordered = np.sort(durations)
    edges = np.searchsorted(np.cumsum(ordered), ordered.sum() * np.arange(1, buckets) / buckets)
    bins = np.searchsorted(ordered[edges], durations, side="right")
    return [b for k in range(buckets) for b in _dynamic_batches(durations[bins == k], max_duration)]


def _typical(batches: list[np.ndarray], pad_to: float = 0.0) -> np.ndarray:
    """The batch whose padding share (each padded to its longest, rounded up to a multiple
    of ``pad_to``) is nearest that of the whole pass."""
    longest = [math.ceil(b.max() / pad_to) * pad_to if pad_to else b.max() for b in batches]
    padded = np.array([len(b) * m for b, m in zip(batches, longest)])
    held = np.array([b.sum() for b in batches])
    overall = 1 - held.sum() / padded.sum()
    return batches[int(np.argmin(np.abs(1 - held / padded - overall)))]


def _padded_audio(durations: np.ndarray, rate: int, g: torch.Generator) -> dict[str, Any]:
    """``collate_audio``'s output for cuts of these durations: random samples, zeros after
    each cut's length."""
    lens = torch.from_numpy(np.round(durations * rate).astype(np.int64))
    audio = torch.randn(len(lens), int(lens.max()), generator=g)
    audio.masked_fill_(torch.arange(audio.shape[1]) >= lens[:, None], 0.0)
    return {"audio": audio, "audio_lens": lens, **_cut_meta(len(lens))}


def _padded_fbank(durations: np.ndarray, frame_rate: int, g: torch.Generator) -> dict[str, Any]:
    """80-bin log-mel features of cuts of these durations, padded with ``LOG_EPSILON``
    after each cut's frames, as lhotse's ``collate_features`` pads them."""
    lens = torch.from_numpy(np.round(durations * frame_rate).astype(np.int64))
    feats = torch.randn(len(lens), int(lens.max()), 80, generator=g).mul_(2.0).sub_(6.0)
    feats.masked_fill_((torch.arange(feats.shape[1]) >= lens[:, None]).unsqueeze(2), LOG_EPSILON)
    return {"features": feats, "features_lens": lens, **_cut_meta(len(lens))}


def _padded_gpt(
    rng: np.random.Generator, micro_batch: int, median: float, g: torch.Generator
) -> dict[str, torch.Tensor]:
    """An SFT batch: sequence lengths drawn lognormal (clipped to [32, 8192]), padded to
    the longest rounded up to 64; labels are the next tokens, -100 where padded."""
    drawn = np.clip(rng.lognormal(math.log(median), 0.9, 20_000), 32, 8192).round()
    batches = [drawn[i : i + micro_batch] for i in range(0, len(drawn), micro_batch)]
    lens = torch.from_numpy(_typical(batches, pad_to=64).astype(np.int64))
    seq = math.ceil(int(lens.max()) / 64) * 64
    text = torch.randint(0, PAD_ID, (len(lens), seq + 1), generator=g)
    real = torch.arange(seq) < lens[:, None]
    return {
        "tokens": text[:, :-1].masked_fill(~real, PAD_ID),
        "labels": text[:, 1:].masked_fill(~real, IGNORE_INDEX),
        "attention_mask": real,
    }


def padding_share(batch: dict[str, Any]) -> float:
    """The share of a workload's tensor bytes that is padding: the trailing runs of its
    tensors' rows that trimming would drop (``tensorcast.codec.padding_bytes``)."""
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    runs = sum(padding_bytes(t) for t in tensors if t.dim() >= 2)
    return runs / sum(t.nbytes for t in tensors)


def make_workload(name: str, *, quick: bool = False) -> Any:
    """The batch of workload ``name`` (a smaller one of the same structure with ``quick``).

    Raises:
        ValueError: ``name`` is not a built-in workload.
    """
    g = torch.Generator().manual_seed(1234)
    if name == "audio_large":
        return _audio(32, 16_000 if quick else 480_000, g)
    if name == "audio_medium":
        return _audio(16, 4_000 if quick else 160_000, g)
    if name == "many_small":
        return _many_small(g)
    if name == "tiny":
        return {"step": 7, "x": torch.randn(4, generator=g)}
    if name == "gpt":
        return _gpt(2, 256, g) if quick else _gpt(4, 2048, g)
    rng = np.random.default_rng(1234)
    if name in ("audio_padded", "fbank_padded"):
        cuts = _typical(_dynamic_batches(_librispeech_durations(rng), 600.0))
        if name == "fbank_padded":
            return _padded_fbank(cuts, 10 if quick else 100, g)
        return _padded_audio(cuts, 1_000 if quick else 16_000, g)
    if name == "audio_bucketed":
        cuts = _typical(_bucketed_batches(_librispeech_durations(rng), 600.0, 10))
        return _padded_audio(cuts, 1_000 if quick else 16_000, g)
    if name == "gpt_padded":
        return _padded_gpt(rng, 8, 100.0, g) if quick else _padded_gpt(rng, 32, 600.0, g)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def next_step(name: str, batch: Any, step: int) -> None:
    """Turn ``batch`` into the workload's batch of training step ``step``, in place: new
    small values (a step number, ids), the same structure, dtypes and shapes, as the
    batches of a real loader differ from one step to the next."""
    if name in _SPEECH:
        ids = batch["ids"]
        for i in range(len(ids)):
            ids[i] = f"cut-{step:06d}-{(step * 32 + i) * 7919 % 10007:05d}"
    elif name == "many_small":
        for grp in range(20):
            batch[f"group{grp}"]["meta"]["index"] = step * 20 + grp
    elif name == "tiny":
        batch["step"] = step
