"""Trimmed leaves: a padded leaf stored as its rows' prefixes, and rebuilt bit-identical.

NOTE [ Trimmed leaves ]
~~~~~~~~~~~~~~~~~~~~~~~
*The rule.* A dense tensor or ndarray leaf of 2 or more dims is read as ``B = shape[0]``
rows of ``n = prod(shape[1:])`` elements each, every row flat in C order. A row's *run*
is the longest tail of it whose elements all equal its last element, compared as raw
bits: an element is its ``itemsize`` bytes, read as an integer of that width (bool,
uint8 and float8 as ``uint8``; float16 and bfloat16 as ``int16``; complex128 as two
``int64``). NaN payloads, ``-0.0``, ``LOG_EPSILON`` or a pad id are values like any other,
so the rebuilt leaf is bit-identical whatever the data.

A trimmed leaf stores each row's *prefix* (the row without its run), the prefixes back to
back in row order, and a side table (:class:`Trim`): each row's run length and the run's
element. Only runs of at least :data:`MIN_RUN_BYTES` count; a shorter tail stays in
its row's prefix (run length 0), since it costs the header more than it saves and, on the
longest rows of a batch, would add their last samples to the elements that travel.

A leaf is trimmed only when that saves at least :data:`MIN_SAVED_BYTES` and at least an
eighth of its bytes, after the side table's own bytes (the contract's floor: nothing
below it is ever trimmed), and where it pays (:func:`decide`). The receivers pay for a
trim with its re-pad, a write of the whole leaf: on a GPU that is nearly free, and the
floor alone decides; on a host it costs about a third of what sending the same bytes on
gloo costs, plus a fixed cost and a few microseconds a row, so a host's trims must also
save :data:`HOST_MIN_SHARE` of the leaf and :data:`HOST_MIN_SAVED_BYTES` plus
:data:`HOST_ROW_BYTES` a row. The re-pad is that cheap only into memory the receiver
reuses: fresh memory costs its page faults, more than the bytes saved (the measurements
are in ``docs/design.md``).

*The steps*, where packing and unpacking run them:

====================  ==================================================================
:func:`probe`         ``B x 4 log2(n)`` element reads: could a trim pay?
:func:`scan`          every row's run: one ``amin`` and one ``amax`` of the leaf's 4 KiB
                      chunks, then one chunk a row compared element by element
:func:`decide`        the side table, if trimming clears the floor and pays (else None)
:func:`compact_into`  the prefixes, back to back, into the packed buffer's slice
``schema.validate``   a side table from the header, checked before anything is allocated
``repad.repad``       the full leaf: on a host, the runs set and a memcpy a row; on a
                      device, a fill and a masked scatter, with no host sync (every size
                      is known on the host)
====================  ==================================================================

:func:`plan` is ``probe`` + ``scan`` + ``decide`` (and the copy a scan needs), what the
encoder runs for a leaf; :func:`find` its side table alone.

*Multichannel audio*, ``(B, C, T)``: a row is one example's ``C * T`` samples, channel
after channel, so only the last channel's padding ends the row; the other channels'
padding sits inside it and travels. Reading such a leaf as ``B * C`` rows would trim every
channel's padding, at the price of ``C`` times the run lengths in the header and a
second shape of record. Rows stay along dim 0: the contract defines them so; speech
batches are mono in lhotse's and NeMo's collates (a multichannel ``(B, T, C)`` layout, as
features ``(B, T, F)``, already trims fully); and a later format version can add a field
for the number of leading dims that make a row without changing anything here but
``schema.validate``.

The side table's bytes in the header are specified in ``docs/format.md`` (Trimmed
leaves). The side table (``Trim``) and its checks are the header's
(:mod:`tensorcast.codec.schema`), an element's bits are its dtype's
(``codec.dtypes.as_words``), and :mod:`tensorcast.codec.repad` re-pads the leaf on both
roles.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorcast.codec.dtypes import as_words
from tensorcast.codec.repad import row_pieces
from tensorcast.codec.schema import MAX_REBUILD_RATIO, Trim

__all__ = [
    "HOST_MIN_SAVED_BYTES",
    "HOST_MIN_SHARE",
    "HOST_ROW_BYTES",
    "MIN_RUN_BYTES",
    "MIN_SAVED_BYTES",
    "MIN_SAVED_FRACTION",
    "RECEIVERS",
    "Runs",
    "compact_into",
    "decide",
    "find",
    "plan",
    "min_run",
    "padding_bytes",
    "probe",
    "readable",
    "scan",
    "side_table",
]

#: the contract's floor: a trim saves at least this many bytes...
MIN_SAVED_BYTES = 4096
#: ... and at least ``1 / MIN_SAVED_FRACTION`` of the leaf's bytes
MIN_SAVED_FRACTION = 8
#: a row's run counts only when it spans at least this many bytes (and 2 elements)
MIN_RUN_BYTES = 64
#: host receivers: the share of the leaf's bytes a trim must save to pay for its re-pad,
#: a write of the whole leaf...
HOST_MIN_SHARE = 0.35
#: ... and the bytes it must save to pay for the fixed cost of the steps...
HOST_MIN_SAVED_BYTES = 256 << 10
#: ... and for the cost of each row (its views and copies)
HOST_ROW_BYTES = 24 << 10
#: where the receivers rebuild a trimmed leaf (see :func:`decide`)
RECEIVERS = ("host", "device")

# The scan's chunks (see _prefix_lens): small enough that gathering one per row is cheap,
# large enough that the per-chunk results are few. Leaves up to _ONE_LEVEL_BYTES are
# compared whole: there a second level would cost more ops than bytes.
_CHUNK_BYTES = 1 << 12
_ONE_LEVEL_BYTES = 1 << 18

_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, check_circular=False).encode


@dataclass(frozen=True, slots=True)
class Runs:
    """What :func:`scan` found, before any decision: every row's run, however short.

    Attributes:
        row_len: ``n``, the elements in a row.
        itemsize: the bytes of one element.
        prefix_lens: ``(B,)`` int64 ndarray, the elements before each row's run (0 for a row that
            is all one value, ``n - 1`` for a row whose last two elements differ).
        elements: ``(B, itemsize)`` uint8 ndarray, each row's last element as bytes.
    """

    row_len: int
    itemsize: int
    prefix_lens: np.ndarray
    elements: np.ndarray

    @property
    def runs(self) -> np.ndarray:
        """``(B,)`` int64, each row's run length in elements."""
        return self.row_len - self.prefix_lens


def min_run(itemsize: int) -> int:
    """The fewest elements of a run that counts: :data:`MIN_RUN_BYTES`, and at least 2."""
    return max(2, -(-MIN_RUN_BYTES // itemsize))


def _pays(saved: int, full: int, rows: int, receiver: str) -> bool:
    """Whether saving ``saved`` of a leaf's ``full`` bytes clears the floor and pays for
    the re-pad where ``receiver`` says the receivers rebuild (see :func:`decide`)."""
    if saved < MIN_SAVED_BYTES or saved * MIN_SAVED_FRACTION < full:
        return False
    return receiver == "device" or (
        saved >= HOST_MIN_SHARE * full and saved >= HOST_MIN_SAVED_BYTES + rows * HOST_ROW_BYTES
    )


def _check_receiver(receiver: str) -> None:
    if receiver not in RECEIVERS:
        raise ValueError(f"receiver must be one of {RECEIVERS}, got {receiver!r}")


# --------------------------------------------------------------------------- bits


def readable(leaf: Any) -> Any:
    """``leaf`` itself where the scan and the compaction can read it as it is (a
    contiguous tensor; a C-contiguous, writable ndarray), else one contiguous copy of the
    same kind, bit for bit: of a strided, flipped or read-only ndarray (a field of a
    packed structured array too), of a non-contiguous tensor, of a conjugate or
    negative-bit view (whose bits are not its values). The encoder makes it once, where
    the probe says a trim could pay, and scans and compacts the copy (:func:`plan`): one
    pass over host memory, cheaper than the padding's bytes on the wire to every
    receiver, where each step would otherwise copy the leaf again."""
    if isinstance(leaf, np.ndarray):
        if leaf.flags.c_contiguous and leaf.flags.writeable:
            return leaf
        return np.array(leaf, order="C")  # a copy, writable: torch wraps it as it is
    if leaf.is_contiguous() and not (leaf.is_conj() or leaf.is_neg()):
        return leaf
    values = leaf.detach().resolve_conj().resolve_neg()  # a copy where it was a view of either
    if values.is_contiguous():
        return values
    copy = torch.empty_like(values, memory_format=torch.contiguous_format)
    as_words(copy).copy_(as_words(values))  # bit for bit: a bool copy would keep 0 / 1 only
    return copy


def _tensor(leaf: Any) -> torch.Tensor:
    """``leaf`` as a contiguous tensor of the bits ``trim=False`` would store: the leaf's
    own memory where it is :func:`readable` as it is, else a copy."""
    leaf = readable(leaf)
    return torch.from_numpy(leaf) if isinstance(leaf, np.ndarray) else leaf.detach()


def _row_words(leaf: Any) -> torch.Tensor:
    """``leaf``'s rows as a contiguous ``(B, n)`` integer tensor (``(B, n, 2)`` for 16-byte
    elements), viewing :func:`_tensor`'s memory."""
    t = _tensor(leaf)
    words = as_words(t)
    return words.view(t.shape[0], math.prod(t.shape[1:]), *words.shape[t.dim() :])


# --------------------------------------------------------------------------- encode


def probe(leaf: Any, *, receiver: str = "host") -> bool:
    """A first look, O(B log n) element reads: could trimming ``leaf`` pay?

    Each row's last element is compared with the elements 1, 2, 3, ... 11, 13, 16, 19, ...
    places before it (four distances to an octave, up to the row's first element): the
    first that differs bounds the row's run, within about a fifth. False when the bounds
    cannot add up to a trim that pays (:func:`decide`), or when the leaf has fewer than 2
    dims or is too small; then :func:`scan` is not worth running. One indexing op reads
    the elements through the leaf's strides; the rest is numpy on ``B x 4 log2(n)`` words.

    Raises:
        ValueError: an unknown ``receiver``.
    """
    _check_receiver(receiver)
    shape = tuple(leaf.shape)
    if len(shape) < 2:
        return False
    isz = leaf.itemsize
    rows, n = shape[0], math.prod(shape[1:])
    full = rows * n * isz
    shortest = min_run(isz)
    if n < shortest or not _pays(full, full, rows, receiver):
        return False
    steps = _ladder(n)
    words = _pick(leaf, shape, n - 1 - np.concatenate(([0], steps)))
    differ = words[:, 1:] != words[:, :1]
    if differ.ndim == 3:
        differ = differ.any(2)
    bound = np.where(differ.any(1), steps[differ.argmax(1)], n)
    bound[bound < shortest] = 0
    return _pays(int(bound.sum()) * isz, full, rows, receiver)


def _ladder(n: int) -> np.ndarray:
    """Distances from a row's last element, 1 up to ``n - 1``, four to an octave: the
    first one whose element differs bounds the run within a factor of 2 ** (1 / 4)."""
    steps = np.unique(np.round(2.0 ** (np.arange(4 * (n - 1).bit_length() + 1) / 4)))
    return np.append(steps[steps < n - 1], n - 1).astype(np.int64)


def _pick(leaf: Any, shape: tuple[int, ...], positions: np.ndarray) -> np.ndarray:
    """Every row's elements at the flat ``positions`` of the row, as host words:
    ``(B, P)`` or ``(B, P, 2)``. One indexing op through the leaf's strides."""
    coords = np.unravel_index(positions, shape[1:])
    index: tuple[Any, ...]
    if isinstance(leaf, np.ndarray):
        index = (slice(None), *coords)
        picked = as_words(torch.from_numpy(leaf[index]))  # a new array
    else:  # through the integer view: not every dtype can be indexed (float4)
        index = (slice(None), *map(torch.from_numpy, coords))
        t = leaf.detach()
        if t.is_conj() or t.is_neg():  # its bits are not its values: index, then resolve
            picked = as_words(t[index].resolve_conj().resolve_neg())
        else:
            picked = as_words(t)[index]
    return picked.cpu().numpy()


def scan(leaf: Any) -> Runs:
    """Every row's run, vectorised over rows, with no Python loop.

    A leaf of up to 256 KiB is compared with its rows' last elements whole. A larger one
    in two levels: its rows are cut into 4 KiB chunks from their ends, and an ``amin``
    and an ``amax`` per chunk (torch, on the leaf's device: the only passes over the
    whole leaf) find each row's last chunk that is not all its last element; that one
    chunk per row is then gathered and compared element by element. The small results
    are worked on the host, in numpy, whose ops cost a fraction of torch's: a leaf on a
    GPU would cost 2 to 8 host syncs with :func:`probe`, so the encoder sends such a
    leaf whole (``codec.encode``).

    A leaf that is not :func:`readable` as it is is copied first; pass the copy to
    :func:`scan` and :func:`compact_into` to copy it once (as :func:`plan` does).
    """
    words = _row_words(leaf)
    rows, n = words.shape[0], words.shape[1]
    isz = leaf.itemsize
    if rows == 0 or n == 0:
        return Runs(n, isz, np.zeros(rows, np.int64), np.zeros((rows, isz), np.uint8))
    last = _host(words[:, n - 1 : n])  # (B, 1) or (B, 1, 2)
    elements = np.ascontiguousarray(last).view(np.uint8).reshape(rows, isz)
    return Runs(n, isz, _prefix_lens(words, last, isz), elements)


def _host(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy()


def _prefix_lens(words: torch.Tensor, last: np.ndarray, itemsize: int) -> np.ndarray:
    """Elements before each row's run (0 for a row that is all one value)."""
    rows, n = words.shape[0], words.shape[1]
    chunk = max(1, _CHUNK_BYTES // itemsize)
    if rows * n * itemsize <= _ONE_LEVEL_BYTES or n <= chunk:
        return _last_differing(_host(words), last, 0)
    chunks, head = divmod(n, chunk)  # whole chunks at the row's end, ``head`` before them
    blocks = words[:, head:].view(rows, chunks, chunk, *words.shape[2:])
    if blocks.dtype == torch.int64:
        low, high = torch.aminmax(blocks, dim=2)  # int64 amin alone is slow on CPUs
    else:
        low, high = blocks.amin(2), blocks.amax(2)
    same = (_host(low) == last) & (_host(high) == last)
    differs = ~(same.all(2) if same.ndim == 3 else same)  # (B, chunks)
    back = differs[:, ::-1].argmax(1)  # the last chunk that differs, counted from the end
    # that chunk; for a row with none, its first elements (the head, then run chunks)
    start = np.where(differs.any(1), head + (chunks - 1 - back) * chunk, 0)
    index = torch.from_numpy(start[:, None] + np.arange(chunk)).to(words.device)
    if words.dim() == 3:
        index = index.unsqueeze(2).expand(rows, chunk, 2)
    return _last_differing(_host(words.gather(1, index)), last, start)


def _last_differing(window: np.ndarray, last: np.ndarray, start: Any) -> np.ndarray:
    """``start`` plus one past the last element of each row of ``window`` (the row's
    elements from ``start`` on) that differs from the row's last element; 0 where none
    does."""
    differ = window != last
    if differ.ndim == 3:
        differ = differ.any(2)
    back = differ[:, ::-1].argmax(1)
    return np.where(differ.any(1), start + window.shape[1] - back, 0).astype(np.int64)


def side_table(runs: Runs, *, min_elements: int | None = None) -> Trim:
    """The side table of ``runs``: runs shorter than ``min_elements`` (default
    :func:`min_run`) set to 0, the elements of the others made distinct and ordered."""
    shortest = min_run(runs.itemsize) if min_elements is None else max(1, min_elements)
    lengths = runs.runs
    counted = lengths >= shortest
    lengths = np.where(counted, lengths, 0)
    which = None
    mine = runs.elements[counted]
    if mine.shape[0] == 0:
        palette = bytes(runs.itemsize)  # no run counts: the table saves nothing
    elif (mine == mine[:1]).all():
        palette = mine[0].tobytes()  # the common case: one pad value
    else:
        unique, inverse = np.unique(mine, axis=0, return_inverse=True)  # sorted as bytes
        palette = unique.tobytes()
        index = np.zeros(len(lengths), np.int64)
        index[counted] = inverse.reshape(-1)
        which = tuple(index.tolist())
    return Trim(runs.row_len, runs.itemsize, tuple(lengths.tolist()), palette, which)


def padding_bytes(leaf: Any) -> int:
    """The bytes of ``leaf``'s rows that a trim would drop: every run that counts
    (:func:`side_table`), whether or not trimming the leaf would pay (:func:`decide`)."""
    return sum(side_table(scan(leaf)).runs) * leaf.itemsize


def decide(runs: Runs, *, receiver: str = "host") -> Trim | None:
    """The side table to trim with, or None where trimming would not clear the floor or
    would not pay.

    The floor: the bytes saved, less the record's own, are at least
    :data:`MIN_SAVED_BYTES` and an eighth of the leaf's. A leaf that is (nearly) all
    padding keeps ``1 / MAX_REBUILD_RATIO`` of its bytes in its rows' prefixes, so that
    its receivers' bound on what a header rebuilds holds. Above it, where the receivers
    rebuild decides: on a ``"device"`` (a GPU, whose re-pad is nearly free) the floor
    alone; on a ``"host"``, whose re-pad writes the whole leaf again, the trim must also
    save :data:`HOST_MIN_SHARE` of the leaf and :data:`HOST_MIN_SAVED_BYTES`, what it
    takes on the wire to make up for the re-pad and the fixed cost of the steps.

    Raises:
        ValueError: an unknown ``receiver``.
    """
    _check_receiver(receiver)
    table = side_table(runs)
    full = table.full_nbytes
    travels = table.nbytes + len(_dumps(table.record))
    if full > MAX_REBUILD_RATIO * travels:  # receivers would refuse it as it is
        table = _within_bound(table)
        travels = table.nbytes + len(_dumps(table.record))
    return table if _pays(full - travels, full, len(table.runs), receiver) else None


def _within_bound(table: Trim) -> Trim:
    """``table`` with every row keeping enough of its run that the prefixes alone hold
    ``1 / MAX_REBUILD_RATIO`` of the leaf: a leaf (nearly) all padding stays within the
    bound its receivers check (``schema.check_rebuild``) and still drops all but that."""
    rows = len(table.runs)
    least = -(-table.full_nbytes // (MAX_REBUILD_RATIO * table.itemsize * rows))  # elements
    runs = np.minimum(np.asarray(table.runs, np.int64), table.row_len - least)
    runs[runs < min_run(table.itemsize)] = 0
    return Trim(table.row_len, table.itemsize, tuple(runs.tolist()), table.elements, table.which)


def find(leaf: Any, *, receiver: str = "host") -> Trim | None:
    """How to trim ``leaf``, or None: :func:`plan`'s side table.

    Raises:
        ValueError: an unknown ``receiver``.
    """
    found = plan(leaf, receiver=receiver)
    return None if found is None else found[0]


def plan(leaf: Any, *, receiver: str = "host") -> tuple[Trim, Any] | None:
    """How to trim ``leaf``, and the leaf to compact it from, or None: :func:`probe`,
    then :func:`scan` and :func:`decide` of the leaf made :func:`readable` (copied once,
    where the probe says a trim could pay; the copy is what :func:`compact_into` reads).

    Raises:
        ValueError: an unknown ``receiver``.
    """
    if not probe(leaf, receiver=receiver):
        return None
    copy = readable(leaf)
    table = decide(scan(copy), receiver=receiver)
    return None if table is None else (table, copy)


def compact_into(out: torch.Tensor, leaf: Any, prefix_lens: Sequence[int]) -> None:
    """Write every row's first ``prefix_lens[i]`` elements into ``out``, back to back, row
    by row.

    One ``split`` of the rows' bytes into (prefix, run) pieces and one ``cat`` of the
    prefixes into ``out``: a memcpy per row inside torch, no Python loop over rows.

    Args:
        out: a 1-D uint8 tensor of exactly ``sum(prefix_lens) * itemsize`` bytes (a slice of the
            packed buffer), on any device.
        leaf: the tensor or ndarray, as given to :func:`scan`.
        prefix_lens: each row's prefix length in elements, as ints (``Trim.prefix_lens``).

    Raises:
        ValueError: ``prefix_lens`` or ``out`` does not fit the leaf.
    """
    t = _tensor(leaf)
    rows, n = t.shape[0], math.prod(t.shape[1:])
    lens = prefix_lens
    if len(lens) != rows or (rows and not 0 <= min(lens) <= max(lens) <= n):
        raise ValueError(f"expected {rows} prefix lengths, one per row, each in [0, {n}]")
    total = sum(lens) * leaf.itemsize
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != total:
        raise ValueError(
            f"out must be a 1-D uint8 tensor of {total} bytes (the prefixes' elements), got "
            f"{out.dtype} of shape {tuple(out.shape)}"
        )
    if not total:
        return
    prefixes = row_pieces(t, lens, n, leaf.itemsize)[::2]
    if out.device == t.device:
        torch.cat(prefixes, out=out)
    else:
        out.copy_(torch.cat(prefixes), non_blocking=True)
