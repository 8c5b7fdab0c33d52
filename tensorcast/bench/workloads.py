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
==============  ==================================================================
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["WORKLOADS", "make_workload", "next_step"]

WORKLOADS = ("audio_large", "audio_medium", "many_small", "tiny", "gpt")

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


def _audio(n: int, samples: int, g: torch.Generator) -> dict[str, Any]:
    return {
        "audio": torch.randn(n, samples, generator=g),
        "audio_lens": torch.randint(samples // 2, samples + 1, (n,), generator=g),
        "text": [_sentence(i) for i in range(n)],
        "ids": [f"cut-{i:06d}-{i * 7919 % 10007:05d}" for i in range(n)],
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
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def next_step(name: str, batch: Any, step: int) -> None:
    """Turn ``batch`` into the workload's batch of training step ``step``, in place: new
    small values (a step number, ids), the same structure, dtypes and shapes, as the
    batches of a real loader differ from one step to the next."""
    if name in ("audio_large", "audio_medium"):
        ids = batch["ids"]
        for i in range(len(ids)):
            ids[i] = f"cut-{step:06d}-{(step * 32 + i) * 7919 % 10007:05d}"
    elif name == "many_small":
        for grp in range(20):
            batch[f"group{grp}"]["meta"]["index"] = step * 20 + grp
    elif name == "tiny":
        batch["step"] = step
