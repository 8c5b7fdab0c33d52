"""pack / unpack: a batch tree <-> a header and ONE packed, aligned uint8 buffer.

The data path, top to bottom, one module a step::

    tree --_flatten--> tokens + values + buffer leaves --_layout--> leaf table
         --_schema--> header;  --_plan--> buffer (one batched copy of the tensors)
    header --_schema (decode, validate)--> leaf table --_views--> leaves
           --_build--> tree

This module joins them into the codec's entry points. Nothing here knows about process
groups; the transport moves headers and buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, overload

import torch

from tensorcast._errors import HeaderError
from tensorcast.codec import schema as _schema
from tensorcast.codec.build import Program, compile_tokens, run
from tensorcast.codec.layout import DEFAULT_ALIGN, Layout
from tensorcast.codec.paths import render_path
from tensorcast.codec.plan import Encoded, encode
from tensorcast.codec.schema import LeafSpec, Schema
from tensorcast.codec.values import decode_values
from tensorcast.codec.views import KeepsViews, ViewSpec, view_spec, views

__all__ = [
    "DEFAULT_ALIGN",
    "Layout",
    "Encoded",
    "Packed",
    "ViewSpec",
    "compiled",
    "copy_to_device",
    "pack",
    "encode",
    "read_header",
    "read_prepacked",
    "rebuild",
    "resolve_device",
    "unpack",
    "view_spec",
    "views",
]


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


def resolve_device(device: torch.device | str | int | None) -> torch.device | None:
    """Normalise a device argument; a bare ``"cuda"`` means the current CUDA device."""
    if device is None:
        return None
    dev = torch.device(device)
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
    tree: Any, *, device: torch.device | str | None = None, align: int = DEFAULT_ALIGN
) -> Packed:
    """Flatten a batch tree into a header and ONE contiguous uint8 buffer.

    Args:
        tree: nested dict / list / tuple / OrderedDict / registered types of tensors,
            numpy arrays and small Python values.
        device: where the buffer lives. Defaults to the device of the batch's tensors
            (CPU when it has none).
        align: every leaf's offset is a multiple of this (a power of two).

    Returns:
        A :class:`Packed` whose ``buffer`` holds every tensor, ndarray and large
        bytes/str leaf.

    Raises:
        UnsupportedLeafError: a leaf cannot travel; the message names its path.
        ValueError: bad ``align``, tensors on more than one device, a cyclic tree.
    """
    p = encode(tree, align=align)
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


def read_prepacked(packed: Packed) -> _schema.Decoded:
    """The decoded header of a :class:`Packed`, checked against its buffer.

    Raises:
        HeaderError: the header is invalid or does not match the buffer's size.
        TypeError, ValueError: the buffer is not a contiguous 1-D uint8 tensor.
    """
    decoded = _schema.decode(packed.header)
    _check_buffer(packed.buffer, decoded.nbytes)
    return decoded


def _check_buffer(buffer: Any, nbytes: int) -> None:
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TypeError(
            f"the buffer must be a 1-D torch.uint8 tensor, got "
            f"{getattr(buffer, 'dtype', type(buffer).__name__)} with shape "
            f"{tuple(getattr(buffer, 'shape', ()))}"
        )
    if not buffer.is_contiguous():
        raise ValueError("the buffer must be contiguous; call .contiguous() first")
    if buffer.numel() != nbytes:
        raise HeaderError(
            f"the header describes a {nbytes}-byte buffer but the buffer has {buffer.numel()}"
        )


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
    numpy leaves are always CPU arrays; bytes and str leaves are copies.

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
    decoded = _schema.decode(header)
    _check_buffer(buffer, decoded.nbytes)
    dev = resolve_device(device)
    if dev is not None and dev != buffer.device:
        buffer = copy_to_device(buffer, dev)
    return rebuild(decoded, buffer)


def rebuild(
    decoded: _schema.Decoded,
    buffer: torch.Tensor,
    values: list[Any] | None = None,
    pool: KeepsViews | None = None,
    host: torch.Tensor | None = None,
) -> Any:
    """The tree of a decoded header, its leaves viewing ``buffer`` (or ``values``);
    ``host``: the host block of the leaves that are not tensors (``codec.views``)."""
    program, consts = compiled(decoded)
    leaves = views(decoded, buffer, pool, host) if values is None else values
    return run(program, leaves, consts)


def compiled(decoded: _schema.Decoded) -> tuple[Program, list[Any]]:
    """The structure's program (compiled once per structure) and the decoded small values
    (once per header); both validated.

    Raises:
        HeaderError: the tokens or values are not a valid tree.
    """
    structure = decoded.structure
    if structure.program is None:
        structure.program, _ = compile_tokens(structure.tokens, len(structure.leaves))
    if decoded.consts is None:
        consts = decode_values(decoded.values)
        if len(consts) != structure.program.n_values:
            raise HeaderError(
                f"the header's tree has {structure.program.n_values} small values but "
                f"{len(consts)} follow it"
            )
        decoded.consts = consts
    return structure.program, decoded.consts


def read_header(header: bytes) -> Schema:
    """Decode and validate a header without touching any buffer.

    Raises:
        HeaderError: the header is not valid for this version of tensorcast.
    """
    decoded = _schema.decode(header)
    program, paths = compile_tokens(decoded.tokens, len(decoded.leaves), want_paths=True)
    assert paths is not None
    if decoded.structure.program is None:
        decoded.structure.program = program  # compiled once per structure, as rebuild does
    compiled(decoded)  # validates the small values against the tree
    leaves = tuple(
        LeafSpec(render_path(path), kind, code, tuple(shape), off, n)
        for (kind, code, shape, off, n), path in zip(decoded.leaves, paths)
    )
    return Schema(leaves, decoded.nbytes, _schema.FORMAT_VERSION, decoded.align)
