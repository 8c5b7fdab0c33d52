"""The re-pad: a trimmed leaf rebuilt from its stored prefixes, bit-identical, on both roles.

Trimming (NOTE [ Trimmed leaves ]) has two sides. The source's, :mod:`tensorcast.codec.trim`
(probe, scan, decide, compact), runs on the source alone. This one runs on every rank: a
receiver checks a header's side tables (:func:`check_trims`, before anything is
allocated) and re-pads each trimmed leaf (:func:`repad`); a source re-pads its own
tree's leaves the same way. So the vocabulary both sides share lives here: the side
table (:class:`Trim`), the bounds a header must keep, and the bit views of an element
(:func:`as_words`, :func:`row_pieces`). The record's bytes are specified in
``docs/format.md``.

A :class:`Repad` is one leaf's re-pad with its memory taken (:meth:`Repad.taken`), left
for its caller to run when it pays: a receiver at once, a source while its payload is on
the wire (NOTE [ The own tree's re-pads ] in ``transport/sender.py``), a device part on
its stream.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tensorcast._errors import HeaderError
from tensorcast.codec.dtypes import CODE_ITEMSIZE, NUMPY_CODES, TORCH_CODES

__all__ = [
    "MAX_LEAF_BYTES",
    "MAX_REBUILD_RATIO",
    "REBUILD_LIMIT",
    "REBUILD_LIMIT_ENV",
    "WORD",
    "Repad",
    "Trim",
    "check_rebuild",
    "check_trims",
    "repad",
    "row_pieces",
    "validate",
    "as_words",
]

#: the largest full leaf a side table may describe (the format's buffer cap)
MAX_LEAF_BYTES = 1 << 44
#: a header's trimmed leaves rebuild to at most this many times the bytes that travelled
#: (its buffer and the header itself): the encoder trims no leaf past it, receivers refuse
#: a header past it (:func:`check_rebuild`, ``docs/format.md``)
MAX_REBUILD_RATIO = 1024

_HEX = re.compile(r"(?:[0-9a-f]{2})+")


@dataclass(frozen=True, slots=True)
class Trim:
    """A trimmed leaf's side table: what travels in the header beside its prefixes.

    Attributes:
        row_len: ``n = prod(shape[1:])`` (from the leaf table, not the record).
        itemsize: the leaf's element size (from its dtype code, not the record).
        runs: each row's run length in elements; the row keeps ``row_len - run``.
        elements: the distinct run elements, ``itemsize`` bytes each, in increasing order.
        which: each row's index into ``elements``; None when there is one element.
        prefix_lens: each row's prefix length in elements, ``row_len - run`` (made
            with the table).
        nbytes: the bytes stored: every row's prefix (made with the table).
        full_nbytes: the bytes of the full leaf (made with the table).
        record: the JSON-able record the header carries (``docs/format.md``; made with
            the table: the encoder sizes it, then the header holds it).
    """

    row_len: int
    itemsize: int
    runs: tuple[int, ...]
    elements: bytes
    which: tuple[int, ...] | None = None
    prefix_lens: list[int] = field(init=False, compare=False, repr=False)
    nbytes: int = field(init=False, compare=False, repr=False)
    full_nbytes: int = field(init=False, compare=False, repr=False)
    record: list[Any] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # plain fields, not properties: the re-pad and the encoder read them at every leaf
        full = len(self.runs) * self.row_len
        object.__setattr__(self, "prefix_lens", list(map(self.row_len.__sub__, self.runs)))
        object.__setattr__(self, "nbytes", (full - sum(self.runs)) * self.itemsize)
        object.__setattr__(self, "full_nbytes", full * self.itemsize)
        which = None if self.which is None else list(self.which)
        object.__setattr__(self, "record", [list(self.runs), self.elements.hex(), which])


# --------------------------------------------------------------------------- bits

#: an element's bits as an integer of its width
WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width, bit for bit: a view, any strides.
    A 16-byte element (complex128) becomes a trailing pair of int64."""
    isz = t.element_size()
    if isz == 16:
        return torch.view_as_real(t).view(torch.int64)
    return t.view(WORD[isz])


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, 1-D (``view(-1)`` keeps the odd stride a dim of size 1
    may have, and a view as bytes then fails)."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def row_pieces(
    t: torch.Tensor, prefix_lens: Sequence[int], row_len: int, itemsize: int
) -> tuple[torch.Tensor, ...]:
    """A leaf's bytes cut row by row into its (prefix, run) pieces, interleaved, the
    prefixes ``[::2]`` and the runs ``[1::2]``: views of ``t`` when it is contiguous, else
    of a contiguous copy made through :func:`as_words` (a bool copy would turn bytes other
    than 0 / 1 into 1). One ``split``: what the encoder compacts from, and what the re-pad
    writes into."""
    prefix_bytes = list(map(itemsize.__mul__, prefix_lens))
    both = [0] * (2 * len(prefix_bytes))
    both[::2] = prefix_bytes
    both[1::2] = map((row_len * itemsize).__sub__, prefix_bytes)
    return _flat_bytes(as_words(t).contiguous()).split(both)


# --------------------------------------------------------------------------- checks

#: the environment variable that sets :func:`rebuild_limit`, in bytes
REBUILD_LIMIT_ENV = "TENSORCAST_REBUILD_LIMIT"
#: the most bytes one header's trimmed leaves rebuild to, unless the environment says
REBUILD_LIMIT = 16 << 30


def rebuild_limit() -> int:
    """The most bytes one header's trimmed leaves may rebuild to on this process:
    ``TENSORCAST_REBUILD_LIMIT`` when set (bytes), else :data:`REBUILD_LIMIT`.

    Raises:
        ValueError: the variable is set but not a non-negative int.
    """
    raw = os.environ.get(REBUILD_LIMIT_ENV)
    if raw is None or not raw.strip():  # unset, or set empty: the default
        return REBUILD_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(f"{REBUILD_LIMIT_ENV} must be a number of bytes, got {raw!r}")
    return limit


def check_rebuild(full: int, travelled: int, limit: int | None = None) -> None:
    """Refuse a header whose trimmed leaves rebuild to ``full`` bytes when ``travelled``
    bytes (its buffer and the header) came: over :data:`MAX_REBUILD_RATIO` times them, or
    over ``limit`` (default :func:`rebuild_limit`). Checked before anything is allocated.

    Raises:
        HeaderError: over either bound.
    """
    if full > MAX_REBUILD_RATIO * travelled:
        raise _invalid(
            f"the trimmed leaves rebuild to {full} bytes from {travelled} bytes that "
            f"travelled, over {MAX_REBUILD_RATIO} times them"
        )
    limit = rebuild_limit() if limit is None else limit
    if full > limit:
        raise HeaderError(
            f"tensorcast header refused: its trimmed leaves rebuild to {full} bytes, over "
            f"this process's limit of {limit} bytes: set {REBUILD_LIMIT_ENV} (bytes) higher "
            f"for larger batches"
        )


def check_trims(records: list[Any], leaves: list[Any], travelled: int) -> dict[int, Trim] | None:
    """A header's side tables by leaf index, each record checked against its leaf's row
    (whose kind, dtype code and shape are valid; ``codec.schema``): their full leaves
    within the format's buffer cap, and within a bounded multiple of the ``travelled``
    bytes and the rebuild limit (:func:`check_rebuild`). None when no leaf is trimmed.

    Raises:
        HeaderError: a record is malformed, disagrees with its leaf, or is over a bound.
    """
    if not records:
        return None
    tables = {}
    full = 0
    for i, *record in records:
        _kind, code, shape, _off, size = leaves[i]
        table = validate(record, shape, CODE_ITEMSIZE[code], size)
        full += table.full_nbytes
        if full > MAX_LEAF_BYTES:
            raise _invalid(f"the trimmed leaves rebuild to over {MAX_LEAF_BYTES} bytes")
        tables[i] = table
    try:
        check_rebuild(full, travelled)
    except ValueError as e:  # the limit's variable is set wrong: the header is not at fault
        raise HeaderError(f"tensorcast cannot check a header's trimmed leaves: {e}") from None
    return tables


def validate(
    record: Any,
    shape: Sequence[int],
    itemsize: int,
    nbytes: int,
    *,
    max_bytes: int = MAX_LEAF_BYTES,
) -> Trim:
    """A header's side-table record, checked against its leaf before anything is allocated.

    Args:
        record: the JSON-decoded record ``[runs, elements, which]``.
        shape: the leaf's full shape, from the leaf table (non-negative ints).
        itemsize: the element size of the leaf's dtype code.
        nbytes: the bytes the leaf table says the leaf stores.
        max_bytes: the most bytes the full (rebuilt) leaf may have.

    Raises:
        HeaderError: the record is malformed or disagrees with the leaf.
    """
    if type(record) is not list or len(record) != 3:
        raise _invalid("a trimmed leaf's record is not [runs, elements, which]")
    runs, elements, which = record
    if len(shape) < 2:
        raise _invalid(f"a trimmed leaf must have 2 or more dims, got shape {list(shape)}")
    rows, n = shape[0], math.prod(shape[1:])
    if rows * n * itemsize > max_bytes:
        raise _invalid(f"a trimmed leaf of shape {list(shape)} is over {max_bytes} bytes")
    _check_ints(runs, rows, "run lengths")
    if rows and (min(runs) < 0 or max(runs) > n):
        raise _invalid(f"a trimmed leaf has a run length outside [0, {n}], its row length")
    stored = (rows * n - sum(runs)) * itemsize
    if stored != nbytes:
        raise _invalid(
            f"a trimmed leaf's prefixes hold {stored} bytes but the leaf table says {nbytes}"
        )
    if type(elements) is not str or _HEX.fullmatch(elements) is None:
        raise _invalid("a trimmed leaf's elements are not a lowercase hex string")
    raw = bytes.fromhex(elements)
    k, rest = divmod(len(raw), itemsize)
    if rest or k > max(rows, 1):
        raise _invalid(
            f"a trimmed leaf's elements hold {len(raw)} bytes, not up to {max(rows, 1)} "
            f"elements of {itemsize} bytes"
        )
    pieces = [raw[i * itemsize : (i + 1) * itemsize] for i in range(k)]
    if any(a >= b for a, b in itertools.pairwise(pieces)):
        raise _invalid("a trimmed leaf's elements are not distinct and in increasing order")
    if k == 1:
        if which is not None:
            raise _invalid("a trimmed leaf with one element has a `which` list, not null")
        return Trim(n, itemsize, tuple(runs), raw)
    _check_ints(which, rows, "element indices")
    if min(which) < 0 or max(which) >= k:
        raise _invalid(f"a trimmed leaf has an element index outside [0, {k})")
    return Trim(n, itemsize, tuple(runs), raw, tuple(which))


def _check_ints(values: Any, count: int, what: str) -> None:
    if type(values) is not list or len(values) != count:
        raise _invalid(f"a trimmed leaf's {what} are not a list of {count}, one per row")
    if values and not set(map(type, values)) <= {int}:
        raise _invalid(f"a trimmed leaf's {what} hold something other than ints")


def _invalid(what: str) -> HeaderError:
    return HeaderError(f"invalid tensorcast header: {what}")


def repad(
    stored: torch.Tensor,
    shape: Sequence[int],
    dtype: torch.dtype,
    trim: Trim,
    *,
    out: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The full leaf from its stored prefixes, on the output's device: every row's run set
    to its element, its prefix copied before it, in a few vectorised ops.

    Every size comes from ``trim``, which the host holds: on a GPU the ops queue on the
    current stream with no host sync (the prefix lengths, and a table of several elements,
    go up as small copies). A host copies each row's prefix with one memcpy; a device
    scatters them through a mask, a few kernels whatever the rows. An ndarray leaf is
    ``repad(...).numpy()`` on the CPU.

    Args:
        stored: 1-D uint8 of exactly ``trim.nbytes``: the prefixes as :func:`compact_into`
            (``codec.trim``) wrote them, on any device (copied to the output's device if elsewhere).
        shape: the leaf's full shape.
        dtype: the leaf's dtype.
        trim: the leaf's side table (from :func:`validate`, on a receiver).
        out: a contiguous tensor of ``shape`` and ``dtype`` to rebuild into: memory the
            caller reuses (a fresh tensor costs its page faults on a host).
        device: where to rebuild when ``out`` is None; default ``stored``'s device.

    Raises:
        ValueError: ``stored``, ``shape``, ``dtype``, ``out`` or ``device`` does not fit.
    """
    shape = tuple(shape)
    isz = trim.itemsize
    if len(shape) < 2 or shape[0] != len(trim.runs) or math.prod(shape[1:]) != trim.row_len:
        raise ValueError(
            f"shape {list(shape)} is not {len(trim.runs)} rows of {trim.row_len} elements"
        )
    if dtype.itemsize != isz:
        raise ValueError(f"{dtype} has {dtype.itemsize}-byte elements; the table, {isz}")
    if stored.dtype != torch.uint8 or stored.dim() != 1 or stored.numel() != trim.nbytes:
        raise ValueError(
            f"stored must be 1-D uint8 of {trim.nbytes} bytes, got {stored.dtype} of "
            f"shape {tuple(stored.shape)}"
        )
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device or stored.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {list(shape)}")
    elif device is not None and out.device != torch.device(device):
        raise ValueError(f"out is on {out.device}, not on device={device}")
    if out.numel() == 0:
        return out
    on_host = out.device.type == "cpu"
    stored = stored.to(out.device, non_blocking=not on_host)
    (_rebuild_split if on_host else _rebuild_masked)(stored, out, trim)
    return out


# Rows at least this long are copied one view a row (few rows for their bytes, which the
# header's bounds cap); shorter ones through an index, in chunks of rows whose scratch
# (an int64 index on a host; a mask and its int64 prefix sum on a device) stays bounded
# whatever the leaf.
_LONG_ROW_BYTES = 64 << 10
_HOST_CHUNK = 1 << 20  # elements gathered per chunk on a host
_DEVICE_CHUNK = 1 << 22  # elements masked per chunk on a device (or one row, if longer)


def _rebuild_split(stored: torch.Tensor, out: torch.Tensor, trim: Trim) -> None:
    """On a host. Long rows: one ``split`` of the output into (prefix, run) pieces, the
    runs zeroed (one zero element) or every element filled, and the prefixes copied, a
    memcpy a row. Short rows: every element filled, then the prefixes gathered through a
    flat index, a chunk of rows at a time: no Python object a row."""
    isz = trim.itemsize
    if trim.row_len * isz >= _LONG_ROW_BYTES:
        pieces = row_pieces(out, trim.prefix_lens, trim.row_len, isz)
        if trim.which is None and not any(trim.elements):
            torch._foreach_zero_(list(pieces[1::2]))  # write the runs alone
        else:
            _fill(_row_view(out, trim), trim)
        if trim.nbytes:
            prefix_bytes = list(map(isz.__mul__, trim.prefix_lens))
            torch._foreach_copy_(list(pieces[::2]), list(stored.split(prefix_bytes)))
        return
    row_words = _filled_rows(out, trim)
    if not trim.nbytes:
        return
    n = trim.row_len
    pair = row_words.shape[2:]
    dst = row_words.numpy().reshape(-1, *pair)
    src = stored.numpy().view(dst.dtype).reshape(-1, *pair)
    for r0, r1, s0, s1, lens in _chunks(trim, _HOST_CHUNK):
        starts = np.cumsum(lens) - lens  # each row's first element within the chunk
        rows = np.arange(r0, r1, dtype=np.int64) * n
        dst[np.repeat(rows - starts, lens) + np.arange(s1 - s0)] = src[s0:s1]


def _chunks(trim: Trim, most: int) -> Iterator[tuple[int, int, int, int, np.ndarray]]:
    """The rows cut into chunks of about ``most`` elements (a row longer than that alone):
    ``(first row, end row, first stored element, end stored element, prefix lengths)``."""
    lens = trim.row_len - np.asarray(trim.runs, dtype=np.int64)
    per_chunk = max(1, most // max(trim.row_len, 1))
    ends = np.cumsum(lens)
    rows = len(lens)
    for r0 in range(0, rows, per_chunk):
        r1 = min(rows, r0 + per_chunk)
        s1 = int(ends[r1 - 1])
        part = lens[r0:r1]
        yield r0, r1, s1 - int(part.sum()), s1, part


def _rebuild_masked(stored: torch.Tensor, out: torch.Tensor, trim: Trim) -> None:
    """On a device: every element filled, then the prefixes scattered through a mask of
    the prefixes' elements made from their lengths (one small upload, no host sync), a chunk
    of rows at a time: a few kernels a chunk, where per-row views would cost the host a few
    us each, and scratch bounded whatever the leaf (``masked_scatter_`` takes an int64
    prefix sum of its mask)."""
    row_words = _filled_rows(out, trim)
    if not trim.nbytes:
        return
    if stored.storage_offset() % row_words.element_size():
        stored = stored.clone()  # a view as words needs their alignment
    values = stored.view(row_words.dtype)
    if row_words.dim() == 3:
        values = values.view(-1, 2)
    lens = _upload(torch.tensor(trim.prefix_lens, dtype=torch.int64), out.device)
    columns = torch.arange(trim.row_len, device=out.device)
    for r0, r1, s0, s1, _ in _chunks(trim, _DEVICE_CHUNK):
        if s0 == s1:
            continue
        mask = columns < lens[r0:r1].unsqueeze(1)
        if row_words.dim() == 3:
            mask = mask.unsqueeze(2)  # both words of an element
        row_words[r0:r1].masked_scatter_(mask, values[s0:s1])


def _upload(small: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``: to a GPU through pinned memory, so the copy is
    queued on the current stream and the host never waits (a pageable copy may)."""
    if device.type != "cuda":
        return small.to(device)
    return small.pin_memory().to(device, non_blocking=True)


def _row_view(out: torch.Tensor, trim: Trim) -> torch.Tensor:
    """A contiguous output's rows as words: ``(B, n)``, or ``(B, n, 2)`` for 16 bytes."""
    pair = (2,) if trim.itemsize == 16 else ()
    return as_words(out).view(len(trim.runs), trim.row_len, *pair)


def _filled_rows(out: torch.Tensor, trim: Trim) -> torch.Tensor:
    """``out``'s rows as integers, every element set to its row's run element (zeros in
    one write where the run is of zero bytes)."""
    row_words = _row_view(out, trim)
    if trim.which is None and not any(trim.elements):
        row_words.zero_()
    else:
        _fill(row_words, trim)
    return row_words


def _fill(row_words: torch.Tensor, trim: Trim) -> None:
    """Every element of ``row_words`` (an output's rows as integers) set to its row's run
    element: one fill for a single element, one broadcast copy for several."""
    isz = trim.itemsize
    if trim.which is None and isz <= 8:
        row_words.fill_(int.from_bytes(trim.elements, "little", signed=isz > 1))
        return
    palette = torch.frombuffer(bytearray(trim.elements), dtype=torch.uint8)
    palette = palette.view(WORD[min(isz, 8)]).view(len(trim.elements) // isz, -1)
    per_row = palette if trim.which is None else palette[torch.tensor(trim.which)]
    per_row = _upload(per_row, row_words.device)  # (B or 1, words an element)
    if row_words.dim() == 2:
        row_words.copy_(per_row.expand_as(row_words))  # one word an element: (B or 1, 1)
    else:
        row_words.copy_(per_row.unsqueeze(1).expand_as(row_words))


# --------------------------------------------------------------------------- left to run


@dataclass(frozen=True, slots=True)
class Repad:
    """One trimmed leaf's re-pad, its memory taken, left for the caller to run before
    anyone reads the leaf (:meth:`taken`).

    Attributes:
        value: the leaf as the tree holds it: ``out``, or an ndarray viewing it.
        out: the leaf's memory (on a GPU: taken on the stream that was current).
        stored: its stored prefixes.
        trim: its side table, checked when it was made or validated, so running the
            re-pad cannot fail on its sizes.
    """

    value: Any
    out: torch.Tensor
    stored: torch.Tensor
    trim: Trim

    @staticmethod
    def taken(
        kind: str,
        code: str,
        shape: Any,
        stored: torch.Tensor,
        trim: Trim,
        into: torch.Tensor | None,
        index: int,
    ) -> Repad:
        """Trimmed leaf ``index``'s re-pad, its memory taken now: a tensor on the device
        of its ``stored`` prefixes (``into``, reused memory of its shape and dtype, when
        given), an array on the CPU.

        Raises:
            HeaderError: its memory cannot be allocated.
        """
        shape = tuple(shape)
        try:
            if kind == "ndarray":
                out = torch.from_numpy(np.empty(shape, NUMPY_CODES[code]))
                return Repad(out.numpy(), out, stored, trim)
            if into is None:
                into = torch.empty(shape, dtype=TORCH_CODES[code], device=stored.device)
        except (RuntimeError, MemoryError) as e:  # torch's out of memory is a RuntimeError
            raise HeaderError(
                f"the header's trimmed leaf {index} ({code} of shape {list(shape)}) could not "
                f"be allocated: {type(e).__name__}: {e}"
            ) from None
        return Repad(into, into, stored, trim)

    def __call__(self) -> None:
        """Write all of ``out``: the leaf, bit-identical (:func:`repad`)."""
        out = self.out
        repad(self.stored, out.shape, out.dtype, self.trim, out=out)
