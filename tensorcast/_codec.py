"""pack / unpack: a batch tree <-> a header and ONE packed, aligned uint8 buffer.

The data path, top to bottom::

    tree --flatten--> tokens + buffer leaves --layout--> leaf table --encode--> header
                                              \\--write--> buffer (one copy per leaf)
    header --decode/validate--> leaf table --views into buffer--> leaves --build--> tree

Nothing here knows about process groups; ``_transport`` moves headers and buffers.
"""

from __future__ import annotations

import operator
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch

from tensorcast import _schema, _tree
from tensorcast._dtypes import CODE_ITEMSIZE, numpy_dtype, torch_dtype
from tensorcast._errors import HeaderError
from tensorcast._pool import BufferPool
from tensorcast._schema import LeafSpec, Schema

__all__ = [
    "PackPlan",
    "Packed",
    "pack",
    "plan",
    "read_header",
    "rebuild",
    "resolve_device",
    "unpack",
    "views",
]

DEFAULT_ALIGN = 64
_MAX_ITEMSIZE = max(CODE_ITEMSIZE.values())
_MEMSET_BELOW = 1 << 20
_MEMSET_ABOVE_LEAVES = 64
_CPU = torch.device("cpu")


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
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class PackPlan:
    """A batch flattened and laid out, ready to be written into any large-enough buffer."""

    __slots__ = ("header", "layout", "leaves", "nbytes")

    def __init__(self, leaves: list[_tree.BufferLeaf], layout: Layout, header: bytes):
        self.leaves = leaves
        #: the leaves' places and the structure, reused by the next batch when it matches
        self.layout = layout
        self.header = header
        self.nbytes = layout.nbytes

    @property
    def device(self) -> torch.device:
        """The device of the batch's tensors (cpu when it has none). Asked only where it
        matters (large or CUDA batches): a tiny batch's step does not pay for it."""
        # flatten checked that every tensor shares the first one's device
        return next((leaf[3].device for leaf in self.leaves if leaf[0] == "tensor"), _CPU)

    def write(
        self,
        buffer: torch.Tensor,
        defer: Container[int] = (),
        later: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        views: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Copy every leaf's bytes into ``buffer[:self.nbytes]`` at its offset.

        Tensor leaves are copied by one batched ``_foreach_copy_`` into typed views of
        the buffer: per-leaf Python work is what dominates batches of many small leaves.

        Args:
            buffer: at least ``nbytes`` bytes, on any device.
            defer: indices of tensor leaves not to copy now: their ``(view, source)``
                pairs go to ``later``, for the caller to copy when it suits it.
            later: where deferred copies go.
            views: what an earlier call returned for this layout and this very buffer
                (the tensor views to write through), to save making them again.

        Returns:
            The typed views the tensor leaves were copied into, in leaf order: the
            sender's own rebuilt tree can use them (see :meth:`values`).
        """
        layout = self.layout
        spec = layout.write_spec()
        leaves = self.leaves
        on_cpu = buffer.is_cpu
        host: np.ndarray | None = None
        # Alignment gaps are zeroed: the bytes are deterministic, and no stale memory of
        # this process travels to the peers. Small or many-leaf buffers get one memset;
        # large ones (where a second pass over the data would cost) get one per gap.
        if layout.has_gaps:
            if defer or (self.nbytes > _MEMSET_BELOW and len(leaves) <= _MEMSET_ABOVE_LEAVES):
                for start, stop in layout.gaps():
                    if on_cpu:
                        host = buffer.numpy() if host is None else host
                        host[start:stop] = 0
                    else:
                        buffer[start:stop].zero_()
            else:
                buffer[: self.nbytes].zero_()
        if views is None:
            views = spec.tensor_views(buffer)
        srcs = [leaves[i][3] for i in spec.tensor_index]
        for j in spec.bools:
            # As bytes: a bool copy would turn bytes other than 0 / 1 (masks made with
            # .view(torch.bool)) into 1, and the bytes must arrive as they are.
            srcs[j] = srcs[j].view(torch.uint8)
        dsts = views
        if defer:
            assert later is not None
            dsts, now = [], []
            for view, src, i in zip(views, srcs, spec.tensor_index):
                if i in defer:
                    later.append((view, src.detach()))  # copy_ would carry requires_grad
                else:
                    dsts.append(view)
                    now.append(src)
            srcs = now
        if len(dsts) == 1:
            dsts[0].copy_(srcs[0])
        elif dsts:
            torch._foreach_copy_(dsts, srcs)
        for i, (kind, _code, _shape, off, _n) in spec.others:
            data = leaves[i][3]
            if kind == "ndarray":
                src = data
                n = data.nbytes
            else:  # bytes / str, already encoded
                src = np.frombuffer(data, dtype=np.uint8)
                n = len(data)
            if n == 0:
                continue
            if on_cpu:
                host = buffer.numpy() if host is None else host
                host[off : off + n].view(src.dtype).reshape(src.shape)[...] = src
            else:
                staged = torch.empty(n, dtype=torch.uint8)
                staged.numpy().view(src.dtype).reshape(src.shape)[...] = src
                buffer[off : off + n].copy_(staged)
        return views

    def values(self, buffer: torch.Tensor, tensor_views: list[torch.Tensor]) -> list[Any]:
        """The leaf values the receivers will see, built from what :meth:`write` returned."""
        spec = self.layout.write_spec()
        out: list[Any] = list(tensor_views)
        for j in spec.bools:
            out[j] = out[j].view(torch.bool)  # written as bytes
        if not spec.others:
            return out
        values = spec.placed(out, len(self.leaves))
        host: np.ndarray | None = None
        for i, (kind, _code, shape, off, _n) in spec.others:
            data = self.leaves[i][3]
            if kind == "bytes":
                values[i] = data
            elif kind == "str":
                values[i] = data.decode("utf-8", "surrogatepass")
            else:
                if host is None:  # one holder view: it keeps the storage's use count up
                    host = (
                        buffer[:].numpy() if buffer.device.type == "cpu" else buffer.cpu().numpy()
                    )
                values[i] = host[off : off + data.nbytes].view(data.dtype).reshape(shape)
        return values


_strides_cache: dict[tuple[int, ...], tuple[int, ...]] = {}


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = _strides_cache.get(shape)
    if strides is None:
        acc = 1
        out = []
        for d in reversed(shape):
            out.append(acc)
            acc *= d if d > 1 else 1
        strides = tuple(reversed(out))
        if len(_strides_cache) > 4096:
            _strides_cache.clear()
        _strides_cache[shape] = strides
    return strides


class Layout:
    """A batch's structure laid out: the leaf table and the header's bytes up to the small
    values, so a next batch of the same structure reuses them (and the views and gaps
    worked out for it) and encodes its values alone."""

    __slots__ = (
        "_gaps",
        "_last",
        "_write_spec",
        "align",
        "comparable",
        "has_gaps",
        "kinds",
        "nbytes",
        "prefix",
        "table",
        "tokens",
    )

    def __init__(
        self,
        table: list[tuple[Any, ...]],
        tokens: list[Any],
        prefix: bytes,
        comparable: bool,
        kinds: list[tuple[str, str, Any]],
        align: int,
        nbytes: int,
        has_gaps: bool,
    ):
        self.table = table
        self.tokens = tokens
        #: the header body up to the values (see _schema.structure_prefix)
        self.prefix = prefix
        #: False when ``==`` on the tokens could mistake True for 1 (see _tree.flatten)
        self.comparable = comparable
        #: each leaf's (kind, code, shape), which with ``align`` fixes the table
        self.kinds = kinds
        self.align = align
        self.nbytes = nbytes
        #: whether alignment leaves gaps between leaves
        self.has_gaps = has_gaps
        self._write_spec: ViewSpec | None = None
        self._gaps: list[tuple[int, int]] | None = None
        self._last: tuple[list[Any], bytes] | None = None  # values -> header, last used

    def header(self, values: list[Any]) -> bytes:
        """The header of the batch of this structure with these small values.

        A batch that repeats the last values gets the very same bytes object back.
        """
        last = self._last  # one read: another thread may replace it
        if last is not None and last[0] == values:  # strict: no bare ints among values
            return last[1]
        header = _schema.encode(self.prefix, values)
        self._last = (values, header)
        return header

    def write_spec(self) -> ViewSpec:
        """The views leaves are written through (bool leaves as bytes)."""
        if self._write_spec is None:
            self._write_spec = ViewSpec(self.table, bool_as_bytes=True)
        return self._write_spec

    def gaps(self) -> list[tuple[int, int]]:
        """The ``(start, stop)`` byte ranges between leaves."""
        if self._gaps is None:
            self._gaps = []
            end = 0
            for _kind, _code, _shape, off, n in self.table:
                if off > end:
                    self._gaps.append((end, off))
                end = off + n
        return self._gaps


_KIND = operator.itemgetter(0, 1, 2)
_masks_by_align: dict[int, dict[str, int]] = {}


def _align_masks(align: int) -> dict[str, int]:
    """``code -> alignment - 1`` for every dtype code: a leaf is aligned to ``align`` or
    to its itemsize, whichever is larger (both powers of two)."""
    masks = _masks_by_align.get(align)
    if masks is None:
        masks = _masks_by_align[align] = {
            code: max(align, itemsize) - 1 for code, itemsize in CODE_ITEMSIZE.items()
        }
    return masks


def plan(tree: Any, *, align: int = DEFAULT_ALIGN, previous: Layout | None = None) -> PackPlan:
    """Flatten ``tree`` and lay its leaves out; no buffer is touched yet.

    Raises:
        UnsupportedLeafError: a leaf, key or container cannot travel.
        ValueError: bad ``align``, tensors on more than one device, a cyclic tree.
    """
    if type(align) is not int or not 1 <= align <= _schema.MAX_ALIGN or align & (align - 1):
        raise ValueError(f"align must be a power of two in [1, {_schema.MAX_ALIGN}], got {align!r}")
    tokens, values, leaves, loose = _tree.flatten(tree)
    # A leaf's (kind, code, shape) fixes its size, so equal kinds and tokens mean an equal
    # layout: steady state compares them instead of laying the leaves out, and encodes
    # only the small values.
    kinds = list(map(_KIND, leaves))
    if (
        previous is not None
        and previous.comparable
        and not loose
        and previous.align == align
        and previous.tokens == tokens
        and previous.kinds == kinds
    ):
        layout = previous
    else:
        layout = _lay_out(leaves, kinds, tokens, align, not loose)
    return PackPlan(leaves, layout, layout.header(values))


def _lay_out(
    leaves: list[_tree.BufferLeaf],
    kinds: list[tuple[str, str, Any]],
    tokens: list[Any],
    align: int,
    comparable: bool,
) -> Layout:
    """Place every leaf at its aligned offset and encode the structure."""
    table: list[tuple[Any, ...]] = []
    masks = _align_masks(align)
    end = 0
    data_bytes = 0
    for kind, code, shape, data in leaves:
        off = (end + masks[code]) & ~masks[code]
        size = len(data) if kind == "bytes" or kind == "str" else data.nbytes
        table.append((kind, code, shape, off, size))
        end = off + size
        data_bytes += size
    if end > _schema.MAX_BUFFER_BYTES:
        raise ValueError(
            f"the batch needs a {end}-byte buffer, over the {_schema.MAX_BUFFER_BYTES}-byte "
            f"limit of the format; split it into smaller batches"
        )
    prefix = _schema.structure_prefix(end, align, table, tokens)
    return Layout(table, tokens, prefix, comparable, kinds, align, end, data_bytes != end)


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
    p = plan(tree, align=align)
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


class ViewSpec:
    """How to view a buffer as one layout's leaves; computed once per distinct layout.

    ``specs`` has one ``(code, shape, strides, element offset)`` per tensor leaf, in leaf
    order, so making the views is one comprehension of ``as_strided`` calls: with many
    small leaves, that is most of a receiver's work.
    """

    __slots__ = ("bools", "codes", "others", "specs", "tensor_index")

    def __init__(self, table: Sequence[Sequence[Any]], bool_as_bytes: bool = False):
        self.specs: list[tuple[str, tuple[int, ...], tuple[int, ...], int]] = []
        self.codes: dict[str, int] = {}  # code -> itemsize, for the typed bases
        self.tensor_index: list[int] = []  # the leaf index of each spec
        self.bools: list[int] = []  # positions in specs of bool leaves
        self.others: list[tuple[int, Any]] = []  # (leaf index, row) of the other leaves
        for i, row in enumerate(table):
            kind, code, shape, off = row[0], row[1], row[2], row[3]
            if kind != "tensor":
                self.others.append((i, row))
                continue
            if code == "BOOL":
                self.bools.append(len(self.specs))
                if bool_as_bytes:
                    code = "U8"
            isz = CODE_ITEMSIZE[code]
            self.codes[code] = isz
            shape_t = tuple(shape)
            self.specs.append((code, shape_t, _contiguous_strides(shape_t), off // isz))
            self.tensor_index.append(i)

    def placed(self, tensors: list[Any], count: int) -> list[Any]:
        """``tensors`` (one per spec) at their leaf indices in a list of ``count`` leaves;
        the other leaves' places are None, for the caller to fill."""
        values: list[Any] = [None] * count
        for i, value in zip(self.tensor_index, tensors):
            values[i] = value
        return values

    def tensor_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor leaf's typed view of ``buffer``, in leaf order."""
        total = buffer.numel()
        base_offset = buffer.storage_offset()  # as_strided offsets count from the storage
        bases = {
            code: buffer[: total - total % isz].view(torch_dtype(code))
            for code, isz in self.codes.items()
        }
        as_strided = torch.as_strided
        if not base_offset:
            return [as_strided(bases[c], sh, st, o) for c, sh, st, o in self.specs]
        shift = {code: base_offset // isz for code, isz in self.codes.items()}
        return [as_strided(bases[c], sh, st, o + shift[c]) for c, sh, st, o in self.specs]

    def pooled_views(self, buffer: torch.Tensor, pool: BufferPool | None) -> list[torch.Tensor]:
        """:meth:`tensor_views`, as fresh tensors on views ``pool`` keeps for ``buffer``
        when it came from there (see ``BufferPool.views``)."""
        if pool is None:
            return self.tensor_views(buffer)
        return pool.views(buffer, (self, buffer.storage_offset()), self.tensor_views)


def view_spec(decoded: _schema.Decoded) -> ViewSpec:
    structure = decoded.structure
    if structure.view_specs is None:
        structure.view_specs = ViewSpec(structure.leaves)
    return structure.view_specs


def views(
    decoded: _schema.Decoded, buffer: torch.Tensor, pool: BufferPool | None = None
) -> list[Any]:
    """The buffer leaves of ``decoded`` as views into ``buffer`` (ndarrays: CPU views).

    ``pool``: the pool ``buffer`` came from, which keeps the views it was last made for.
    """
    if buffer.storage_offset() % _MAX_ITEMSIZE:
        buffer = buffer.clone()  # a buffer sliced at an odd offset cannot be viewed as F64
    spec = view_spec(decoded)
    tensors = spec.pooled_views(buffer, pool)
    if not spec.others:
        return tensors
    values = spec.placed(tensors, len(decoded.leaves))
    host: np.ndarray | None = None
    on_cpu = buffer.device.type == "cpu"
    for i, (kind, code, shape, off, n) in spec.others:
        if on_cpu:
            if host is None:
                # One holder view for all host leaves: it keeps the storage's use count up
                # while any array views it, so a pooled buffer is not reused under them.
                host = buffer[:].numpy()
            piece = host[off : off + n]
        else:
            piece = buffer[off : off + n].cpu().numpy()
        if kind == "ndarray":
            values[i] = piece.view(numpy_dtype(code)).reshape(shape)
        elif kind == "bytes":
            values[i] = piece.tobytes()
        else:
            try:
                values[i] = piece.tobytes().decode("utf-8", "surrogatepass")
            except UnicodeDecodeError as e:
                raise HeaderError(f"a str leaf holds invalid UTF-8: {e}") from None
    return values


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
    pool: BufferPool | None = None,
) -> Any:
    """The tree of a decoded header, its leaves viewing ``buffer`` (or ``values``)."""
    program, consts = compiled(decoded)
    return _tree.run(program, views(decoded, buffer, pool) if values is None else values, consts)


def compiled(decoded: _schema.Decoded) -> tuple[_tree.Program, list[Any]]:
    """The structure's program (compiled once per structure) and the decoded small values
    (once per header); both validated.

    Raises:
        HeaderError: the tokens or values are not a valid tree.
    """
    structure = decoded.structure
    if structure.program is None:
        structure.program, _ = _tree.compile_tokens(structure.tokens, len(structure.leaves))
    if decoded.consts is None:
        consts = _tree.decode_values(decoded.values)
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
    program, paths = _tree.compile_tokens(decoded.tokens, len(decoded.leaves), want_paths=True)
    assert paths is not None
    if decoded.structure.program is None:
        decoded.structure.program = program  # compiled once per structure, as rebuild does
    compiled(decoded)  # validates the small values against the tree
    leaves = tuple(
        LeafSpec(_tree.render_path(path), kind, code, tuple(shape), off, n)
        for (kind, code, shape, off, n), path in zip(decoded.leaves, paths)
    )
    return Schema(leaves, decoded.nbytes, _schema.FORMAT_VERSION, decoded.align)
