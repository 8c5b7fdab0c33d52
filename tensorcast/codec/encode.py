"""The encode side: a batch encoded (flattened, laid out, its header made), then
written into any buffer large enough.

An :class:`Encoder` encodes one source's batches, reusing the last one's layout while
the structure repeats, so a steady-state step flattens the tree and encodes its small
values, nothing more. An :class:`Encoded` touches no buffer until
it is written, so the caller picks the buffer (pooled, pinned, on a GPU) once it knows the
size. Writing hands back the tree the receivers will rebuild from the header, made from
what the encoder already knows: the source never decodes the header it has just encoded.

With ``trim=True`` the encoder asks ``codec.trim.plan`` of each leaf that could pay
(``Layout.candidates``) how to trim it, and the batch gets a layout of its own where one
is trimmed; writing then copies a trimmed leaf's prefixes alone (``trim.compact_into``).

*The layout*, the second step of packing, is the encode side's structure and its cache,
as ``codec.decode`` holds the decode side's: each leaf gets an offset aligned to
``align`` (or to its itemsize, when larger) after the one before it; the leaf table and
the structure make the header's bytes up to the small values. A :class:`Layout` keeps
both, so a next batch of the same structure reuses them and encodes its values alone. A
batch with trimmed leaves (NOTE [ Trimmed leaves ], ``codec.trim``) stores fewer bytes
for them, so its offsets after the first one differ from its structure's: it gets a
layout of its own (:meth:`Layout.trimmed_layout`), which shares the structure's compiled
program; its structure's layout stays as it was for the next batch.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from tensorcast.codec import schema as _schema
from tensorcast.codec import trim as _trim
from tensorcast.codec.build import Program, compile_tokens, decode_values, run
from tensorcast.codec.decode import leaf_views
from tensorcast.codec.dtypes import CODE_ITEMSIZE
from tensorcast.codec.flatten import BufferLeaf, flatten
from tensorcast.codec.paths import render_path
from tensorcast.codec.repad import Repad
from tensorcast.codec.schema import Trim
from tensorcast.codec.views import Reuses, ViewSpec

__all__ = [
    "DEFAULT_ALIGN",
    "KIND",
    "Encoded",
    "Encoder",
    "Layout",
    "check_align",
    "check_trim",
    "encode",
    "lay_out",
]

_MEMSET_BELOW = 1 << 20
_MEMSET_ABOVE_LEAVES = 64
_CPU = torch.device("cpu")

# --------------------------------------------------------------------------- layout

DEFAULT_ALIGN = 64

#: a buffer leaf's (kind, code, shape), which with the alignment fixes its place
KIND = operator.itemgetter(0, 1, 2)


class Layout:
    """A batch's structure laid out: the leaf table and the header's bytes up to the small
    values, so a next batch of the same structure reuses them (and the views and gaps
    worked out for it) and encodes its values alone."""

    __slots__ = (
        "_candidates",
        "_consts",
        "_gaps",
        "_last",
        "_program",
        "_read_spec",
        "align",
        "comparable",
        "has_gaps",
        "kinds",
        "nbytes",
        "structure_bytes",
        "table",
        "tokens",
        "trimmed",
        "write_spec",
    )

    def __init__(
        self,
        table: list[tuple[Any, ...]],
        tokens: list[Any],
        structure_bytes: bytes,
        comparable: bool,
        kinds: list[tuple[str, str, Any]],
        align: int,
        nbytes: int,
        has_gaps: bool,
        trimmed: frozenset[int] = frozenset(),
    ):
        self.table = table
        self.tokens = tokens
        #: the header body up to the values (``codec.schema.structure_bytes``)
        self.structure_bytes = structure_bytes
        #: False when ``==`` on the tokens could mistake True for 1 (``codec.flatten.flatten``)
        self.comparable = comparable
        #: each leaf's (kind, code, shape), which with ``align`` fixes the table
        self.kinds = kinds
        self.align = align
        self.nbytes = nbytes
        #: whether alignment leaves gaps between leaves
        self.has_gaps = has_gaps
        #: the leaves stored trimmed (a batch's own layout: :meth:`trimmed_layout`)
        self.trimmed = trimmed
        #: the views leaves are written through (bool leaves as bytes): every layout is
        #: written, so it is made with the layout
        self.write_spec = ViewSpec(table, as_bytes=True, trimmed=trimmed)
        self._candidates: dict[str, list[int]] = {}  # receiver -> leaves worth a probe
        self._read_spec: ViewSpec | None = None
        self._program: Program | None = None
        self._consts: tuple[list[Any], list[Any]] | None = None  # values -> consts, last used
        self._gaps: list[tuple[int, int]] | None = None
        self._last: tuple[list[Any], bytes] | None = None  # values -> header, last used

    def header(self, values: list[Any], trims: dict[int, Trim] | None = None) -> bytes:
        """The header of the batch of this structure with these small values (and these
        side tables, for a layout of :meth:`trimmed_layout`).

        A batch that repeats the last values (and trims none) gets the very same bytes
        object back.
        """
        if trims:
            return _schema.encode(self.structure_bytes, values, trims=trims)
        last = self._last  # one read: another thread may replace it
        if last is not None and last[0] == values:  # strict: no bare ints among values
            return last[1]
        header = _schema.encode(self.structure_bytes, values)
        self._last = (values, header)
        return header

    def read_spec(self) -> ViewSpec:
        """The views leaves are read through, as receivers make them."""
        if self._read_spec is None:
            self._read_spec = ViewSpec(self.table, trimmed=self.trimmed)
        return self._read_spec

    def compiled(self, values: list[Any]) -> tuple[Program, list[Any]]:
        """The structure's program (compiled once) and ``values`` decoded, as a receiver
        gets them from the header (a repeat of the last values decodes nothing)."""
        if self._program is None:
            self._program, _ = compile_tokens(self.tokens, len(self.table))
        last = self._consts  # one read: another thread may replace it
        if last is not None and last[0] == values:
            return self._program, last[1]
        consts = decode_values(values)
        self._consts = (values, consts)
        return self._program, consts

    def candidates(self, receiver: str) -> list[int]:
        """The leaves a trim could pay for where ``receiver`` says the receivers rebuild
        (``codec.trim.decide``): arrays of 2 or more dims whose bytes clear the floor.
        Worked out once per structure, so a batch of small leaves probes none."""
        found = self._candidates.get(receiver)
        if found is None:
            least = _trim.MIN_SAVED_BYTES if receiver == "device" else _trim.HOST_MIN_SAVED_BYTES
            found = self._candidates[receiver] = [
                i
                for i, (kind, code, shape, _off, n) in enumerate(self.table)
                if kind in ("tensor", "ndarray") and len(shape) >= 2 and n >= least
            ]
        return found

    def trimmed_layout(self, leaves: list[BufferLeaf], trims: dict[int, Trim]) -> Layout:
        """This structure's layout for one batch whose leaves ``trims`` are trimmed: their
        stored bytes, and the offsets after them, are that batch's own."""
        if self._program is None:
            self._program, _ = compile_tokens(self.tokens, len(self.table))
        layout = lay_out(leaves, self.kinds, self.tokens, self.align, self.comparable, trims)
        layout._program = self._program
        return layout

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


def lay_out(
    leaves: list[BufferLeaf],
    kinds: list[tuple[str, str, Any]],
    tokens: list[Any],
    align: int,
    comparable: bool,
    trims: dict[int, Trim] | None = None,
) -> Layout:
    """Place every leaf at its aligned offset and encode the structure; the leaves of
    ``trims`` take their stored bytes.

    Raises:
        ValueError: the buffer would be over the format's size limit.
    """
    table: list[tuple[Any, ...]] = []
    masks = _align_masks(align)
    end = 0
    data_bytes = 0
    for i, (kind, code, shape, data) in enumerate(leaves):
        off = (end + masks[code]) & ~masks[code]
        size = len(data) if kind == "bytes" or kind == "str" else data.nbytes
        if trims and i in trims:
            size = trims[i].nbytes
        table.append((kind, code, shape, off, size))
        end = off + size
        data_bytes += size
    if end > _schema.MAX_BUFFER_BYTES:
        raise ValueError(
            f"the batch needs a {end}-byte buffer, over the {_schema.MAX_BUFFER_BYTES}-byte "
            f"limit of the format; split it into smaller batches"
        )
    structure_bytes = _schema.structure_bytes(end, align, table, tokens)
    trimmed = frozenset(trims) if trims else frozenset()
    return Layout(
        table, tokens, structure_bytes, comparable, kinds, align, end, data_bytes != end, trimmed
    )


# --------------------------------------------------------------------------- encoded


class Encoded:
    """A batch flattened, laid out and its header encoded, ready to be written into any
    large-enough buffer."""

    __slots__ = ("header", "layout", "leaves", "nbytes", "trims", "value_tokens")

    def __init__(
        self,
        leaves: list[BufferLeaf],
        value_tokens: list[Any],
        layout: Layout,
        header: bytes,
        trims: dict[int, Trim] | None = None,
    ) -> None:
        self.leaves = leaves
        #: the trimmed leaves' side tables by leaf index; None when none is trimmed
        self.trims = trims
        #: the small values' tokens, as the header carries them
        self.value_tokens = value_tokens
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

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The batch's tensor leaves, in leaf order: what writing the batch reads."""
        return tuple(leaf[3] for leaf in self.leaves if leaf[0] == "tensor")

    def write(
        self, buffer: torch.Tensor, views: list[torch.Tensor] | None = None, *, others: bool = True
    ) -> list[torch.Tensor]:
        """Copy every leaf's bytes into ``buffer[:self.nbytes]`` at its offset.

        Tensor leaves are copied by one batched ``_foreach_copy_`` into typed views of
        the buffer: per-leaf Python work is what dominates batches of many small leaves.

        Args:
            buffer: at least ``nbytes`` bytes, on any device.
            views: what an earlier call returned for this layout and this very buffer
                (the tensor views to write through), to save making them again.
            others: write the leaves that are not tensors too (a GPU buffer gets them
                from their host block instead: :meth:`upload_others`).

        Returns:
            The typed views the tensor leaves were copied into, in leaf order: the
            sender's own rebuilt tree can use them (see :meth:`values`).
        """
        layout = self.layout
        spec = layout.write_spec
        leaves = self.leaves
        host: np.ndarray | None = None  # the buffer's host view, made once if needed
        # Alignment gaps are zeroed: the bytes are deterministic, and no stale memory of
        # this process travels to the peers. Small or many-leaf buffers get one memset;
        # large ones (where a second pass over the data would cost) get one per gap.
        if layout.has_gaps:
            if self.nbytes > _MEMSET_BELOW and len(leaves) <= _MEMSET_ABOVE_LEAVES:
                host = _zero_each_gap(buffer, layout)
            else:
                buffer[: self.nbytes].zero_()
        if views is None:
            views = spec.tensor_views(buffer)
        srcs = [leaves[i][3] for i in spec.tensor_index]
        for j, _ in spec.bytewise:  # bool and float4, written as their bytes (views.py)
            srcs[j] = srcs[j].view(torch.uint8)
        if len(views) == 1:
            views[0].copy_(srcs[0])
        elif views:
            torch._foreach_copy_(views, srcs)
        if spec.others and others:
            _write_others(buffer, spec.others, leaves, host)
        for i, (kind, _code, _shape, off, n) in spec.trimmed:
            if others or kind != "ndarray":  # else from the host block (upload_others)
                self._compact(buffer[off : off + n], i)
        return views

    def _compact(self, out: torch.Tensor, i: int) -> None:
        """Write trimmed leaf ``i``'s prefixes into ``out``; an error names the leaf."""
        try:
            _trim.compact_into(out, self.leaves[i][3], self.trims[i].prefix_lens)  # type: ignore[index]
        except (RuntimeError, ValueError) as e:
            _, paths = compile_tokens(self.layout.tokens, len(self.leaves), want_paths=True)
            where = render_path(paths[i]) if paths else f"leaf {i}"
            raise type(e)(f"writing the trimmed leaf at {where} failed: {e}") from e

    @property
    def host_nbytes(self) -> int | None:
        """The size of the host block of the leaves that are not tensors (numpy arrays,
        bytes, str) and of trimmed ndarray leaves, which travels beside a buffer on a GPU;
        None when there is none (every leaf a tensor)."""
        spec = self.layout.write_spec
        return spec.host_nbytes if spec.host_spans else None

    def write_tree(
        self, buffer: torch.Tensor, reuse: Reuses | None = None, *, seen: torch.Tensor | None = None
    ) -> tuple[Any, list[Repad]]:
        """Write the batch into ``buffer`` and return its tree as the receivers rebuild
        it: leaves that view ``buffer`` (fresh tensors on views ``reuse`` keeps, when
        ``buffer`` came from there), plain tensors even for leaves that require grad;
        trimmed leaves re-padded from ``buffer`` into ``reuse``'s memory, if given. Their
        re-pads are returned with the tree, their memory taken, for the caller to run
        before anyone reads it (``codec.repad.Repad``).

        ``seen``: the same bytes as ``buffer`` through another mapping of them (a
        shared-memory slot's private one), which the tree views instead."""
        spec = self.layout.write_spec
        if seen is not None:
            with torch.no_grad():
                self.write(buffer)
            buffer = seen
        views, memory = spec.kept_views(buffer, reuse)
        if seen is None:
            with torch.no_grad():  # copies of leaves that require grad stay out of autograd
                views = self.write(buffer, views=views)
        values, repads = self._leaf_values(buffer, views, memory)
        return self._tree(values), repads

    def host_block(self, out: torch.Tensor) -> torch.Tensor:
        """The bytes of the leaves that are not tensors (numpy arrays, bytes, str), alone,
        and the stored bytes of trimmed ndarray leaves, written into the host tensor
        ``out`` as ``codec.decode.leaf_views`` reads a host block: what travels beside a
        buffer on a GPU."""
        spec = self.layout.write_spec
        dst = out.numpy()
        for (i, _row), (_off, n, pos) in zip(spec.others, spec.host_spans):
            data = self.leaves[i][3]
            if n:
                src = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
                dst[pos : pos + n].view(src.dtype).reshape(src.shape)[...] = src
        for i, (pos, n) in spec.host_trimmed.items():  # a trimmed ndarray: its prefixes
            self._compact(out[pos : pos + n], i)
        return out[: spec.host_nbytes]

    def device_tree(
        self, buffer: torch.Tensor, host: torch.Tensor | None
    ) -> tuple[Any, list[Repad]]:
        """The tree of a device buffer this batch is (being) written into, read nowhere
        but on the device: tensor leaves view ``buffer``, the others come from ``host``,
        its host block (:meth:`host_block`); and the re-pads of its trimmed leaves, to
        run before it is read (``codec.repad.Repad``)."""
        values, repads = leaf_views(self.layout.read_spec(), buffer, host=host, trims=self.trims)
        return self._tree(values), repads

    def upload_others(self, buffer: torch.Tensor, host: torch.Tensor) -> None:
        """Copy the leaves that are not tensors (and trimmed ndarrays' stored bytes) from
        their host block (pinned) into their places in the device ``buffer``,
        asynchronously."""
        for off, n, pos in self.layout.write_spec.host_spans:
            if n:
                buffer[off : off + n].copy_(host[pos : pos + n], non_blocking=True)

    def _tree(self, leaf_values: list[Any]) -> Any:
        program, consts = self.layout.compiled(self.value_tokens)
        return run(program, leaf_values, consts)

    def _leaf_values(
        self,
        buffer: torch.Tensor,
        tensor_views: list[torch.Tensor],
        memory: Mapping[int, torch.Tensor],
    ) -> tuple[list[Any], list[Repad]]:
        """The leaf values the receivers will see, built from what :meth:`write` returned,
        and the re-pads of the trimmed ones (into ``memory``'s tensors, by leaf index,
        where it has one)."""
        spec = self.layout.write_spec
        out: list[Any] = list(tensor_views)
        for j, dtype in spec.bytewise:
            out[j] = out[j].view(dtype)  # written as bytes
        if not spec.others and not spec.trimmed:
            return out, []
        values = spec.placed(out)
        repads = []
        for i, (kind, code, shape, off, n) in spec.trimmed:
            stored = buffer[off : off + n]
            trim = self.trims[i]  # type: ignore[index]
            repad = Repad.taken(kind, code, shape, stored, trim, memory.get(i), i)
            values[i] = repad.value
            repads.append(repad)
        host: np.ndarray | None = None
        for i, (kind, _code, shape, off, _n) in spec.others:
            data = self.leaves[i][3]
            if kind == "bytes":
                values[i] = data
            elif kind == "str":
                values[i] = data.decode("utf-8", "surrogatepass")
            else:
                on_cpu = buffer.device.type == "cpu"
                if host is None:  # one holder view: it keeps the storage's use count up
                    host = buffer[:].numpy() if on_cpu else buffer.cpu().numpy()
                piece = host[off : off + data.nbytes]
                if on_cpu and spec.specs:  # NOTE [ Numpy leaves beside tensors ]
                    piece = piece.copy()
                values[i] = piece.view(data.dtype).reshape(shape)
        return values, repads


def _zero_each_gap(buffer: torch.Tensor, layout: Layout) -> np.ndarray | None:
    """Zero the gaps between ``layout``'s leaves in ``buffer``, one by one; returns the
    host view of ``buffer`` made for it, when it is on the CPU."""
    host: np.ndarray | None = None
    on_cpu = buffer.is_cpu
    for start, stop in layout.gaps():
        if on_cpu:
            host = buffer.numpy() if host is None else host
            host[start:stop] = 0
        else:
            buffer[start:stop].zero_()
    return host


def _write_others(
    buffer: torch.Tensor,
    others: list[tuple[int, Any]],
    leaves: list[BufferLeaf],
    host: np.ndarray | None,
) -> None:
    """Write the ndarray, bytes and str leaves; ``host``: the buffer's host view, if made."""
    on_cpu = buffer.is_cpu
    for i, (kind, _code, _shape, off, _n) in others:
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


def check_align(align: object) -> int:
    """``align`` itself when it is a power of two the format allows.

    Raises:
        ValueError: anything else (0, 3, a str, a float), with what was given.
    """
    if type(align) is not int or not 1 <= align <= _schema.MAX_ALIGN or align & (align - 1):
        raise ValueError(f"align must be a power of two in [1, {_schema.MAX_ALIGN}], got {align!r}")
    return align


def check_trim(trim: object) -> bool:
    """``trim`` itself when it is a ``bool``, what every entry point accepts.

    Raises:
        TypeError: anything else (None, 0, a string), with what was given.
    """
    if type(trim) is not bool:
        kind = type(trim)
        name = (
            kind.__qualname__
            if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}"
        )
        raise TypeError(f"trim must be True or False, got {trim!r} of type {name}")
    return trim


class Encoder:
    """Encodes one source's batches, one after another: while their structure repeats,
    the last batch's layout is reused and only the small values are encoded anew.

    Args:
        align: every leaf's offset is a multiple of this (a power of two).
        trim: what :meth:`encode` does when not told.

    Raises:
        ValueError: ``align`` is not a power of two the format allows.
        TypeError: ``trim`` is not a bool.
    """

    __slots__ = ("_align", "_layout", "_trim")

    def __init__(self, *, align: int = DEFAULT_ALIGN, trim: bool = True) -> None:
        self._align = check_align(align)
        self._trim = check_trim(trim)
        #: the last batch's layout; it holds no tensors, so it keeps no batch alive
        self._layout: Layout | None = None

    def encode(
        self, tree: Any, *, trim: bool | None = None, receiver: str | None = None
    ) -> Encoded:
        """Flatten ``tree`` and lay its leaves out; no buffer is touched yet.

        Args:
            tree: the batch.
            trim: trim the leaves where it pays (NOTE [ Trimmed leaves ], ``codec.trim``);
                None: as the encoder was made.
            receiver: where the receivers rebuild, ``"host"`` or ``"device"``
                (``codec.trim.decide``); None: where the batch's tensors are (a batch on a
                GPU is rebuilt on GPUs, one on the host on hosts).

        Raises:
            UnsupportedLeafError: a leaf, key or container cannot travel.
            ValueError: tensors on more than one device, a cyclic tree, a buffer over the
                format's limit.
        """
        tokens, values, leaves, loose = flatten(tree)
        # A leaf's (kind, code, shape) fixes its size, so equal kinds and tokens mean an
        # equal layout: steady state compares them instead of laying the leaves out, and
        # encodes only the small values.
        kinds = list(map(KIND, leaves))
        layout = self._layout
        if (
            layout is None
            or loose
            or not layout.comparable
            or layout.tokens != tokens
            or layout.kinds != kinds
        ):
            layout = self._layout = lay_out(leaves, kinds, tokens, self._align, not loose)
        if self._trim if trim is None else check_trim(trim):
            # unknown receivers: the looser floor's candidates, then decided by the batch
            candidates = layout.candidates(receiver or "device")
            if candidates:
                trims = _find_trims(leaves, candidates, receiver)
                if trims:
                    layout = layout.trimmed_layout(leaves, trims)
                    return Encoded(leaves, values, layout, layout.header(values, trims), trims)
        return Encoded(leaves, values, layout, layout.header(values))


def _find_trims(
    leaves: list[BufferLeaf], candidates: list[int], receiver: str | None
) -> dict[int, Trim] | None:
    """The side tables of the ``candidates`` that trimming pays for, by leaf index.

    A tensor on a GPU is sent whole: deciding its trim reads it back to the host, 2 to
    8 host syncs a leaf and a batch, each one draining the device's queue (and refused
    inside a CUDA graph capture), which the bytes saved on NVLink do not repay. Host
    leaves (an ndarray beside a GPU batch too) are decided as ever."""
    if receiver is None:
        first = next((leaf[3] for leaf in leaves if leaf[0] == "tensor"), None)
        receiver = "device" if first is not None and first.device.type == "cuda" else "host"
    trims = {}
    for i in candidates:
        kind, code, shape, leaf = leaves[i]
        if kind == "tensor" and not leaf.is_cpu:
            continue  # deciding a device leaf's trim would sync the host: it travels whole
        try:
            found = _trim.plan(leaf, receiver=receiver)  # a copy made once, if one is
        except (RuntimeError, ValueError, TypeError):
            continue  # trimming is an optimisation: a leaf it cannot read travels whole
        if found is not None:
            trims[i], copy = found
            if copy is not leaf:
                leaves[i] = (kind, code, shape, copy)
    return trims or None


def encode(
    tree: Any, *, align: int = DEFAULT_ALIGN, trim: bool = True, receiver: str | None = None
) -> Encoded:
    """Flatten ``tree`` and lay its leaves out, with nothing reused from another batch
    (``trim`` and ``receiver`` as for :meth:`Encoder.encode`).

    Raises:
        UnsupportedLeafError: a leaf, key or container cannot travel.
        ValueError: bad ``align``, tensors on more than one device, a cyclic tree.
        TypeError: ``trim`` is not a bool.
    """
    return Encoder(align=align).encode(tree, trim=check_trim(trim), receiver=receiver)
