"""The decoder against hostile input: the ``attacks/`` corpus, truncations, bit flips,
arbitrary bytes and JSON, plus the golden bytes that pin the wire layout.

The law throughout: for any bytes, ``read_header`` and ``unpack`` either succeed or raise
``HeaderError``; never another exception (RecursionError, MemoryError, ValueError,
KeyError, ...), never a hang.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import struct
import sys
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import assert_same

import tensorcast as tc
from tensorcast.codec import schema as _schema
from tensorcast.codec.build import MAX_SAME_HASH
from tensorcast.codec.encode import encode as encode_tree

# the module (``tensorcast.codec.decode``, the function, shares its name)
_decode = importlib.import_module("tensorcast.codec.decode")
SETTINGS = settings(deadline=None, print_blob=True, max_examples=300)
ATTACKS = Path(__file__).resolve().parent / "attacks"
PREFIX = struct.Struct("<4sHHI")


class AttackPoint(NamedTuple):
    x: Any
    y: Any


# Attack files name this type to reach the registered-type checks.
tc.register_type(AttackPoint, name="tests.attacks.Point")


def _load_generator() -> Any:
    spec = importlib.util.spec_from_file_location("make_attacks", ATTACKS / "make_attacks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_attacks", module)
    spec.loader.exec_module(module)
    return module


make_attacks = _load_generator()
ATTACK_FILES = sorted(ATTACKS.glob("*.bin"))


def frame(body: bytes, version: int = 3, flags: int = 0) -> bytes:
    return PREFIX.pack(b"TCST", version, flags, len(body)) + body


def small_buffer(data: bytes) -> torch.Tensor:
    """A buffer of the size the header claims when that is small (so the header, not the
    buffer size, is what gets judged), else 64 bytes. 0xff bytes are invalid UTF-8."""
    n = 64
    try:
        body = json.loads(bytes(data[PREFIX.size :]).decode("ascii"))
        if type(body) is list and body and type(body[0]) is int and 0 <= body[0] <= 1 << 20:
            n = body[0]
    except (ValueError, RecursionError):
        pass
    return torch.full((n,), 0xFF, dtype=torch.uint8)


def judge(data: bytes) -> str:
    """Feed ``data`` to both decoders; return "ok" or "rejected". Any exception other than
    HeaderError propagates and fails the calling test."""
    try:
        schema = tc.read_header(data)
    except tc.HeaderError:
        read = "rejected"
    else:
        read = "ok"
        assert schema.nbytes >= 0
    try:
        tc.unpack(data, small_buffer(data))
    except tc.HeaderError:
        unpacked = "rejected"
    else:
        unpacked = "ok"
    if read == "rejected":
        assert unpacked == "rejected", "unpack accepted a header read_header refused"
    return read


# --------------------------------------------------------------------------- the corpus


def test_corpus_matches_its_generator() -> None:
    """The checked-in files are exactly what make_attacks.py writes, and README lists each."""
    names = {p.stem for p in ATTACK_FILES}
    assert names == set(make_attacks.ATTACKS)
    for name, (_, data) in make_attacks.ATTACKS.items():
        assert (ATTACKS / f"{name}.bin").read_bytes() == data, f"{name}.bin is stale"
    readme = (ATTACKS / "README.md").read_text(encoding="utf-8")
    for name in names:
        assert f"`{name}.bin`" in readme


def test_the_generators_format_constants_agree_with_the_library() -> None:
    assert make_attacks.MAGIC == _schema.MAGIC
    assert make_attacks.VERSION == _schema.FORMAT_VERSION == tc.FORMAT_VERSION
    assert make_attacks.MAX_HEADER_BYTES == _schema.MAX_HEADER_BYTES
    assert make_attacks.PREFIX.format == PREFIX.format
    # The corpus's reference header is valid, so each attack differs from a working one.
    assert tc.read_header(make_attacks.VALID).nbytes == 16


@pytest.mark.parametrize("path", ATTACK_FILES, ids=lambda p: p.stem)
def test_attack_read_header(path: Path) -> None:
    with pytest.raises(tc.HeaderError):
        tc.read_header(path.read_bytes())


@pytest.mark.parametrize("path", ATTACK_FILES, ids=lambda p: p.stem)
def test_attack_unpack(path: Path) -> None:
    data = path.read_bytes()
    with pytest.raises(tc.HeaderError):
        tc.unpack(data, small_buffer(data))
    with pytest.raises(tc.HeaderError):
        tc.unpack(data, torch.zeros(0, dtype=torch.uint8))


@pytest.mark.parametrize(
    "path", [p for p in ATTACK_FILES if p.stat().st_size < 200][:30], ids=lambda p: p.stem
)
def test_attack_as_bytearray_and_memoryview(path: Path) -> None:
    data = path.read_bytes()
    for view in (bytearray(data), memoryview(data)):
        with pytest.raises(tc.HeaderError):
            tc.read_header(view)  # type: ignore[arg-type]


def test_future_version_lists_the_available_versions() -> None:
    data = (ATTACKS / "future_version.bin").read_bytes()
    with pytest.raises(tc.HeaderError) as info:
        tc.read_header(data)
    msg = str(info.value)
    assert "version 4" in msg and "Available versions" in msg and "[3]" in msg, msg


def test_bad_magic_says_it_is_not_a_tensorcast_header() -> None:
    with pytest.raises(tc.HeaderError, match="magic"):
        tc.read_header((ATTACKS / "bad_magic.bin").read_bytes())


def test_a_header_that_is_not_bytes_is_a_type_error() -> None:
    for bad in ("TCST", None, 12, [1, 2]):
        with pytest.raises(TypeError):
            tc.read_header(bad)  # type: ignore[arg-type]


def test_deep_but_valid_flat_tree_is_accepted() -> None:
    """100,000 nested one-element lists as flat tokens are a valid tree: both decoders
    accept it without recursing."""
    depth = 100_000
    data = frame(json.dumps([0, 64, [], [["l", 1]] * depth + [None], [None], []]).encode())
    assert tc.read_header(data).leaves == ()
    out = tc.unpack(data, torch.empty(0, dtype=torch.uint8))
    for _ in range(depth):
        assert type(out) is list and len(out) == 1
        out = out[0]
    assert out is None


def test_dict_keys_that_share_a_hash_are_refused_by_both_sides() -> None:
    """NOTE [ Keys that share a hash ]: an int's hash is its value modulo 2**61 - 1, so big
    ints that far apart share one; a dict of many of them takes quadratic time to build (a
    0.8 MB header of 40,000 such keys took 13 s). More than ``MAX_SAME_HASH`` are refused,
    by the encoder (naming the dict) and by the decoder; up to that many travel."""
    modulus = sys.hash_info.modulus
    few = {"a": {k * modulus: k for k in range(1, MAX_SAME_HASH + 1)}}
    assert_same(tc.unpack(tc.pack(few)), few)
    many = {k * modulus: k for k in range(1, 4001)}
    with pytest.raises(tc.UnsupportedLeafError, match=r"dict `batch\['m'\]` share one hash"):
        tc.pack({"m": many})
    n = len(many)
    keys = [["I", hex(key)] for key in many]
    data = frame(json.dumps([0, 64, [], [["d", n, keys]] + [None] * n, [None] * n, []]).encode())
    with pytest.raises(tc.HeaderError, match="share a hash"):
        tc.read_header(data)
    with pytest.raises(tc.HeaderError, match="share a hash"):
        tc.unpack(data, torch.empty(0, dtype=torch.uint8))


def _wide(i: int, leaf: Any) -> dict[str, Any]:
    """A tree of ``leaf`` and 1500 long keys: 300 KB of header text, distinct per ``i``."""
    return {"leaf": leaf, **{f"{i:04d}{'k' * 200}{j}": None for j in range(1500)}}


def test_what_decoding_keeps_is_bounded_in_bytes_whatever_the_headers() -> None:
    """The decoder's caches (compiled programs of trimmed headers, structures read lately)
    hold at most their byte budgets of header text, however many large distinct headers
    come: a compiled structure is a few dozen times its text (16 cached programs of 1.2 MB
    headers held 600 MB)."""
    padded = torch.zeros(8, 65536)
    padded[:, :4096] = 1.0
    for i in range(6):  # trimmed headers: 300 KB of tokens each, every one distinct
        packed = tc.pack(_wide(i, padded))
        assert tc.read_header(packed.header).leaves[0].trimmed
        tc.unpack(packed)
        tc.unpack(tc.pack(_wide(i, torch.ones(2))))  # untrimmed: its structure remembered
    programs = _decode._programs
    assert 1 <= len(programs) <= _decode._PROGRAMS
    assert sum(map(len, programs)) <= _decode._PROGRAMS_MAX_BYTES
    recent = _decode._recent
    assert 1 <= len(recent) <= _decode._RECENT
    assert sum(len(known.structure_bytes or b"") for known in recent) <= _decode._RECENT_MAX_BYTES


@pytest.mark.parametrize(
    ("tokens", "values"),
    [
        ([None], [["i", 1 << 63]]),  # "i" holds 64 bits; a larger int is an "I"
        ([None], [["I", " 0x_f_f "]]),  # "I" is as hex() writes it...
        ([None], [["I", "111"]]),  # ...with its 0x
        ([None], [["I", "0XFF"]]),
        ([None], [["s", "BOOL", "07"]]),  # a numpy bool is one byte, 0 or 1
        ([["d", 1, [1 << 63]], None], [None]),  # a bare int key holds 64 bits
    ],
)
def test_values_outside_the_grammar_are_refused(tokens: list[Any], values: list[Any]) -> None:
    """NOTE [ The token and value grammar ] is exact: what the encoder never writes is a
    HeaderError, not read some other way."""
    data = frame(json.dumps([0, 64, [], tokens, values, []]).encode())
    with pytest.raises(tc.HeaderError):
        tc.unpack(data, torch.empty(0, dtype=torch.uint8))


def test_deep_flat_tree_referencing_a_missing_leaf_is_rejected() -> None:
    data = frame(json.dumps([0, 64, [], [["l", 1]] * 100_000 + [0], [], []]).encode())
    assert judge(data) == "rejected"


def test_str_leaf_with_invalid_utf8_is_a_header_error() -> None:
    packed = tc.pack({"s": "x" * 2000})
    (leaf,) = tc.read_header(packed.header).leaves
    packed.buffer[leaf.offset] = 0xFF
    with pytest.raises(tc.HeaderError, match="UTF-8"):
        tc.unpack(packed)


def test_read_header_output_is_bounded_by_its_input() -> None:
    """``read_header``'s result is at most a constant factor larger than the header:
    a small header cannot make the decoder build gigabytes of leaf paths.

    4,000 nested lists around a list of 1,000 zero-size leaves is a 60 KB header; its
    leaf paths, rendered in full, are 12 MB. At the 64 MiB header cap the same shape
    would be terabytes.
    """
    depth, n = 4000, 1000
    tokens = [["l", 1]] * depth + [["l", n], *range(n)]
    leaves = [["tensor", "U8", [0], 0, 0]] * n
    data = frame(json.dumps([0, 64, leaves, tokens, [], []], separators=(",", ":")).encode())
    schema = tc.read_header(data)
    assert len(schema.leaves) == n
    total = sum(len(leaf.path) for leaf in schema.leaves)
    assert total <= 64 * len(data), f"{len(data)}-byte header -> {total} bytes of paths"


# --------------------------------------------------------------------------- mutations


def _valid_headers() -> list[bytes]:
    return [
        make_attacks.VALID,
        GOLDEN_HEADER,
        tc.pack([AttackPoint(torch.ones(2), {"k": (1, None)}), "s" * 1100, b"b" * 1100]).header,
        tc.pack({2: np.float32(2), None: complex(1, 2), True: [2**80, -0.0]}).header,
    ]


def test_every_truncation_of_a_valid_header_is_rejected() -> None:
    for data in _valid_headers():
        for n in range(len(data)):
            assert judge(data[:n]) == "rejected", n


def test_every_truncation_with_a_fixed_up_length_is_rejected_or_valid() -> None:
    """Cutting the body and rewriting the prefix's length reaches the JSON and tree
    checks; only HeaderError or success may come out."""
    for data in _valid_headers():
        body = data[PREFIX.size :]
        for n in range(len(body)):
            judge(frame(body[:n]))


def test_every_single_bit_flip_is_rejected_or_valid() -> None:
    for data in _valid_headers()[:2]:
        for i in range(len(data) * 8):
            flipped = bytearray(data)
            flipped[i // 8] ^= 1 << (i % 8)
            judge(bytes(flipped))


@SETTINGS
@given(st.sampled_from(range(4)), st.lists(st.integers(0, 2**31), min_size=1, max_size=8))
def test_random_bit_flips(which: int, positions: list[int]) -> None:
    """Flipping any set of bits of a valid header gives HeaderError or a valid header."""
    data = bytearray(_valid_headers()[which])
    for p in positions:
        p %= len(data) * 8
        data[p // 8] ^= 1 << (p % 8)
    judge(bytes(data))


@SETTINGS
@given(st.sampled_from(range(4)), st.integers(0, 2**31), st.integers(0, 64), st.binary(max_size=64))
def test_random_splices_with_fixed_up_length(which: int, at: int, cut: int, insert: bytes) -> None:
    """Replacing a slice of a valid body by arbitrary bytes (prefix fixed up) gives
    HeaderError or a valid header."""
    body = _valid_headers()[which][PREFIX.size :]
    at %= len(body) + 1
    judge(frame(body[:at] + insert + body[at + cut :]))


@SETTINGS
@given(st.binary(max_size=256))
def test_arbitrary_bytes(data: bytes) -> None:
    """Arbitrary bytes give HeaderError (or, vanishingly rarely, a valid header)."""
    judge(data)


@SETTINGS
@given(st.binary(max_size=256))
def test_arbitrary_bodies_behind_a_valid_prefix(body: bytes) -> None:
    """Arbitrary body bytes behind a correct prefix give HeaderError or a valid header."""
    judge(frame(body))


FORMAT_WORDS = ("tensor", "ndarray", "bytes", "str", "F32", "U8", "BF16")
FORMAT_WORDS += ("l", "t", "d", "o", "r", "x", "i", "I", "f", "c", "y", "s", "S", "U")
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=6),
    # The words of the format, so random bodies sometimes get past the first checks.
    st.sampled_from(FORMAT_WORDS),
    st.just("tests.attacks.Point"),
)
json_values = st.recursive(
    json_scalars,
    lambda kids: (
        st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=3), kids, max_size=3)
    ),
    max_leaves=25,
)


@SETTINGS
@given(json_values, json_values, json_values, json_values, json_values, json_values)
def test_arbitrary_json_bodies(
    nbytes: Any, align: Any, leaves: Any, tokens: Any, values: Any, trims: Any
) -> None:
    """Any JSON ``[nbytes, align, leaves, tokens, values, trims]`` gives HeaderError or a
    valid header."""
    judge(frame(json.dumps([nbytes, align, leaves, tokens, values, trims]).encode()))


leaf_rows = st.lists(
    st.tuples(
        st.sampled_from(["tensor", "ndarray", "bytes", "str"]),
        st.sampled_from(["F32", "U8", "BOOL", "C128", "BF16", "F8_E4M3", "I64", "F4_E2M1_X2"]),
        st.lists(st.integers(-1, 5) | st.sampled_from([0, 2**44, 2**63]), max_size=4),
        st.integers(-64, 512),
        st.integers(-8, 512),
    ).map(list),
    max_size=4,
)
token_atoms = st.one_of(
    st.integers(-1, 4),
    st.none(),
    st.booleans(),
    st.text(max_size=3),
    st.tuples(st.sampled_from(["l", "t"]), st.integers(-1, 4)).map(list),
    st.tuples(
        st.sampled_from(["d", "o"]),
        st.integers(0, 3),
        st.lists(st.one_of(st.text(max_size=2), st.integers(0, 3), st.booleans()), max_size=3),
    ).map(list),
    st.tuples(
        st.just("r"),
        st.just("tests.attacks.Point"),
        st.sampled_from([["x", "y"], ["x"], ["y", "x"]]),
    ).map(list),
    st.tuples(st.sampled_from(["f", "i", "y", "I"]), json_scalars).map(list),
)
value_atoms = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=3),
    st.integers(-1, 4),
    st.tuples(st.sampled_from(["f", "i", "y", "I", "c", "s", "S", "l"]), json_scalars).map(list),
)


# A trimmed leaf's record ``[index, runs, elements, which]`` from near-valid pieces.
trim_records = st.tuples(
    st.integers(-1, 2),
    st.lists(st.integers(-1, 20), max_size=4),
    st.sampled_from(["", "00", "0000", "00000000", "0000803f", "000000000000803f", "zz"]),
    st.none() | st.lists(st.integers(-1, 2), max_size=4),
).map(list)


@SETTINGS
@given(
    st.integers(0, 1024),
    st.sampled_from([1, 2, 8, 64, 3]),
    leaf_rows,
    st.lists(token_atoms, min_size=0, max_size=12),
    st.lists(value_atoms, min_size=0, max_size=4),
    st.just([]) | st.lists(trim_records, max_size=2),
)
def test_near_valid_bodies(
    nbytes: int,
    align: int,
    leaves: list[Any],
    tokens: list[Any],
    values: list[Any],
    trims: list[Any],
) -> None:
    """Bodies built from the grammar's own pieces (so they get past the first checks)
    give HeaderError or a valid header; when valid, unpack rebuilds a tree."""
    judge(frame(json.dumps([nbytes, align, leaves, tokens, values, trims]).encode()))


# --------------------------------------------------------------------------- golden bytes


def golden_tree() -> dict[Any, Any]:
    return {
        "ids": torch.arange(4, dtype=torch.int16),
        "mask": torch.tensor([True, False, True]),
        "np": np.array([1.0, -0.0], dtype=np.float32),
        "meta": [1.5, "hi", None, b"\x00\x01", 2**70, (True,)],
        "od": collections.OrderedDict([(7, 1 + 2j)]),
    }


GOLDEN_HEADER = (
    b"TCST\x03\x00\x00\x00O\x01\x00\x00"
    b'[136,64,[["tensor","I16",[4],0,8],["tensor","BOOL",[3],64,3],["ndarray","F32",[2],128,8]],'
    b'[["d",5,["ids","mask","np","meta","od"]],0,1,2,["l",6],null,null,null,null,null,["t",1],'
    b'null,["o",1,[7]],null],'
    b'[["f",4609434218613702656],"hi",null,["y","0001"],["I","0x400000000000000000"],true,'
    b'["c",4607182418800017408,4611686018427387904]],[]]'
)
# The leaves' bytes, little-endian; every byte between leaves is zero.
GOLDEN_BUFFER = (
    bytes.fromhex("0000010002000300").ljust(64, b"\0")
    + bytes.fromhex("010001").ljust(64, b"\0")
    + bytes.fromhex("0000803f00000080")
)


def test_golden_header_bytes() -> None:
    packed = tc.pack(golden_tree())
    assert packed.header == GOLDEN_HEADER
    assert tc.read_header(GOLDEN_HEADER).leaves == (
        tc.LeafSpec("['ids']", "tensor", "I16", (4,), 0, 8),
        tc.LeafSpec("['mask']", "tensor", "BOOL", (3,), 64, 3),
        tc.LeafSpec("['np']", "ndarray", "F32", (2,), 128, 8),
    )


@pytest.mark.parametrize("how", ["no C encoder", "another C signature"])
def test_golden_header_without_the_c_encoder(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python whose json module has no C encoder, or one that takes other arguments,
    encodes the values with the plain encoder: the same bytes."""

    def other_signature(*args: Any) -> Any:
        raise TypeError("takes 10 arguments")

    with monkeypatch.context() as m:
        m.setattr(
            json.encoder, "c_make_encoder", None if how == "no C encoder" else other_signature
        )
        encode = _schema._values_encoder()
    assert encode is _schema._dumps
    encoded = encode_tree(golden_tree())
    header = _schema.encode(
        encoded.layout.structure_bytes, encoded.value_tokens, values_encoder=encode
    )
    assert header == GOLDEN_HEADER


def test_golden_leaf_bytes() -> None:
    packed = tc.pack(golden_tree())
    data = bytes(packed.buffer.numpy())
    assert len(data) == len(GOLDEN_BUFFER) == 136
    for leaf in tc.read_header(GOLDEN_HEADER).leaves:
        span = slice(leaf.offset, leaf.offset + leaf.nbytes)
        assert data[span] == GOLDEN_BUFFER[span], leaf.path


def test_golden_buffer_bytes() -> None:
    """The whole buffer, padding included, is pinned: padding is zeros."""
    assert bytes(tc.pack(golden_tree()).buffer.numpy()) == GOLDEN_BUFFER


def test_headers_of_one_structure_share_their_bytes_up_to_the_values() -> None:
    """Batches that differ in small values only: one structure prefix, new values."""
    tree = golden_tree()
    tree["meta"] = [2.5, "a longer string", None, b"", -1, (False,)]
    header = tc.pack(tree).header
    values_at = GOLDEN_HEADER.rindex(b',[["f",')
    assert header[12 : values_at + 1] == GOLDEN_HEADER[12 : values_at + 1]
    assert header[values_at + 1 :] != GOLDEN_HEADER[values_at + 1 :]


def test_a_known_structure_with_bad_values_is_rejected() -> None:
    """A body that repeats the bytes of a structure read before takes the short path,
    which must judge its values exactly as a first read would."""
    assert judge(GOLDEN_HEADER) == "ok"  # the structure is now known
    values_at = GOLDEN_HEADER.rindex(b',[["f",') + 1
    body = GOLDEN_HEADER[12:values_at]
    for values in (
        b"[],[]]",  # too few
        b'[["f",0],"hi",null,["y","00"],["i",1],true,["c",0,0],null],[]]',  # too many
        b'[["f",0],"hi",null,["y","0"],["i",1],true,["c",0,0]],[]]',  # odd hex
        b'[["f",0],"hi",null,["y","00"],5,true,["c",0,0]],[]]',  # a bare int
        b'{"a":1},[]]',  # not a list
        b"[],[],[]]",  # two values lists
        b"[],[]",  # no closing bracket
        b"[],[]]]",
        b"[\xff],[]]",
        b'[["f",0],"",null,["y",""],["i",1],false,["c",0,0]]]',  # no trims
        b'[["f",0],"",null,["y",""],["i",1],false,["c",0,0]],{}]',  # trims not a list
        # a trim of leaf 0, a 1-D leaf: only the general path checks leaf sizes
        b'[["f",0],"",null,["y",""],["i",1],false,["c",0,0]],[[0,[1],"0000",null]]]',
    ):
        assert judge(frame(body + values)) == "rejected", values
    good = b'[["f",0],"",null,["y",""],["i",1],false,["c",0,0]],[]]'
    assert judge(frame(body + good)) == "ok"


def test_golden_bytes_decode_to_the_tree() -> None:
    out = tc.unpack(GOLDEN_HEADER, torch.frombuffer(bytearray(GOLDEN_BUFFER), dtype=torch.uint8))
    assert_same(out, golden_tree())
