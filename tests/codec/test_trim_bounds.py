"""Trimming as a demanding user meets it: leaves the scan cannot read as they are still
travel, ``trim=`` takes only a bool, and a header's trimmed leaves rebuild within bounds
(``docs/format.md``, Trimmed leaves) with bounded scratch, whatever the rows.

The laws: ``unpack(pack(x, trim=True)) == x`` wherever ``pack(x, trim=False)`` works;
a header whose trimmed leaves would rebuild past ``MAX_REBUILD_RATIO`` times what
travelled, or past ``TENSORCAST_REBUILD_LIMIT``, is a ``HeaderError`` before anything is
allocated; the rebuild makes no object per row of short rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import assert_same

import tensorcast as tc
from tensorcast.codec import repad as R
from tensorcast.codec import schema as S
from tensorcast.codec import trim as T

FEW = settings(deadline=None, print_blob=True, max_examples=30)


def padded(rows: int = 16, n: int = 20_000, dtype: Any = np.float32) -> np.ndarray:
    """Rows of 1, 2, 3, ... then zeros over a growing share of each row."""
    a = np.zeros((rows, n), dtype)
    for i in range(rows):
        a[i, : n // (i + 2)] = np.arange(1, n // (i + 2) + 1)
    return a


def _structured_field() -> np.ndarray:
    packed = np.zeros((16, 20_000), dtype=[("x", "<f4"), ("y", "u1")])  # 5-byte records
    packed["x"] = padded()
    return packed["x"]  # strides (100_000, 5): not a multiple of its itemsize


def _complex() -> torch.Tensor:
    return torch.from_numpy(padded()).to(torch.complex64)


def _read_only() -> np.ndarray:
    a = padded()
    a.flags.writeable = False
    return a


# The layouts the scan cannot read as they are: each travels with trim=False.
LAYOUTS = {
    "read_only": _read_only,
    "stepped_tensor": lambda: torch.from_numpy(padded(n=40_000))[:, ::2],
    "rows_flipped": lambda: padded()[::-1],
    "columns_flipped": lambda: np.flip(padded(), 1),
    "structured_field": _structured_field,
    "conj_view": lambda: _complex().conj(),
    "neg_bit_view": lambda: _complex()._neg_view(),
    "transposed_tensor": lambda: torch.from_numpy(padded()).t(),
}


def _resolved(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.resolve_conj().resolve_neg().contiguous()
    return np.ascontiguousarray(x)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_that_travels_whole_travels_trimmed(name: str) -> None:
    leaf = LAYOUTS[name]()
    for trim in (False, True):
        packed = tc.pack({"x": leaf, "n": 3}, trim=trim)
        assert_same(tc.unpack(packed), {"x": _resolved(leaf), "n": 3})
    if name not in ("columns_flipped", "transposed_tensor"):  # rows that end in padding
        assert tc.read_header(packed.header).leaves[0].trimmed, "copied, then trimmed"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_leaf_is_copied_once_and_the_copy_read_as_it_is(name: str) -> None:
    """The law: ``readable(x)`` holds ``x``'s bits, and ``readable`` of it is itself: the
    encoder copies such a leaf once (``plan``), and the scan and the compaction read the
    copy in place, where each would copy the leaf again."""
    leaf = LAYOUTS[name]()
    copy = T.readable(leaf)
    assert copy is not leaf and T.readable(copy) is copy
    assert_same(copy, _resolved(leaf))
    found = T.plan(leaf)
    if found is not None:
        assert T.readable(found[1]) is found[1]


def test_a_scan_that_fails_leaves_its_leaf_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the scan cannot read this leaf")

    monkeypatch.setattr(T, "scan", broken)
    leaf = torch.from_numpy(padded())
    packed = tc.pack({"x": leaf})
    assert not tc.read_header(packed.header).leaves[0].trimmed
    assert_same(tc.unpack(packed), {"x": leaf})


@pytest.mark.parametrize("bad", [None, 0, 1, "yes", np.bool_(True)])
def test_trim_takes_only_a_bool_on_every_entry_point(bad: Any) -> None:
    tree = {"x": torch.ones(2)}
    with pytest.raises(TypeError, match="trim must be True or False") as raised:
        tc.pack(tree, trim=bad)
    # names the type as a user would import it: numpy's bool is not the bool
    named = f"numpy.{type(bad).__name__}" if isinstance(bad, np.bool_) else type(bad).__name__
    assert str(raised.value).endswith(f"of type {named}")
    with pytest.raises(TypeError, match="trim must be True or False"):
        tc.broadcast(tree, 0, trim=bad)  # before it asks for torch.distributed
    with pytest.raises(TypeError, match="trim must be True or False"):
        tc.broadcast_batch(tree, None, trim=bad)  # a no-op call checks it too
    with pytest.raises(TypeError, match="trim must be True or False"):
        tc.BroadcastingDataLoader([tree], device_mesh=None, trim=bad)
    with pytest.raises(TypeError, match="trim must be True or False"):
        tc.packed_collate(trim=bad)


# --------------------------------------------------------------------------- bounds


def test_a_header_over_the_rebuild_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    leaf = torch.from_numpy(padded(n=40_000))
    packed = tc.pack({"x": leaf})
    assert tc.read_header(packed.header).leaves[0].trimmed
    monkeypatch.setenv(S.REBUILD_LIMIT_ENV, str(leaf.nbytes - 1))
    with pytest.raises(tc.HeaderError, match=S.REBUILD_LIMIT_ENV):
        tc.unpack(packed)
    monkeypatch.setenv(S.REBUILD_LIMIT_ENV, str(leaf.nbytes))
    assert_same(tc.unpack(packed), {"x": leaf})
    monkeypatch.setenv(S.REBUILD_LIMIT_ENV, " ")  # set empty: the default
    assert_same(tc.unpack(packed), {"x": leaf})
    for bad in ("abc", "-1", "1e9"):  # the setting is wrong, not the header: says which
        monkeypatch.setenv(S.REBUILD_LIMIT_ENV, bad)
        with pytest.raises(tc.HeaderError, match=r"cannot check a header's trimmed leaves: "):
            tc.unpack(packed)


@pytest.mark.parametrize("real", [0, 3, 100, 300])
def test_a_leaf_nearly_all_padding_keeps_just_enough_for_its_receivers_bound(real: int) -> None:
    """Law: whatever a leaf's padding, what it stores and its record are at least
    ``1 / MAX_REBUILD_RATIO`` of its bytes (its receivers accept it) and, where more of
    its rows is padding than that, no more than that plus a row's rounding: a leaf all
    padding (an all -100 label tensor) drops all but a 1024th, it does not travel whole."""
    leaf = torch.full((4, 1 << 18), -100.0)
    leaf[:, :real] = torch.arange(1.0, real + 1)
    packed = tc.pack({"x": leaf})
    spec = tc.read_header(packed.header).leaves[0]
    assert spec.trimmed
    assert leaf.nbytes <= S.MAX_REBUILD_RATIO * (packed.nbytes + len(packed.header))
    assert packed.nbytes <= max(leaf.nbytes // S.MAX_REBUILD_RATIO, 4 * real * 4) + 64
    assert_same(tc.unpack(packed), {"x": leaf})


def test_a_failing_allocation_is_a_header_error_naming_the_leaf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    packed = tc.pack({"a": 1, "x": torch.from_numpy(padded())})
    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if args and args[0] == (16, 20_000):
            raise RuntimeError("DefaultCPUAllocator: not enough memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(tc.HeaderError, match=r"trimmed leaf 0 \(F32 of shape \[16, 20000\]\)"):
        tc.unpack(packed)


def _table(rows: int, n: int, itemsize: int, seed: int, pads: int) -> S.Trim:
    g = np.random.default_rng(seed)
    runs = tuple(int(r) for r in g.integers(0, n + 1, rows))
    elements = b"".join(bytes([k + 1]) * itemsize for k in range(pads))
    which = None if pads == 1 else tuple(int(w) for w in g.integers(0, pads, rows))
    return S.Trim(n, itemsize, runs, elements, which)


def _reference(stored: torch.Tensor, table: S.Trim, dtype: torch.dtype) -> bytes:
    """The leaf row by row in Python: the prefix, then the run's element."""
    isz, out, at = table.itemsize, bytearray(), 0
    data = stored.numpy().tobytes()
    for i, run in enumerate(table.runs):
        keep = (table.row_len - run) * isz
        k = 0 if table.which is None else table.which[i]
        out += data[at : at + keep] + table.elements[k * isz : (k + 1) * isz] * run
        at += keep
    return bytes(out)


@FEW
@given(
    rows=st.integers(1, 300),
    n=st.integers(1, 40),
    dtype=st.sampled_from([torch.uint8, torch.int16, torch.float32, torch.int64, torch.complex128]),
    pads=st.integers(1, 3),
    chunk=st.integers(1, 200),
    seed=st.integers(0, 2**16),
)
def test_short_rows_rebuild_by_chunks_on_host_and_device_paths(
    rows: int, n: int, dtype: torch.dtype, pads: int, chunk: int, seed: int
) -> None:
    """The law: both rebuilds equal the row-by-row reference, whatever the chunking."""
    table = _table(rows, n, dtype.itemsize, seed, pads)
    stored = torch.randint(0, 256, (table.nbytes,), dtype=torch.uint8)
    want = _reference(stored, table, dtype)
    saved = R._HOST_CHUNK, R._DEVICE_CHUNK
    R._HOST_CHUNK = R._DEVICE_CHUNK = chunk
    try:
        host = R.repad(stored, (rows, n), dtype, table)
        device = torch.empty((rows, n), dtype=dtype)
        R._rebuild_masked(stored, device, table)
    finally:
        R._HOST_CHUNK, R._DEVICE_CHUNK = saved
    for got in (host, device):
        words = torch.view_as_real(got) if got.is_complex() else got
        assert words.contiguous().view(torch.uint8).numpy().tobytes() == want


def test_many_short_rows_rebuild_with_no_view_per_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A header of many rows (at the header cap, millions) rebuilds in time bounded by its
    bytes: no Python object, tensor view or list entry per row on either path."""
    rows, n = 100_000, 16
    table = S.Trim(n, 4, tuple([n // 2] * rows), bytes(4))
    stored = torch.zeros(table.nbytes, dtype=torch.uint8)
    lists: list[int] = []
    for name in ("_foreach_copy_", "_foreach_zero_"):
        real = getattr(torch, name)

        def counted(tensors: list[Any], *rest: Any, _real: Any = real) -> Any:
            lists.append(len(tensors))
            return _real(tensors, *rest)

        monkeypatch.setattr(torch, name, counted)
    split = torch.Tensor.split
    splits: list[int] = []

    def counted_split(self: torch.Tensor, sizes: Any, *rest: Any) -> Any:
        out = split(self, sizes, *rest)
        splits.append(len(out))
        return out

    monkeypatch.setattr(torch.Tensor, "split", counted_split)
    out = R.repad(stored, (rows, n), torch.float32, table)
    device = torch.empty((rows, n))
    R._rebuild_masked(stored, device, table)
    assert max(lists + splits, default=0) < 100
    assert not out.any() and not device.any()


def test_the_device_rebuild_masks_a_bounded_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """``masked_scatter_`` takes an int64 prefix sum of its mask: a chunk of rows at a time
    keeps that scratch bounded whatever the leaf (gpu-path-3 G-3)."""
    monkeypatch.setattr(R, "_DEVICE_CHUNK", 1000)
    x = torch.from_numpy(padded(rows=64, n=300))
    table = T.side_table(T.scan(x))
    stored = torch.empty(table.nbytes, dtype=torch.uint8)
    T.compact_into(stored, x, table.prefix_lens)
    masks: list[int] = []
    real = torch.Tensor.masked_scatter_

    def counted(self: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        masks.append(mask.numel())
        return real(self, mask, source)

    monkeypatch.setattr(torch.Tensor, "masked_scatter_", counted)
    out = torch.empty_like(x)
    R._rebuild_masked(stored, out, table)
    assert torch.equal(out, x)
    assert masks and max(masks) <= 1000
