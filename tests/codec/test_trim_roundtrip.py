"""Trimmed leaves end to end through the codec: ``pack`` / ``unpack`` / ``read_header``,
``packed_collate``, and a sender and a receiver over the fake wire.

The unit tests of the steps themselves (probe, scan, decide, compact, validate, rebuild)
are ``test_trim.py``.
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import assert_same, padded_audio

import tensorcast as tc
from tensorcast.codec import schema as _schema
from tensorcast.codec import trim as T
from tensorcast.codec.decode import decode
from tensorcast.codec.dtypes import NUMPY_CODES, TORCH_CODES
from tensorcast.codec.encode import encode

SETTINGS = settings(deadline=None, print_blob=True, max_examples=40)
DTYPES = sorted(TORCH_CODES.items())
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of their width (complex128: pairs of int64)."""
    if t.element_size() == 16:
        return torch.view_as_real(t).view(torch.int64)
    return t.view(_WORD[t.element_size()])


def element_bits(kind: str, itemsize: int, g: torch.Generator, dtype: torch.dtype) -> bytes:
    """A run element: zero, -0.0, a NaN with a payload, or random bits."""
    if kind == "zero":
        return bytes(itemsize)
    if kind == "random":
        return bytes(torch.randint(0, 256, (itemsize,), generator=g, dtype=torch.uint8).tolist())
    if dtype.is_floating_point and itemsize in (2, 4, 8):
        value = {"neg0": -0.0, "nan": float("nan")}[kind]
        t = torch.tensor([value], dtype=dtype)
        raw = bytearray(t.view(torch.uint8).numpy().tobytes())
        if kind == "nan":
            raw[0] ^= 0x5A  # a payload other than the default NaN's
        return bytes(raw)
    return bytes([0x80] + [0xFF] * (itemsize - 1))


def padded_leaf(
    dtype: torch.dtype, shape: tuple[int, ...], runs: list[int], element: bytes, seed: int
) -> torch.Tensor:
    """Random bits in rows of ``shape``, row ``i`` ending in ``runs[i]`` copies of
    ``element``; NaN payloads and -0.0 among the data of a float leaf."""
    g = torch.Generator().manual_seed(seed)
    isz = torch.empty((), dtype=dtype).element_size()
    rows, n = shape[0], math.prod(shape[1:])
    raw = torch.randint(0, 256, (rows * n * isz,), generator=g, dtype=torch.uint8)
    leaf = raw.view(dtype).view(rows, n) if rows * n else torch.empty(rows, n, dtype=dtype)
    w = words(leaf)
    pad = words(torch.frombuffer(bytearray(element), dtype=torch.uint8).view(dtype))
    for i, run in enumerate(runs):
        if run:
            w[i, n - run :] = pad[0]
    if dtype.is_floating_point and isz in (2, 4, 8) and rows and n > 2:
        leaf[0, 0] = -0.0
        leaf[0, 1] = float("nan")
    return leaf.view(shape)


@st.composite
def padded_trees(draw: Any) -> tuple[dict[str, Any], list[str]]:
    """A tree of one or two padded leaves, large enough that a host receiver's rule can
    trim them (rows of 512 KiB), any dtype, any run element, rows with no run and
    rows all run, zero-length dims, non-contiguous and ndarray leaves."""
    tree: dict[str, Any] = {"meta": draw(st.text(max_size=3))}
    names = []
    for name in ("a", "b")[: draw(st.integers(1, 2))]:
        code, dtype = draw(st.sampled_from(DTYPES))
        isz = torch.empty((), dtype=dtype).element_size()
        rows = draw(st.sampled_from([0, 1, 3, 5]))
        n = (512 << 10) // isz
        split = draw(st.sampled_from([None, 2, 0]))
        shape = (rows, n) if split is None else (rows, split, n // 2)
        n_row = math.prod(shape[1:])
        runs = [
            draw(st.sampled_from([0, n_row, n_row // 2, n_row - 1, draw(st.integers(0, n_row))]))
            for _ in range(rows)
        ]
        kind = draw(st.sampled_from(["zero", "neg0", "nan", "random"]))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        element = element_bits(kind, isz, g, dtype)
        leaf = padded_leaf(dtype, shape, runs, element, draw(st.integers(0, 2**16)))
        how = draw(st.sampled_from(["plain", "strided", "ndarray"]))
        if how == "strided" and leaf.numel():
            wide = torch.empty(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]
            words(wide).copy_(words(leaf))
            leaf = wide
        elif how == "ndarray" and code in NUMPY_CODES:
            leaf = leaf.numpy()
        tree[name] = leaf
        names.append(name)
    return tree, names


@SETTINGS
@given(padded_trees(), st.booleans())
def test_padded_trees_round_trip_bit_identical(case: Any, trim: bool) -> None:
    """The law: ``unpack(pack(x, trim=t)) == x`` bit for bit, for any tree whose leaves
    end in trailing runs; and a leaf is stored trimmed only with ``trim=True`` and only
    where that saves at least 4 KiB and an eighth of its bytes (the contract's floor), its
    stored bytes then being its prefixes' exactly."""
    tree, names = case
    packed = tc.pack(tree, trim=trim)
    assert_same(tc.unpack(packed), tree)
    schema = tc.read_header(packed.header)
    for spec, name in zip(schema.leaves, names):
        leaf = tree[name]
        full = leaf.nbytes
        assert spec.shape == tuple(leaf.shape)
        if not spec.trimmed:
            assert spec.nbytes == full
            continue
        assert trim
        saved = full - spec.nbytes
        assert saved >= T.MIN_SAVED_BYTES and saved * T.MIN_SAVED_FRACTION >= full
        kept = T.scan(leaf).prefix_lens
        isz = leaf.itemsize
        assert spec.nbytes % isz == 0 and spec.nbytes >= int(kept.sum()) * isz


@settings(deadline=None, print_blob=True, max_examples=60)
@given(
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 4096), min_size=1, max_size=6),
    st.sampled_from(["zero", "neg0", "nan", "random"]),
    st.integers(0, 2**16),
)
def test_device_rule_trims_small_leaves_and_rebuilds_them(
    dtype: Any, run_draws: list[int], kind: str, seed: int
) -> None:
    """With receivers on a device (the floor alone decides), leaves of a few KiB are
    trimmed, and a decoded header rebuilds them bit for bit."""
    _code, dtype = dtype
    isz = torch.empty((), dtype=dtype).element_size()
    n = 4096 // max(1, isz // 2)
    runs = [min(r, n) for r in run_draws]
    element = element_bits(kind, isz, torch.Generator().manual_seed(seed), dtype)
    leaf = padded_leaf(dtype, (len(runs), n), runs, element, seed)
    encoded = encode({"x": leaf, "y": [1, 2.5]}, receiver="device")
    buffer = torch.empty(encoded.nbytes, dtype=torch.uint8)
    own, repads = encoded.write_tree(buffer)
    for repad in repads:
        repad()
    decoded = decode(encoded.header)
    assert_same(decoded.rebuild(buffer), {"x": leaf, "y": [1, 2.5]})
    assert_same(own, {"x": leaf, "y": [1, 2.5]})
    assert (decoded.trims is not None) == (encoded.trims is not None)


def test_audio_padded_packs_to_at_most_half_its_tensor_bytes() -> None:
    from tensorcast.bench.workloads import make_workload

    batch = make_workload("audio_padded")
    tensor_bytes = sum(t.nbytes for t in batch.values() if isinstance(t, torch.Tensor))
    packed = tc.pack(batch)
    assert packed.nbytes <= 0.5 * tensor_bytes, (packed.nbytes, tensor_bytes)
    assert any(leaf.trimmed for leaf in tc.read_header(packed.header).leaves)
    assert_same(tc.unpack(packed), batch)
    whole = tc.pack(batch, trim=False)
    assert not any(leaf.trimmed for leaf in tc.read_header(whole.header).leaves)
    assert whole.nbytes >= tensor_bytes


def test_trimmed_leaves_are_new_tensors_untrimmed_stay_views() -> None:
    packed = tc.pack(padded_audio())
    (a, lens) = tc.read_header(packed.header).leaves
    assert a.trimmed and not lens.trimmed and a.nbytes < 8 * 200_000 * 4 / 2
    out = tc.unpack(packed)
    base = packed.buffer.untyped_storage().data_ptr()
    assert out["audio_lens"].untyped_storage().data_ptr() == base
    assert out["audio"].untyped_storage().data_ptr() != base
    assert out["audio"].is_contiguous()


def test_one_structure_with_changing_trims_reuses_its_program() -> None:
    """Batches of one structure whose padding changes: their headers differ from the
    first trimmed leaf on, the compiled program is found by the tokens, and every batch
    rebuilds its own runs (a stale layout would shift the leaves after the trimmed one)."""
    programs = []
    for seed in range(4):
        tree = padded_audio(seed=seed)
        tree["after"] = torch.arange(10)
        packed = tc.pack(tree)
        decoded = decode(packed.header)
        programs.append(decoded.compiled()[0])
        assert_same(tc.unpack(packed), tree)
    assert all(p is programs[0] for p in programs)


def test_a_known_structure_with_other_trims_is_checked_whole() -> None:
    """Headers of a structure read before with other trims (or none) are checked whole:
    runs within rows, one per row; a leaf table that stores fewer bytes than its shape's
    without a trim that says so."""
    tree = padded_audio(rows=2, n=300_000)
    packed = tc.pack(tree)
    assert tc.read_header(packed.header).leaves[0].trimmed
    header = packed.header
    at = header.rindex(b",[[0,[")  # the trims
    runs_at = at + len(b",[[0,[")
    end = header.index(b"]", runs_at)
    first, second = map(int, header[runs_at:end].split(b","))
    # a run past its row (the total kept), a run too many, a negative run
    for runs in (f"300001,{first + second - 300_001}", f"{first},{second},0", "-1,0"):
        body = header[12:runs_at] + runs.encode() + header[end:]
        bad = _schema.PREFIX.pack(b"TCST", 3, 0, len(body)) + body
        with pytest.raises(tc.HeaderError):
            tc.unpack(bad, packed.buffer)
    tc.unpack(packed)  # still fine
    untrimmed_tail = header[12:at] + b",[]]"
    bad = _schema.PREFIX.pack(b"TCST", 3, 0, len(untrimmed_tail)) + untrimmed_tail
    with pytest.raises(tc.HeaderError, match="claims"):
        tc.read_header(bad)  # the leaf's size is its shape's, but it stores fewer bytes


def test_trim_false_and_unpaddded_batches_keep_the_old_layout() -> None:
    tree = {"x": torch.randn(64, 4096), "ids": torch.arange(64)}
    assert tc.pack(tree).header == tc.pack(tree, trim=False).header
    assert not any(leaf.trimmed for leaf in tc.read_header(tc.pack(tree).header).leaves)


def test_packed_collate_trims_and_pickles() -> None:
    collate = tc.packed_collate(torch.utils.data.default_convert)
    plain = tc.packed_collate(torch.utils.data.default_convert, trim=False)
    collate = pickle.loads(pickle.dumps(collate))
    tree = padded_audio()
    assert collate(tree).nbytes < plain(tree).nbytes
    assert_same(tc.unpack(collate(tree)), tree)


def test_numpy_trimmed_leaf_comes_back_as_an_array() -> None:
    x = np.zeros((4, 100_000), np.float64)
    x[:, :10] = 1.5
    out = tc.unpack(tc.pack({"x": x}))
    assert type(out["x"]) is np.ndarray and out["x"].dtype == x.dtype
    assert np.array_equal(out["x"], x)
