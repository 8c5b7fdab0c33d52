"""Equality of batch trees as the contract means it, for tests of every layer.

``assert_same`` checks same types, same structure, same key order, tensors and ndarrays
byte for byte, floats bit for bit (without recursion: any depth).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np
import torch

import tensorcast as tc


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t`` in C order (works for 0-d tensors and every dtype)."""
    # A fresh tensor has canonical strides; .contiguous() may keep a size-1 dim's odd stride.
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)  # a bool copy would turn bytes other than 0 / 1 into 1
    fresh = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    return fresh.reshape(-1).view(torch.uint8).numpy().tobytes()


def float_bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _registered_fields(obj: Any) -> list[Any] | None:
    """The field values of a NamedTuple or dataclass instance, else None."""
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        return list(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return None


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a tree of dicts, lists, tuples and dataclasses, without recursion."""
    found: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return found


def assert_same(got: Any, want: Any, where: str = "batch") -> None:
    """``got == want`` as the contract means it, checked without recursion.

    Same types everywhere (a tuple stays a tuple, ``True`` never becomes ``1``), same
    key order, tensors and ndarrays equal byte for byte (NaN payloads and -0.0 count),
    floats and complex numbers equal bit for bit.
    """
    stack: list[tuple[Any, Any, str]] = [(got, want, where)]
    while stack:
        a, b, where = stack.pop()
        assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
            assert a.shape == b.shape, f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}"
            assert tensor_bytes(a) == tensor_bytes(b), f"{where}: tensor bytes differ"
        elif isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape}"
            assert a.tobytes() == b.tobytes(), f"{where}: array bytes differ"
        elif isinstance(b, (np.str_, np.bytes_)):
            # Compared as the str / bytes they are: their repr and item() drop trailing
            # NULs, and tobytes() of an empty one is itemsize bytes of any memory.
            base = str if isinstance(b, np.str_) else bytes
            assert a.dtype == b.dtype and base(a[:]) == base(b[:]), f"{where}: {a!r} != {b!r}"
        elif isinstance(b, np.generic):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{where}: {a!r} != {b!r}"
        elif type(b) is float:
            assert float_bits(a) == float_bits(b), f"{where}: {a!r} != {b!r} (bits)"
        elif type(b) is complex:
            assert (float_bits(a.real), float_bits(a.imag)) == (
                float_bits(b.real),
                float_bits(b.imag),
            ), f"{where}: {a!r} != {b!r} (bits)"
        elif isinstance(b, dict):
            assert list(a) == list(b), f"{where}: keys {list(a)!r:.200} != {list(b)!r:.200}"
            assert [type(k) for k in a] == [type(k) for k in b], f"{where}: key types differ"
            for k in reversed(list(b)):
                stack.append((a[k], b[k], f"{where}[{k!r}]"))
        elif (fields := _registered_fields(b)) is not None:
            mine = _registered_fields(a)
            assert mine is not None and len(mine) == len(fields), where
            for i in range(len(fields) - 1, -1, -1):
                stack.append((mine[i], fields[i], f"{where}.{i}"))
        elif isinstance(b, (list, tuple)):
            assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
            for i in range(len(b) - 1, -1, -1):
                stack.append((a[i], b[i], f"{where}[{i}]"))
        else:
            assert a == b, f"{where}: {a!r:.200} != {b!r:.200}"


def buffer_range(packed: tc.Packed) -> tuple[int, int]:
    start = packed.buffer.data_ptr()
    return start, start + packed.nbytes


def is_view_into(t: torch.Tensor, packed: tc.Packed) -> bool:
    lo, hi = buffer_range(packed)
    ptr = t.data_ptr()
    n = t.numel() * t.element_size()
    return t.untyped_storage().data_ptr() == packed.buffer.untyped_storage().data_ptr() and (
        lo <= ptr and ptr + n <= hi
    )

