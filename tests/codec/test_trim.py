"""Trimmed leaves (``tensorcast.codec.trim``): unit tests, then the laws it keeps.

Every comparison is of raw bytes: NaN payloads and -0.0 are values like any other.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorcast import HeaderError
from tensorcast.codec import dtypes as D
from tensorcast.codec import repad as R
from tensorcast.codec import schema as S
from tensorcast.codec import trim as T
from tensorcast.codec.dtypes import CODE_ITEMSIZE, NUMPY_CODES, TORCH_CODES

SETTINGS = settings(deadline=None, print_blob=True, max_examples=200)
FEW = settings(deadline=None, print_blob=True, max_examples=40)

# --------------------------------------------------------------------------- helpers


def raw(x: torch.Tensor | np.ndarray) -> bytes:
    """``x``'s bytes in C order, copied bit for bit (never through a float or bool copy)."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).tobytes()
    if x.element_size() == 16:
        words = torch.view_as_real(x).view(torch.int64)
    else:
        words = x.view(
            {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        )
    return words.contiguous().numpy().tobytes()


def from_raw(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    buf = torch.frombuffer(bytearray(data) or bytearray(1), dtype=torch.uint8)[: len(data)]
    return buf.view(dtype).reshape(shape)


def brute_kept(x: torch.Tensor | np.ndarray) -> list[int]:
    """Each row's elements before its run: one past its last element whose bytes are not
    its last element's, row by row."""
    rows, n, isz = x.shape[0], math.prod(x.shape[1:]), x.itemsize
    elements = np.frombuffer(raw(x), np.uint8).reshape(rows, n, isz)
    out = []
    for row in elements:
        differ = np.flatnonzero(~(row == row[-1]).all(1)) if n else []
        out.append(int(differ[-1]) + 1 if len(differ) else 0)
    return out


def round_trip(x, table: S.Trim, *, masked: bool = False) -> torch.Tensor:
    """``x`` compacted and rebuilt: as a host rebuilds it, or as a device does (through a
    mask of the kept elements: the same ops on the CPU)."""
    stored = torch.empty(table.nbytes, dtype=torch.uint8)
    T.compact_into(stored, x, table.prefix_lens)
    dtype = x.dtype if isinstance(x, torch.Tensor) else TORCH_CODES[_code(x)]
    if not masked:
        return R.repad(stored, tuple(x.shape), dtype, table)
    out = torch.empty(tuple(x.shape), dtype=dtype)
    if out.numel():
        R._rebuild_masked(stored, out, table)
    return out


def _code(a: np.ndarray) -> str:
    return next(c for c, d in NUMPY_CODES.items() if d == a.dtype)


def padded_audio(rows=8, n=20_000, seed=0, pad=0.0, share=0.5) -> torch.Tensor:
    """Random samples, each row but the first padded with ``pad`` over a share of it drawn
    uniformly from ``[0, 2 * share]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    lens = n - (torch.rand(rows, generator=g) * 2 * share * n).long().clamp(max=n)
    lens[0] = n  # the longest has no padding
    x[torch.arange(n) >= lens[:, None]] = pad
    return x


# --------------------------------------------------------------------------- unit tests


def test_probe_skips_small_and_flat_leaves() -> None:
    assert not T.probe(torch.zeros(4096))  # 1-D
    assert not T.probe(torch.zeros(()))
    assert not T.probe(torch.zeros(4, 255, dtype=torch.uint8))  # under 4 KiB in all
    assert not T.probe(torch.zeros(4096, 1))  # rows of one element never hold a run
    assert T.probe(torch.zeros(4, 4096), receiver="device")


def test_probe_looks_at_a_few_elements_only() -> None:
    x = padded_audio(n=100_000)
    assert T.probe(x) and T.probe(x.numpy())
    assert not T.probe(torch.randn(8, 100_000))
    # a run of 2048 at the end of 4 rows of 4 Mi elements is under the floor: no scan
    mask = torch.ones(4, 1, 2048, 2048, dtype=torch.bool).triu(diagonal=1)
    assert not T.probe(mask, receiver="device")


def test_scan_finds_each_rows_run() -> None:
    x = torch.tensor([[1, 2, 3, 3], [5, 5, 5, 5], [1, 2, 3, 4], [7, 0, 0, 0]], dtype=torch.int32)
    runs = T.scan(x)
    assert runs.prefix_lens.tolist() == [2, 0, 3, 1]
    assert runs.runs.tolist() == [2, 4, 1, 3]
    assert runs.elements.view(np.int32).ravel().tolist() == [3, 5, 4, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.int64, torch.complex128])
@pytest.mark.parametrize("n", [100, 70_001])  # one level; two levels, with a head
def test_scan_agrees_with_one_element_at_a_time(dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 3, (5, n), generator=g).to(dtype)
    cuts = [0, n - 1, n // 2, 7, n]
    for i, cut in enumerate(cuts):
        x[i, cut:] = x[i, -1]
    assert T.scan(x).prefix_lens.tolist() == brute_kept(x)


def test_side_table_keeps_one_element_when_the_rows_share_it() -> None:
    x = padded_audio(pad=math.log(1e-10))
    table = T.side_table(T.scan(x))
    assert table.which is None
    assert table.elements == np.float32(math.log(1e-10)).tobytes()
    assert table.runs[0] == 0  # the longest row's last samples are no run


def test_side_table_lists_several_elements_in_byte_order() -> None:
    x = torch.zeros(3, 100, dtype=torch.int16)
    x[0, 50:] = 0x0102
    x[1, 10:] = 0x0201
    table = T.side_table(T.scan(x))
    assert table.elements == bytes([0, 0, 1, 2, 2, 1])  # 0x0000, 0x0201, 0x0102 as bytes
    assert table.which == (2, 1, 0)
    assert table.runs == (50, 90, 100)


def test_short_runs_stay_in_the_prefix() -> None:
    x = torch.arange(3 * 100, dtype=torch.float32).view(3, 100)
    x[0, -15:] = 0  # 60 bytes: under MIN_RUN_BYTES
    x[1, -16:] = 0  # 64 bytes: counts
    assert T.side_table(T.scan(x)).runs == (0, 16, 0)


def test_decide_keeps_to_the_floor_and_to_where_it_pays() -> None:
    x = padded_audio(rows=8, n=200_000, share=0.5)
    assert T.decide(T.scan(x), receiver="host") is not None
    assert T.decide(T.scan(x), receiver="device") is not None
    light = padded_audio(rows=8, n=200_000, share=0.2)  # 20%: pays on a device only
    assert T.decide(T.scan(light), receiver="host") is None
    assert T.decide(T.scan(light), receiver="device") is not None
    thin = padded_audio(rows=8, n=200_000, share=0.05)  # under an eighth: never
    assert T.decide(T.scan(thin), receiver="device") is None
    small = torch.zeros(2, 1000)
    small[:, :512] = 1.5  # 3904 bytes of runs: under 4 KiB
    assert T.decide(T.scan(small), receiver="device") is None
    with pytest.raises(ValueError, match="receiver"):
        T.decide(T.scan(x), receiver="gpu")
    with pytest.raises(ValueError, match="receiver"):
        T.probe(torch.zeros(3), receiver="gpu")


def test_find_trims_padded_audio_to_its_samples() -> None:
    x = padded_audio(rows=16, n=100_000, share=0.6)
    table = T.find(x)
    assert table is not None
    assert table.prefix_lens == [100_000, *brute_kept(x)[1:]]  # the longest row whole
    assert raw(round_trip(x, table)) == raw(x)
    assert T.find(torch.randn(16, 100_000)) is None


def test_rebuild_into_reused_memory() -> None:
    x = padded_audio(pad=-100.0)
    table = T.find(x, receiver="device")
    stored = torch.empty(table.nbytes, dtype=torch.uint8)
    T.compact_into(stored, x, table.prefix_lens)
    out = torch.full_like(x, 7.0)
    assert R.repad(stored, x.shape, x.dtype, table, out=out) is out
    assert raw(out) == raw(x)


def test_masked_rebuild_of_an_unaligned_slice() -> None:
    x = padded_audio(pad=-100.0)
    table = T.find(x, receiver="device")
    buffer = torch.empty(table.nbytes + 1, dtype=torch.uint8)
    T.compact_into(buffer[1:], x, table.prefix_lens)
    out = torch.full_like(x, 7.0)
    R._rebuild_masked(buffer[1:], out, table)
    assert raw(out) == raw(x)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.complex128])
def test_row_pieces_are_the_rows_bytes_whatever_the_strides(dtype: torch.dtype) -> None:
    # the pieces, back to back, are the leaf's bytes in row order: views of a contiguous
    # leaf, a copy of the bits of a strided one (a mask's byte 2 stays 2, not True)
    rows = torch.arange(4 * 6, dtype=torch.uint8).view(4, 6) % 3
    strided = rows.T.contiguous().T  # the same values, column-major
    leaf, strided = (x.view(dtype) if dtype == torch.bool else x.to(dtype) for x in (rows, strided))
    assert not strided.is_contiguous()
    prefix_lens = [6, 0, 2, 5]
    for t in (leaf, strided):
        pieces = R.row_pieces(t, prefix_lens, 6, t.element_size())
        assert bytes(torch.cat(pieces).numpy()) == bytes(D.as_words(leaf).contiguous().numpy())
        assert [p.numel() for p in pieces[::2]] == [n * t.element_size() for n in prefix_lens]
    assert R.row_pieces(leaf, prefix_lens, 6, leaf.element_size())[0].data_ptr() == (
        leaf.data_ptr()
    )


def test_rebuild_and_compact_reject_what_does_not_fit() -> None:
    x = padded_audio()
    table = T.find(x, receiver="device")
    stored = torch.empty(table.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bytes"):
        T.compact_into(stored[:-1], x, table.prefix_lens)
    with pytest.raises(ValueError, match="prefix lengths"):
        T.compact_into(stored, x, table.prefix_lens[:-1])
    with pytest.raises(ValueError, match="prefix lengths"):
        T.compact_into(stored, x, [x.shape[1] + 1] * x.shape[0])
    T.compact_into(stored, x, table.prefix_lens)
    with pytest.raises(ValueError, match="stored"):
        R.repad(stored[:-1], x.shape, x.dtype, table)
    with pytest.raises(ValueError, match="rows"):
        R.repad(stored, (x.shape[0] + 1, x.shape[1]), x.dtype, table)
    with pytest.raises(ValueError, match="byte elements"):
        R.repad(stored, x.shape, torch.float64, table)
    with pytest.raises(ValueError, match="contiguous"):
        R.repad(stored, x.shape, x.dtype, table, out=torch.empty(x.shape[::-1]).T)
    with pytest.raises(ValueError, match="device"):
        R.repad(stored, x.shape, x.dtype, table, out=torch.empty_like(x), device="meta")


def test_ndarray_leaves_read_only_too() -> None:
    x = padded_audio(pad=-0.0).numpy()
    x.flags.writeable = False
    table = T.find(x, receiver="device")
    assert table is not None
    back = round_trip(x, table).numpy()
    assert back.dtype == x.dtype and back.tobytes() == x.tobytes()


def test_record_round_trips_through_json() -> None:
    x = torch.zeros(3, 100, dtype=torch.int16)
    x[0, 50:] = 0x0102
    x[1, 10:] = 0x0201
    table = T.side_table(T.scan(x))
    record = json.loads(json.dumps(table.record, separators=(",", ":")))
    assert record == [[50, 90, 100], "000001020201", [2, 1, 0]]
    assert S.validate(record, (3, 100), 2, table.nbytes) == table


# --------------------------------------------------------------------------- validate

GOOD = ([[2, 0, 4], "0000803f", None], (3, 2, 2), 4, (12 - 6) * 4)  # float32 1.0 runs


def test_validate_accepts_a_good_record() -> None:
    record, shape, isz, nbytes = GOOD
    table = S.validate(record, shape, isz, nbytes)
    assert table == S.Trim(4, 4, (2, 0, 4), bytes.fromhex("0000803f"))
    assert table.prefix_lens == [2, 4, 0]


@pytest.mark.parametrize(
    ("record", "shape", "nbytes", "message"),
    [
        ("nope", None, None, "not \\[runs, elements, which\\]"),
        ([[2, 0, 4], "0000803f"], None, None, "not \\[runs, elements, which\\]"),
        (None, (12,), None, "2 or more dims"),
        (None, (1 << 20, 1 << 20, 1 << 20), None, "over"),  # counts that overflow the cap
        ([[2, 0], "0000803f", None], None, None, "list of 3"),
        ([(2, 0, 4), "0000803f", None], None, None, "list of 3"),
        ([[2, 0, True], "0000803f", None], None, None, "other than ints"),
        ([[2, 0, 4.0], "0000803f", None], None, None, "other than ints"),
        ([[2, -1, 4], "0000803f", None], None, None, "outside \\[0, 4\\]"),  # negative
        ([[2, 0, 5], "0000803f", None], None, 20, "outside \\[0, 4\\]"),  # past a row
        (None, None, 28, "prefixes hold 24 bytes"),  # the stored bytes disagree
        ([[2, 0, 4], b"\x00\x00\x80\x3f", None], None, None, "hex"),
        ([[2, 0, 4], "0000803F", None], None, None, "hex"),
        ([[2, 0, 4], "00 00803f", None], None, None, "hex"),
        ([[2, 0, 4], "000080", None], None, None, "elements of 4 bytes"),  # wrong width
        ([[2, 0, 4], "", None], None, None, "hex"),
        ([[2, 0, 4], "00" * 16, [0, 1, 2, 3]], None, None, "elements of 4 bytes"),  # 4 > rows
        ([[2, 0, 4], "0000803f00000000", [0, 1, 0]], None, None, "increasing"),
        ([[2, 0, 4], "0000803f0000803f", [0, 1, 0]], None, None, "increasing"),
        ([[2, 0, 4], "0000803f", [0, 0, 0]], None, None, "not null"),
        ([[2, 0, 4], "000000000000803f", None], None, None, "list of 3"),
        ([[2, 0, 4], "000000000000803f", [0, 1]], None, None, "list of 3"),
        ([[2, 0, 4], "000000000000803f", [0, 2, 1]], None, None, "outside \\[0, 2\\)"),
        ([[2, 0, 4], "000000000000803f", [0, -1, 1]], None, None, "outside \\[0, 2\\)"),
        ([[2, 0, 4], "000000000000803f", [0, False, 1]], None, None, "other than ints"),
    ],
)
def test_validate_rejects(record, shape, nbytes, message) -> None:
    good_record, good_shape, isz, good_nbytes = GOOD
    with pytest.raises(HeaderError, match=message):
        S.validate(
            good_record if record is None else record,
            good_shape if shape is None else shape,
            isz,
            good_nbytes if nbytes is None else nbytes,
        )


# --------------------------------------------------------------------------- laws

# Raw bit patterns an element may take beside random ones: -0.0, NaNs with payloads (quiet,
# signalling, negative), all ones, the pads of real batches.
SPECIAL_BITS = {
    1: [0x00, 0x80, 0x7F, 0xFF, 0x01],
    2: [0x0000, 0x8000, 0x7E01, 0x7FC1, 0xFE00, 0xFFFF],
    4: [0, 0x80000000, 0x7FC00001, 0xFFC00000, 0x7F800001, 0xC1B83134],  # ~LOG_EPSILON
    8: [0, 1 << 63, 0x7FF8000000000001, 0xFFF8000000000000, (1 << 64) - 100],  # -100
    16: [0, 1 << 63, (0x7FF8000000000001 << 64) | 0xFFF8000000000000],
}
CODES = sorted(TORCH_CODES)


@st.composite
def padded_leaves(draw: st.DrawFn, max_dim: int = 9) -> torch.Tensor | np.ndarray:
    """A leaf of 2+ dims whose rows end in random runs (some none, some the whole row),
    of elements drawn from a few bit patterns (specials among them), maybe a zero-length
    dim, maybe non-contiguous, maybe an ndarray."""
    as_array = draw(st.booleans())
    code = draw(st.sampled_from(sorted(NUMPY_CODES) if as_array else CODES))
    dtype, isz = TORCH_CODES[code], CODE_ITEMSIZE[code]
    rows = draw(st.integers(0, 5))
    tail = tuple(draw(st.lists(st.integers(0, max_dim), min_size=1, max_size=2)))
    n = math.prod(tail)
    patterns = [b.to_bytes(isz, "little") for b in draw(st.permutations(SPECIAL_BITS[isz]))[:2]]
    patterns += [draw(st.binary(min_size=isz, max_size=isz)) for _ in range(2)]
    pick = st.integers(0, len(patterns) - 1)
    data = bytearray()
    for _ in range(rows):
        prefix = draw(st.lists(pick, min_size=n, max_size=n))
        run = draw(st.sampled_from([0, n, draw(st.integers(0, n))]))
        element = patterns[draw(pick)]
        data += b"".join(patterns[i] for i in prefix[: n - run]) + element * run
    x = from_raw(bytes(data), dtype, (rows, *tail))
    layout = draw(st.sampled_from(["contiguous", "transposed", "stepped"]))
    if layout == "transposed":
        nc = torch.empty(x.shape[::-1], dtype=dtype).permute(*reversed(range(x.dim())))
    elif layout == "stepped":
        nc = torch.empty((*x.shape[:-1], 2 * x.shape[-1]), dtype=dtype)[..., ::2]
    else:
        nc = torch.empty(x.shape, dtype=dtype)
    D.as_words(nc).copy_(D.as_words(x))  # bit for bit, whatever the dtype
    return nc.numpy() if as_array else nc


@SETTINGS
@given(padded_leaves(), st.sampled_from([None, 1]))
def test_law_rebuild_of_compact_is_the_leaf(x, min_elements) -> None:
    """``rebuild(compact(x)) == x`` bit for bit, for any leaf and its side table (every
    run trimmed, or the runs that count): every dtype, NaN payloads and -0.0 as run
    elements and as data, rows with no run and rows all run, zero-length dims,
    non-contiguous tensors and ndarrays. And ``scan`` finds each row's run exactly."""
    runs = T.scan(x)
    assert runs.prefix_lens.tolist() == brute_kept(x)
    table = T.side_table(runs, min_elements=min_elements)
    assert raw(round_trip(x, table)) == raw(x)
    assert raw(round_trip(x, table, masked=True)) == raw(x)


@SETTINGS
@given(padded_leaves())
def test_law_the_record_validates_to_the_table(x) -> None:
    """``validate(json(record(t))) == t``: what the encoder writes, a receiver accepts."""
    table = T.side_table(T.scan(x), min_elements=1)
    record = json.loads(json.dumps(table.record))
    assert S.validate(record, tuple(x.shape), x.itemsize, table.nbytes) == table


@st.composite
def larger_padded(draw: st.DrawFn) -> torch.Tensor:
    """A leaf of a few KiB to a few hundred: rows of random data, each padded with a run
    of a drawn length and element."""
    code = draw(st.sampled_from(CODES))
    dtype, isz = TORCH_CODES[code], CODE_ITEMSIZE[code]
    rows = draw(st.integers(1, 8))
    n = draw(st.integers(2, 40_000 // isz))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    words = torch.randint(0, 256, (rows, n * isz), generator=g, dtype=torch.uint8)
    for i in range(rows):
        run = draw(st.integers(0, n))
        element = draw(st.sampled_from(SPECIAL_BITS[isz])).to_bytes(isz, "little")
        if run:
            words[i, (n - run) * isz :] = torch.from_numpy(
                np.frombuffer(element * run, np.uint8).copy()
            )
    return from_raw(words.numpy().tobytes(), dtype, (rows, n))


@SETTINGS
@given(larger_padded(), st.sampled_from(T.RECEIVERS))
def test_law_never_below_the_floor_and_the_probe_never_misses(x, receiver) -> None:
    """A trim saves at least 4 KiB and an eighth of the leaf (the floor), a host's trims
    are a device's too, and the probe passes every leaf that would be trimmed."""
    table = T.decide(T.scan(x), receiver=receiver)
    if table is None:
        return
    saved = table.full_nbytes - table.nbytes
    assert saved >= T.MIN_SAVED_BYTES and 8 * saved >= x.nbytes
    assert T.decide(T.scan(x), receiver="device") == table
    assert T.probe(x, receiver=receiver)
    assert T.find(x, receiver=receiver) == table
    assert raw(round_trip(x, table)) == raw(x)
    assert raw(round_trip(x, table, masked=True)) == raw(x)


@FEW
@given(
    st.sampled_from([torch.float32, torch.int64, torch.bfloat16, torch.complex128, torch.bool]),
    st.integers(1, 4),
    st.integers(0, 2**32 - 1),
    st.lists(st.integers(0, 100), min_size=4, max_size=4),
)
def test_law_two_level_scan_is_exact(dtype, rows, seed, cuts) -> None:
    """On leaves over 256 KiB (chunks, then one chunk a row) ``scan`` finds each row's run
    exactly, the run ending anywhere: in the head, on a chunk's edge, nowhere, everywhere."""
    n = 300_000 // dtype.itemsize + 17
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(0, 2, (rows, n * dtype.itemsize), generator=g, dtype=torch.uint8)
    x = from_raw(words.numpy().tobytes(), dtype, (rows, n))
    chunk = T._CHUNK_BYTES // dtype.itemsize
    for i in range(rows):
        cut = [0, n, 17, 17 + chunk, n - chunk, n * cuts[i] // 100][cuts[i] % 6]
        D.as_words(x)[i, cut:] = D.as_words(x)[i, -1]
    assert T.scan(x).prefix_lens.tolist() == brute_kept(x)
