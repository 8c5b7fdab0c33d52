"""Batch trees for tests of every layer, and their equality as the contract means it.

``assert_same`` checks same types, same structure, same key order, tensors and ndarrays
byte for byte, floats bit for bit (without recursion: any depth); ``canon`` / ``digest``
/ ``check_same`` compare trees that crossed a process. ``every_kind`` is one of
everything that travels; ``steady_batch`` and ``payload_batch`` are sequences whose
header, then payload, change as they go.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import struct
from collections import OrderedDict
from typing import Any, NamedTuple

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


def padded_audio(rows: int = 8, n: int = 200_000, seed: int = 0) -> dict[str, Any]:
    """A speech batch whose rows end in zeros from a random length on: trimmed on the wire."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    lens = torch.randint(n // 10, n // 2, (rows,), generator=g)
    for i, length in enumerate(lens.tolist()):
        x[i, length:] = 0
    return {"audio": x, "audio_lens": lens, "id": [f"cut-{seed}"]}


def batch_past_4_gib() -> dict[str, Any]:
    """A batch over 4 GiB of stride-0 tensors, so nothing is allocated: a leaf that
    crosses 2 GiB, one of 4 GiB that ends past 6 GiB, and leaves after them."""
    u8 = torch.zeros(1, dtype=torch.uint8)
    f32 = torch.zeros(1, dtype=torch.float32)
    return {
        "head": torch.ones(3, dtype=torch.int8),
        "g2": u8.expand((1 << 31) + 3),  # crosses 2 GiB
        "g4": f32.expand(1 << 30),  # 4 GiB on its own, ends past 6 GiB
        "tail": torch.ones(5, dtype=torch.float64),
        "text": "y" * 5000,
    }


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


# -- registered container types (registered on import, so in every rank too) ------------


class Span(NamedTuple):
    start: int
    stop: torch.Tensor


@dataclasses.dataclass
class Utterance:
    text: str
    audio: torch.Tensor
    spans: list[Span]


tc.register_type(Span, name="tests.Span")
tc.register_type(Utterance, name="tests.Utterance")


# -- canonical form: equal iff bit-identical, same types, same structure ------------------


def _sha(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def canon(tree: Any) -> list[tuple[str, Any]]:
    """``(path, description)`` per node in preorder; tensors and arrays by digest of their bytes."""
    out: list[tuple[str, Any]] = []
    stack: list[tuple[str, Any]] = [("", tree)]
    while stack:
        path, x = stack.pop()
        kind = f"{type(x).__module__}.{type(x).__qualname__}"
        children: list[tuple[str, Any]] = []
        if isinstance(x, torch.Tensor):
            desc: Any = (str(x.dtype), tuple(x.shape), x.device.type, _sha(tensor_bytes(x)))
        elif isinstance(x, np.ndarray):
            desc = (x.dtype.str, x.shape, _sha(np.ascontiguousarray(x).tobytes()))
        elif isinstance(x, np.generic):
            desc = (x.dtype.str, x.tobytes())
        elif type(x) is float:
            desc = struct.pack("<d", x)
        elif type(x) is complex:
            desc = struct.pack("<dd", x.real, x.imag)
        elif x is None or type(x) in (bool, int, str, bytes):
            desc = x
        elif isinstance(x, dict):
            desc = [(type(k).__name__, k) for k in x]
            children = [(f"{path}[{k!r}]", v) for k, v in x.items()]
        elif isinstance(x, tuple) and hasattr(x, "_fields"):
            desc = tuple(x._fields)
            children = [(f"{path}.{f}", getattr(x, f)) for f in x._fields]
        elif dataclasses.is_dataclass(x):
            names = [f.name for f in dataclasses.fields(x)]
            desc = tuple(names)
            children = [(f"{path}.{f}", getattr(x, f)) for f in names]
        elif isinstance(x, (list, tuple)):
            desc = len(x)
            children = [(f"{path}[{i}]", v) for i, v in enumerate(x)]
        else:
            raise TypeError(f"canon: unexpected {kind} at {path!r}")
        out.append((path, (kind, desc)))
        stack.extend(reversed(children))
    return out


def digest(tree: Any) -> str:
    return _sha(repr(canon(tree)).encode())


def check_same(got: Any, want: Any, what: str) -> None:
    """Raise with the first differing node's path, not a wall of bytes."""
    a, b = canon(got), canon(want)
    for x, y in zip(a, b, strict=False):
        if x != y:
            raise AssertionError(
                f"{what}: differs at {x[0]!r}: got {x[1]!r:.300}, want {y[1]!r:.300}"
            )
    if len(a) != len(b):
        raise AssertionError(f"{what}: {len(a)} nodes received, {len(b)} expected")


# -- the trees ----------------------------------------------------------------------------

# fmt: off
_TORCH_DTYPES = [
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
]
_NUMPY_DTYPES = [
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "float32", "float64", "complex64", "complex128",
]
# fmt: on


def _nan_with_payload() -> float:
    return float(struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0])


def every_kind() -> dict[str, Any]:
    """One of everything the contract says travels: dtypes, shapes, leaves, containers."""
    g = torch.Generator().manual_seed(7)
    tensors: dict[str, Any] = {}
    for name in _TORCH_DTYPES:
        if not hasattr(torch, name):
            continue
        dtype = getattr(torch, name)
        size = torch.empty((), dtype=dtype).element_size()
        if dtype is torch.bool:
            t = torch.randint(0, 2, (3, 8), generator=g).bool()
        else:  # random bytes: NaN payloads, -0.0 and subnormals included
            t = torch.randint(0, 256, (3, 8 * size), dtype=torch.uint8, generator=g).view(dtype)
        tensors[name] = {
            "plain": t,
            "transposed": t.t(),  # arrives contiguous, same values
            "scalar": t.reshape(-1)[5],
            "empty": t[:, :0],
        }
    rng = np.random.default_rng(7)
    arrays: dict[str, Any] = {}
    for name in _NUMPY_DTYPES:
        if name == "bool":
            a = rng.integers(0, 2, size=32).astype(np.bool_)
        else:
            a = rng.integers(0, 256, size=32 * np.dtype(name).itemsize, dtype=np.uint8).view(name)
        arrays[name] = {
            "plain": a.reshape(4, -1),
            "strided": a[::3],
            "zero_d": a[:1].reshape(()),
            "empty": a[:0],
        }
    deep: Any = torch.tensor([1.0])
    for _ in range(200):
        deep = [deep]
    return {
        "tensors": tensors,
        "arrays": arrays,
        "small": [
            None,
            True,
            False,
            0,
            -1,
            2**63,
            -(2**70),
            2**300,
            1.5,
            -0.0,
            float("inf"),
            _nan_with_payload(),
            complex(1.0, -0.0),
            "",
            "text",
            "\u00fcn\u00efc\u00f6d\u00e9 \U0001f600",
            "long " * 1000,
            b"",
            b"\x00\xff",
            bytes(range(256)) * 12,
            np.float32(1.5),
            np.int64(-3),
            np.bool_(True),
            np.complex64(1 + 2j),
            np.uint16(7),
        ],
        "keys": {0: "int", True: "bool", None: "none", "s": "str"},
        "ordered": OrderedDict([("b", 1), ("a", torch.zeros(2))]),
        "tuple": (1, (2, ()), []),
        "empty": [{}, (), []],
        "registered": Utterance(
            "hi",
            torch.arange(5, dtype=torch.int16),
            [Span(0, torch.tensor(3)), Span(3, torch.tensor(5))],
        ),
        "deep": deep,
    }


def tiny() -> dict[str, Any]:
    return {"ids": torch.arange(4), "flag": True, "name": "x"}


def big_header() -> dict[str, Any]:
    """A header well over 256 KiB and no buffer at all (every str is under the inline limit)."""
    return {"words": [f"{i:05d}" + "w" * 1000 for i in range(300)], "n": 300}


def steady_batch(step: int) -> Any:
    """Batches whose header repeats for a while, then changes: a small value, a shape, a
    dtype, a bytes leaf, an ndarray; and last, one structure whose small values change
    every step."""
    phase = min(step // 4, 4)
    batch: dict[str, Any] = {
        "x": torch.full((3, 4), float(step)),
        "arr": np.full(5, step, dtype=np.int32),
        "epoch": phase,  # travels in the header: a repeat of the header repeats it
    }
    if phase == 1:
        batch["x"] = torch.full((4, 3), float(step))
    elif phase == 2:
        batch["x"] = torch.full((3, 4), step, dtype=torch.int64)
    elif phase == 3:
        batch["blob"] = bytes([step]) * 2000
    elif phase == 4:
        batch["step"] = step
        batch["note"] = "n" * (step * 37 % 200)  # a header of a new length every step
    return batch


STEADY_STEPS = 32


def payload_batch(step: int) -> Any:
    """Batches whose payload follows the first message, with new small values every step:
    several megabytes with bytes between the large leaves; then one payload of 300 KB in
    one tensor; then a shape that changes every step."""
    phase = min(step // 6, 2)
    if phase == 0:
        return {
            # no run of one value ends its rows: nothing to trim, the payload is whole
            "audio": torch.arange(600_000.0).view(2, 300_000) + step,
            "lens": torch.tensor([step, 300_000]),
            "step": step,
            "id": "utt-" + "x" * (step * 7 % 30),  # a header of a new length every step
        }
    length = 75_000 if phase == 1 else 75_000 + 16 * step
    return {"x": torch.full((length,), float(step)), "step": step}


PAYLOAD_STEPS = 16


# -- a batch mutated while it is packed ---------------------------------------------------

_installed_hooks: list[Any] = []


class _GrowDuringGC:
    """A gc callback that adds a key to ``target`` at every collection.

    With the collection threshold at 1 (see ``mutated_batch``), every allocation of a
    tracked object collects: the dict then grows between any two steps of reading it,
    deterministically. This is exactly what another thread writing to the batch would
    do, without depending on thread scheduling.
    """

    # The limit is headroom, not a bound anyone should reach: every collection between the
    # batch's draw and the encoder's walk of it adds a key (a prefetching source draws it
    # a frame ahead, and with the threshold at 1 every allocation in the process, on any
    # thread, collects), and once at the limit the dict stops changing under the walk.
    def __init__(self, target: dict[str, int], limit: int = 5_000_000):
        self.target = target
        self.limit = limit

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and len(self.target) < self.limit:
            self.target[f"added-{len(self.target)}"] = 0


def mutated_batch() -> dict[str, Any]:
    big = {f"k{i}": i for i in range(50_000)}
    hook = _GrowDuringGC(big)
    gc.callbacks.append(hook)
    _installed_hooks.append((hook, gc.get_threshold()))
    gc.set_threshold(1)
    return {"x": torch.ones(2), "big": big}


def remove_hooks() -> None:
    while _installed_hooks:
        hook, threshold = _installed_hooks.pop()
        gc.set_threshold(*threshold)
        if hook in gc.callbacks:
            gc.callbacks.remove(hook)
