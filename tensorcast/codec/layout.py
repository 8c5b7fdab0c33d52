"""The second step of packing: a flattened batch's leaves placed in the buffer.

Each leaf gets an offset aligned to ``align`` (or to its itemsize, when larger) after
the one before it; the leaf table and the structure make the header's bytes up to the
small values. A :class:`Layout` keeps both, so a next batch of the same structure reuses
them (``codec.encode.Encoder``) and encodes its values alone.

A batch with trimmed leaves (NOTE [ Trimmed leaves ], ``codec.trim``) stores fewer bytes
for them, so its offsets after the first one differ from its structure's: it gets a
layout of its own (:meth:`Layout.trimmed`), which shares the structure's compiled
program; its structure's layout stays as it was for the next batch.
"""

from __future__ import annotations

import operator
from typing import Any

from tensorcast.codec import schema as _schema
from tensorcast.codec import trim as _trim
from tensorcast.codec.build import Program, compile_tokens, decode_values
from tensorcast.codec.dtypes import CODE_ITEMSIZE
from tensorcast.codec.flatten import BufferLeaf
from tensorcast.codec.repad import Trim
from tensorcast.codec.views import ViewSpec

__all__ = ["DEFAULT_ALIGN", "KIND", "Layout", "lay_out"]

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
        #: the leaves stored trimmed (a batch's own layout: :meth:`trimmed`)
        self.trimmed = trimmed
        #: the views leaves are written through (bool leaves as bytes): every layout is
        #: written, so it is made with the layout
        self.write_spec = ViewSpec(table, bool_as_bytes=True, trimmed=trimmed)
        self._candidates: dict[str, list[int]] = {}  # receiver -> leaves worth a probe
        self._read_spec: ViewSpec | None = None
        self._program: Program | None = None
        self._consts: tuple[list[Any], list[Any]] | None = None  # values -> consts, last used
        self._gaps: list[tuple[int, int]] | None = None
        self._last: tuple[list[Any], bytes] | None = None  # values -> header, last used

    def header(self, values: list[Any], trims: dict[int, Trim] | None = None) -> bytes:
        """The header of the batch of this structure with these small values (and these
        side tables, for a layout of :meth:`trimmed`).

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
