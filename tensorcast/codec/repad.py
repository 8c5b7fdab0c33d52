"""The re-pad: a trimmed leaf rebuilt from its stored prefixes, bit-identical, on both roles.

Trimming (NOTE [ Trimmed leaves ]) has two sides. The source's, :mod:`tensorcast.codec.trim`
(probe, scan, decide, compact), runs on the source alone. This one runs on every rank: a
receiver re-pads each trimmed leaf of a header whose side tables ``codec.schema`` checked
(:class:`~tensorcast.codec.schema.Trim`, before anything is allocated); a source re-pads
its own tree's leaves the same way. Both sides cut a leaf's rows into the same pieces
(:func:`row_pieces`) and read its elements as integers (``codec.dtypes.as_words``). The
record's bytes are specified in ``docs/format.md``.

A :class:`Repad` is one leaf's re-pad with its memory taken (:meth:`Repad.taken`), left
for its caller to run when it pays: a receiver at once, a source while its payload is on
the wire (NOTE [ The own tree's re-pads ] in ``transport/sender.py``), a device part on
its stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorcast._errors import HeaderError
from tensorcast.codec.dtypes import NUMPY_CODES, TORCH_CODES, WORD, as_words
from tensorcast.codec.schema import Trim

__all__ = ["Repad", "repad", "row_pieces"]


# --------------------------------------------------------------------------- rows


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, 1-D (``view(-1)`` keeps the odd stride a dim of size 1
    may have, and a view as bytes then fails)."""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def row_pieces(
    t: torch.Tensor, prefix_lens: Sequence[int], row_len: int, itemsize: int
) -> tuple[torch.Tensor, ...]:
    """A leaf's bytes cut row by row into its (prefix, run) pieces, interleaved, the
    prefixes ``[::2]`` and the runs ``[1::2]``: views of ``t`` when it is contiguous (as
    the compaction's leaf and the re-pad's output are), else of a contiguous copy made
    through ``as_words`` (a bool copy would turn bytes other than 0 / 1 into 1). One
    ``split``: what the encoder compacts from, and what the re-pad writes into."""
    prefix_bytes = list(map(itemsize.__mul__, prefix_lens))
    both = [0] * (2 * len(prefix_bytes))
    both[::2] = prefix_bytes
    both[1::2] = map((row_len * itemsize).__sub__, prefix_bytes)
    if not t.is_contiguous():
        t = as_words(t).contiguous()
    return _flat_bytes(t).split(both)


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
        trim: the leaf's side table (from ``codec.schema.validate``, on a receiver).
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
