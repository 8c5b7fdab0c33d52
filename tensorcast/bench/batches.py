"""A user's own batch for the benchmark, and how a run checks what each rank received.

A batch file is what :func:`save_batch` writes: ``tc.pack``'s header and buffer, framed::

    offset  size  what
    0       8     magic  b"TCBATCH1"
    8       8     header length H, little-endian uint64
    16      8     buffer length B, little-endian uint64
    24      H     the header, as tensorcast.pack makes it
    24+H    B     the buffer

Nothing in it is pickled: the header is validated by ``tc.read_header`` before the buffer
is read. A ``torch.save`` of tensors and plain containers also works; it is read with
``torch.load(weights_only=True)``, which refuses anything else.

``--batch module:function`` names a function that takes no argument and returns a batch;
the source rank calls it once.
"""

from __future__ import annotations

import hashlib
import importlib
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tensorcast as tc

__all__ = ["digest", "load_batch", "mismatch", "save_batch", "user_batch"]

MAGIC = b"TCBATCH1"
_PREFIX = struct.Struct("<8sQQ")


def save_batch(path: str | Path, batch: Any) -> int:
    """Write ``batch`` to ``path`` as a tensorcast batch file; returns the buffer's bytes."""
    packed = tc.pack(batch)
    buffer = packed.buffer.cpu().numpy()
    with open(path, "wb") as f:
        f.write(_PREFIX.pack(MAGIC, len(packed.header), packed.nbytes))
        f.write(packed.header)
        f.write(buffer.tobytes())
    return packed.nbytes


def load_batch(path: str | Path) -> Any:
    """Read a batch file that :func:`save_batch` wrote, or a ``torch.save`` of tensors.

    Raises:
        ValueError: the file is neither, or is truncated.
        HeaderError: the header is not valid for this version of tensorcast.
    """
    path = Path(path)
    data = path.read_bytes()
    if data[:8] == MAGIC:
        if len(data) < _PREFIX.size:
            raise ValueError(f"{path}: truncated batch file ({len(data)} bytes)")
        _, header_len, buffer_len = _PREFIX.unpack_from(data)
        end = _PREFIX.size + header_len
        if len(data) != end + buffer_len:
            raise ValueError(
                f"{path}: the prefix promises a {header_len}-byte header and a "
                f"{buffer_len}-byte buffer but the file holds {len(data) - _PREFIX.size} bytes "
                f"after it; write it again with tensorcast.bench.save_batch"
            )
        header = data[_PREFIX.size : end]
        tc.read_header(header)  # validated before the buffer is touched
        # torch.frombuffer refuses an empty buffer (a batch without tensor bytes)
        body = bytearray(data[end:])
        buffer = (
            torch.frombuffer(body, dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8)
        )
        return tc.unpack(header, buffer)
    if data[:2] == b"PK":  # torch.save's zip archive
        return torch.load(path, map_location="cpu", weights_only=True)
    raise ValueError(
        f"{path} is neither a tensorcast batch file (magic {MAGIC!r}) nor a torch.save "
        f"archive; write it with tensorcast.bench.save_batch(path, batch)"
    )


def user_batch(spec: str) -> Any:
    """The batch ``spec`` names: a file path, or ``module:function`` (called once).

    Raises:
        ValueError: the spec names neither an existing file nor a callable.
    """
    if Path(spec).is_file():
        return load_batch(spec)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"--batch {spec!r}: no such file, and not of the form module:function "
            f"(e.g. --batch mypkg.data:one_batch)"
        )
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"--batch {spec!r}: {module_name} has no callable {attr!r}")
    return fn()


def _walk(tree: Any, h: Any) -> None:
    h.update(type(tree).__name__.encode())
    if isinstance(tree, torch.Tensor):
        t = tree.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(tree, np.ndarray):
        h.update(f"{tree.dtype}{tree.shape}".encode())
        h.update(np.ascontiguousarray(tree).tobytes())
    elif isinstance(tree, dict):
        for key, value in tree.items():
            h.update(repr(key).encode())
            _walk(value, h)
    elif isinstance(tree, (list, tuple)):
        h.update(str(len(tree)).encode())
        for value in tree:
            _walk(value, h)
    else:
        h.update(repr(tree).encode())


def digest(tree: Any) -> str:
    """A digest of a batch's structure, types and tensor bytes, wherever its tensors live:
    two ranks that hold equal batches have equal digests."""
    h = hashlib.sha256()
    _walk(tree, h)
    return h.hexdigest()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def mismatch(got: Any, want: Any, path: str = "batch") -> str | None:
    """Where ``got`` differs from ``want`` (types, structure, tensor bytes), or None."""
    if type(got) is not type(want):
        return f"{path}: {type(got).__name__} instead of {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        if got.dtype != want.dtype or got.shape != want.shape:
            return (
                f"{path}: {got.dtype}{tuple(got.shape)} instead of {want.dtype}{tuple(want.shape)}"
            )
        same = torch.equal(_bits(got.cpu()), _bits(want.cpu()))
        return None if same else f"{path}: tensor bytes differ"
    if isinstance(want, dict):
        if list(got) != list(want):
            return f"{path}: keys {list(got)[:5]}... instead of {list(want)[:5]}..."
        pairs: Any = ((got[k], want[k], f"{path}[{k!r}]") for k in want)
    elif isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return f"{path}: length {len(got)} instead of {len(want)}"
        pairs = ((a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(got, want)))
    else:
        return None if got == want else f"{path}: {got!r} instead of {want!r}"
    for a, b, where in pairs:
        if (m := mismatch(a, b, where)) is not None:
            return m
    return None
