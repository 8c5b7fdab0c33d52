"""Small in-memory lhotse cuts, and bit-for-bit equality of trees that hold them.

"Equal" means: the same type, a ``to_dict()`` equal bit for bit (types, floats and array
bytes included), and for cuts the same audio when loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import struct
from typing import Any

import numpy as np
import soundfile as sf
import torch
from lhotse import CutSet, MonoCut, Recording, SupervisionSegment
from lhotse.cut import Cut

SR = 8000


@functools.cache
def wav_bytes(seed: int, num_samples: int, channels: int = 1, fmt: str = "WAV") -> bytes:
    """A small PCM-16 audio file, in memory, with deterministic noise."""
    rng = np.random.default_rng(seed)
    audio = (rng.standard_normal((num_samples, channels)) * 0.1).astype(np.float32)
    out = io.BytesIO()
    sf.write(out, audio, SR, format=fmt, subtype="PCM_16")
    return out.getvalue()


def memory_cut(seed: int, seconds: float, *, text: str = "", tokens: int = 0) -> MonoCut:
    """An in-memory MonoCut with one supervision and, optionally, NeMo-style token ids."""
    rec = Recording.from_bytes(wav_bytes(seed, round(seconds * SR)), recording_id=f"rec-{seed}")
    cut = rec.to_cut()
    cut.supervisions = [
        SupervisionSegment(
            id=f"sup-{seed}",
            recording_id=rec.id,
            start=0.0,
            duration=rec.duration,
            channel=0,
            text=text or f"utterance {seed}",
            language="en",
        )
    ]
    if tokens:
        cut.custom = {"tokens": np.arange(tokens, dtype=np.int64) + seed}
    return cut


def same(a: Any, b: Any, where: str = "x") -> None:
    """Assert ``a`` and ``b`` are equal bit for bit: types, structure, floats and bytes."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype}{a.shape}"
        assert a.tobytes() == b.tobytes(), f"{where}: array bytes differ"
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype}{a.shape}"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, (Cut, Recording, SupervisionSegment)):
        same(a.to_dict(), b.to_dict(), where)
    elif isinstance(a, CutSet):
        same(list(a), list(b), where)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
