"""The decode side of trimmed leaves: a header's side table checked, and the leaf rebuilt.

The encode side (probe, scan, decide, compact) is :mod:`tensorcast.codec.trim`, with
NOTE [ Trimmed leaves ]; the record's bytes are specified in ``docs/format.md``. The two
meet only in :class:`~tensorcast.codec.trim.Trim` and the bit views of an element: a
receiver runs this module alone, a source that module (and this one for its own tree).
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from tensorcast._errors import HeaderError
from tensorcast.codec.trim import (
    _WORD,
    MAX_LEAF_BYTES,
    MAX_REBUILD_RATIO,
    Trim,
    _flat_bytes,
    _sizes,
    _words,
)

__all__ = ["REBUILD_LIMIT", "REBUILD_LIMIT_ENV", "check_rebuild", "rebuild", "validate"]

_HEX = re.compile(r"(?:[0-9a-f]{2})+")

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
    if raw is None:
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
        raise _invalid(
            f"the trimmed leaves rebuild to {full} bytes, over this process's limit of "
            f"{limit} bytes: set {REBUILD_LIMIT_ENV} (bytes) higher for larger batches"
        )


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


def rebuild(
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
    current stream with no host sync (the kept lengths, and a table of several elements,
    go up as small copies). A host copies each row's prefix with one memcpy; a device
    scatters them through a mask, a few kernels whatever the rows. An ndarray leaf is
    ``rebuild(...).numpy()`` on the CPU.

    Args:
        stored: 1-D uint8 of exactly ``trim.nbytes``: the prefixes as :func:`compact_into`
            wrote them, on any device (copied to the output's device if elsewhere).
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
        pieces = _flat_bytes(_words(out)).split(_sizes(trim.kept, trim.row_len, isz)[1])
        if trim.which is None and not any(trim.elements):
            torch._foreach_zero_(list(pieces[1::2]))  # write the runs alone
        else:
            _fill(_row_view(out, trim), trim)
        if trim.nbytes:
            kept_bytes = list(map(isz.__mul__, trim.kept))
            torch._foreach_copy_(list(pieces[::2]), list(stored.split(kept_bytes)))
        return
    words = _row_view(out, trim)
    if trim.which is None and not any(trim.elements):
        words.zero_()
    else:
        _fill(words, trim)
    if not trim.nbytes:
        return
    n = trim.row_len
    pair = words.shape[2:]
    dst = words.numpy().reshape(-1, *pair)
    src = stored.numpy().view(dst.dtype).reshape(-1, *pair)
    for r0, r1, s0, s1, kept in _chunks(trim, _HOST_CHUNK):
        starts = np.cumsum(kept) - kept  # each row's first element within the chunk
        rows = np.arange(r0, r1, dtype=np.int64) * n
        dst[np.repeat(rows - starts, kept) + np.arange(s1 - s0)] = src[s0:s1]


def _chunks(trim: Trim, most: int) -> Iterator[tuple[int, int, int, int, np.ndarray]]:
    """The rows cut into chunks of about ``most`` elements (a row longer than that alone):
    ``(first row, end row, first stored element, end stored element, kept lengths)``."""
    kept = trim.row_len - np.asarray(trim.runs, dtype=np.int64)
    per_chunk = max(1, most // max(trim.row_len, 1))
    ends = np.cumsum(kept)
    rows = len(kept)
    for r0 in range(0, rows, per_chunk):
        r1 = min(rows, r0 + per_chunk)
        s1 = int(ends[r1 - 1])
        part = kept[r0:r1]
        yield r0, r1, s1 - int(part.sum()), s1, part


def _rebuild_masked(stored: torch.Tensor, out: torch.Tensor, trim: Trim) -> None:
    """On a device: every element filled, then the prefixes scattered through a mask of
    the kept elements made from the kept lengths (one small upload, no host sync), a chunk
    of rows at a time: a few kernels a chunk, where per-row views would cost the host a few
    us each, and scratch bounded whatever the leaf (``masked_scatter_`` takes an int64
    prefix sum of its mask)."""
    words = _row_view(out, trim)
    if trim.which is None and not any(trim.elements):
        words.zero_()
    else:
        _fill(words, trim)
    if not trim.nbytes:
        return
    if stored.storage_offset() % words.element_size():
        stored = stored.clone()  # a view as words needs their alignment
    values = stored.view(words.dtype)
    if words.dim() == 3:
        values = values.view(-1, 2)
    kept = _upload(torch.tensor(trim.kept, dtype=torch.int64), out.device)
    columns = torch.arange(trim.row_len, device=out.device)
    for r0, r1, s0, s1, _ in _chunks(trim, _DEVICE_CHUNK):
        if s0 == s1:
            continue
        mask = columns < kept[r0:r1].unsqueeze(1)
        if words.dim() == 3:
            mask = mask.unsqueeze(2)  # both words of an element
        words[r0:r1].masked_scatter_(mask, values[s0:s1])


def _upload(small: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``: to a GPU through pinned memory, so the copy is
    queued on the current stream and the host never waits (a pageable copy may)."""
    if device.type != "cuda":
        return small.to(device)
    return small.pin_memory().to(device, non_blocking=True)


def _row_view(out: torch.Tensor, trim: Trim) -> torch.Tensor:
    """A contiguous output's rows as words: ``(B, n)``, or ``(B, n, 2)`` for 16 bytes."""
    pair = (2,) if trim.itemsize == 16 else ()
    return _words(out).view(len(trim.runs), trim.row_len, *pair)


def _fill(words: torch.Tensor, trim: Trim) -> None:
    """Every element of ``words`` (an output's rows as integers) set to its row's run
    element: one fill for a single element, one broadcast copy for several."""
    isz = trim.itemsize
    if trim.which is None and isz <= 8:
        words.fill_(int.from_bytes(trim.elements, "little", signed=isz > 1))
        return
    palette = torch.frombuffer(bytearray(trim.elements), dtype=torch.uint8)
    palette = palette.view(_WORD[min(isz, 8)]).view(len(trim.elements) // isz, -1)
    per_row = palette if trim.which is None else palette[torch.tensor(trim.which)]
    per_row = _upload(per_row, words.device)  # (B or 1, words an element)
    if words.dim() == 2:
        words.copy_(per_row.expand_as(words))  # one word an element: (B or 1, 1)
    else:
        words.copy_(per_row.unsqueeze(1).expand_as(words))
