"""The codec's public entry points: ``pack`` / ``unpack`` / ``read_header`` and ``Packed``.

A batch tree <-> a header and ONE packed, aligned uint8 buffer, with no process group
(the path through the codec: ``codec/__init__.py``).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, overload

import torch

from tensorcast.codec import schema as _schema
from tensorcast.codec.build import compile_tokens
from tensorcast.codec.decode import decode
from tensorcast.codec.encode import DEFAULT_ALIGN, encode
from tensorcast.codec.paths import render_path
from tensorcast.codec.schema import LeafSpec, Schema

__all__ = ["Packed", "copy_to_device", "pack", "read_header", "resolve_device", "unpack"]


@dataclass(frozen=True, slots=True)
class Packed:
    """A packed batch: a header and one contiguous 1-D ``torch.uint8`` buffer.

    Attributes:
        header: the encoded schema (tree structure, dtypes, shapes, small leaves).
        buffer: every tensor / ndarray / large bytes leaf's bytes, each at an aligned offset.
    """

    header: bytes
    buffer: torch.Tensor

    @property
    def nbytes(self) -> int:
        """The buffer's size in bytes."""
        return int(self.buffer.numel())

    def pin_memory(self) -> Packed:
        """A copy with the buffer in pinned memory (``DataLoader(pin_memory=True)`` calls this)."""
        return Packed(self.header, self.buffer.pin_memory())


_CPU = torch.device("cpu")


def resolve_device(device: torch.device | str | int | None) -> torch.device | None:
    """Normalise a device argument: a bare ``"cuda"`` (or an int, as torch reads one) means
    a CUDA device, the current one when no index is given; a CPU is ``cpu`` whatever its
    index (``torch.device("cpu", 0) != torch.device("cpu")``, and a tensor's CPU has none).
    """
    if device is None:
        return None
    if isinstance(device, bool):
        raise TypeError(f"device must be a torch.device, a str or an int, got {device!r}")
    if isinstance(device, numbers.Integral):  # a numpy integer too
        dev = torch.device("cuda", int(device))
    else:
        dev = torch.device(device)
    if dev.type == "cpu":
        return _CPU
    if dev.type == "meta":
        # a meta tensor holds no data: every leaf would arrive as its shape alone
        raise ValueError(
            f"device={device!r} holds no data, so nothing would arrive; pass device=None, "
            f"'cpu' or a CUDA device"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        # else torch's bare "Torch not compiled with CUDA enabled" from deep in a step
        built = "a CPU-only build" if torch.version.cuda is None else "no visible CUDA device"
        raise ValueError(
            f"device={device!r} asks for CUDA, but torch {torch.__version__} has {built}; "
            f"pass device=None (tensors land on the group's transfer device, the CPU for "
            f"gloo) or device='cpu', or install a CUDA build of torch on a machine with a GPU"
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def copy_to_device(buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``buffer`` copied to ``device``; host-to-GPU copies go through pinned memory,
    asynchronously, so the caller's thread never waits for the GPU.

    The staging buffer comes from torch's caching host allocator, which keeps a freed
    block out of reuse until the copy that reads it has finished.
    """
    if device.type == "cuda" and buffer.device.type == "cpu":
        if not buffer.is_pinned():
            staged = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=True)
            staged.copy_(buffer)
            buffer = staged
        return buffer.to(device, non_blocking=True)
    return buffer.to(device)


def pack(
    tree: Any,
    *,
    device: torch.device | str | None = None,
    align: int = DEFAULT_ALIGN,
    trim: bool = True,
) -> Packed:
    """Flatten a batch tree into a header and ONE contiguous uint8 buffer.

    With ``trim=True`` a leaf of 2 or more dims whose rows end in runs of one repeated
    element travels without them, where that pays (NOTE [ Trimmed leaves ] in
    ``codec/trim.py``); ``unpack`` rebuilds it bit-identical. Not knowing where it will
    be unpacked, ``pack`` assumes the buffer's device: a CUDA buffer is rebuilt on a GPU
    (trimmed wherever it clears the floor), a host one on a host (trimmed only where the
    bytes saved pay for the re-pad, a write of the whole leaf).

    Args:
        tree: nested dict / list / tuple / OrderedDict / registered types of tensors,
            numpy arrays and small Python values.
        device: where the buffer lives. Defaults to the device of the batch's tensors
            (CPU when it has none).
        align: every leaf's offset is a multiple of this (a power of two).
        trim: store padded leaves without their padding; False stores every leaf whole.

    Returns:
        A :class:`Packed` whose ``buffer`` holds every tensor, ndarray and large
        bytes/str leaf.

    Raises:
        UnsupportedLeafError: a leaf cannot travel; the message names its path.
        ValueError: bad ``align``, tensors on more than one device, a cyclic tree.
        TypeError: ``trim`` is not a bool.
    """
    asked = resolve_device(device)
    receiver = None if asked is None else "device" if asked.type == "cuda" else "host"
    p = encode(tree, align=align, trim=trim, receiver=receiver)
    batch_device = p.device
    dev = resolve_device(device) or batch_device
    if dev.type == "cuda" and batch_device.type == "cpu":
        staging = torch.empty(p.nbytes, dtype=torch.uint8, pin_memory=True)
        p.write(staging)
        buffer = copy_to_device(staging, dev)
    else:
        buffer = torch.empty(p.nbytes, dtype=torch.uint8, device=dev)
        p.write(buffer)
    return Packed(p.header, buffer)


@overload
def unpack(packed: Packed, /, *, device: torch.device | str | None = None) -> Any: ...
@overload
def unpack(
    header: bytes, buffer: torch.Tensor, /, *, device: torch.device | str | None = None
) -> Any: ...


def unpack(
    packed_or_header: Packed | bytes,
    buffer: torch.Tensor | None = None,
    /,
    *,
    device: torch.device | str | None = None,
) -> Any:
    """Rebuild the tree from a header and its buffer.

    Tensor leaves are views into ``buffer`` (no copy), unless ``device`` differs from the
    buffer's device: then the buffer is copied there once and the leaves view the copy.
    A trimmed leaf is a new tensor, rebuilt on that device. numpy leaves are always CPU
    arrays; bytes and str leaves are copies.

    Raises:
        HeaderError: the header is invalid or does not match the buffer's size.
        TypeError: the buffer is not a 1-D uint8 tensor.
    """
    if isinstance(packed_or_header, Packed):
        if buffer is not None:
            raise TypeError("unpack(packed) takes no buffer; use unpack(header, buffer)")
        header, buffer = packed_or_header.header, packed_or_header.buffer
    else:
        if buffer is None:
            raise TypeError("unpack(header, buffer): the buffer is missing")
        header = packed_or_header
    decoded = decode(header)
    decoded.check_buffer(buffer)
    dev = resolve_device(device)
    if dev is not None and dev != buffer.device:
        buffer = copy_to_device(buffer, dev)
    return decoded.rebuild(buffer)


def read_header(header: bytes) -> Schema:
    """Decode and validate a header without touching any buffer.

    Raises:
        HeaderError: the header is not valid for this version of tensorcast.
    """
    decoded = decode(header)
    structure = decoded.structure
    program, paths = compile_tokens(structure.tokens, len(structure.leaves), want_paths=True)
    assert paths is not None
    if structure.program is None:
        structure.program = program  # compiled once per structure, as rebuild does
    decoded.compiled()  # validates the small values against the tree
    trimmed = structure.trimmed
    leaves = tuple(
        LeafSpec(render_path(path), kind, code, tuple(shape), off, n, i in trimmed)
        for i, ((kind, code, shape, off, n), path) in enumerate(zip(structure.leaves, paths))
    )
    return Schema(leaves, structure.nbytes, _schema.FORMAT_VERSION, structure.align)
