"""Write the crafted headers of this folder: ``python tests/codec/attacks/make_attacks.py``.

Every file is a header a hostile or broken peer could send. A correct decoder answers
each with ``tensorcast.HeaderError`` from both ``read_header`` and ``unpack``, quickly
and without large allocations. ``README.md`` is written from the same table, so the two
never disagree. The output is deterministic; ``test_header_attacks.py`` checks that the
checked-in files are exactly what this script writes.

Stdlib only, so the corpus does not depend on the library it attacks.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

MAGIC = b"TCST"
VERSION = 3
PREFIX = struct.Struct("<4sHHI")  # magic, version, flags, body length
MAX_HEADER_BYTES = 64 << 20
DEEP = 100_000

# A registered NamedTuple ``tests.attacks.Point(x, y)``; test_header_attacks.py registers it.
POINT = "tests.attacks.Point"


def frame(
    body: bytes,
    *,
    magic: bytes = MAGIC,
    version: int = VERSION,
    flags: int = 0,
    length: int | None = None,
) -> bytes:
    """Prefix ``body`` with a header prefix; any field can lie."""
    n = len(body) if length is None else length
    return PREFIX.pack(magic, version, flags, n) + body


def js(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode("ascii")


CONTAINER_TAGS = ("l", "t", "d", "o", "r", "x")


def header(
    nbytes: object,
    align: object,
    leaves: object,
    tree: list[object],
    values: object = None,
    trims: object = (),
) -> bytes:
    """A framed header whose JSON body is ``[nbytes, align, leaves, tokens, values, trims]``
    (``trims``: the side tables of trimmed leaves, none by default).

    Without ``values``, ``tree`` is written as one would read the tree, small values in
    their places: each token that is neither a buffer-leaf reference (a bare int) nor a
    container becomes a value slot (``null``) and goes to the values, in order.
    """
    trims = list(trims) if isinstance(trims, tuple) else trims
    if values is not None:
        return frame(js([nbytes, align, leaves, tree, values, trims]))
    tokens: list[object] = []
    small: list[object] = []
    for tok in tree:
        container = type(tok) is list and tok and type(tok[0]) is str and tok[0] in CONTAINER_TAGS
        if (type(tok) is int) or container:
            tokens.append(tok)
        else:
            tokens.append(None)
            small.append(tok)
    return frame(js([nbytes, align, leaves, tokens, small, trims]))


def raw(body: str, *, trims: bool = True) -> bytes:
    """A framed header with a hand-written body (for what ``json.dumps`` cannot write):
    a list of the first five fields, to which an empty ``trims`` is added (unless
    ``trims=False``: the body is framed as it is)."""
    if trims:
        body = body[:-1] + ",[]]"
    return frame(body.encode("ascii"))


def trimmed(
    shape: list[int], stored: int, record: list[object], *, kind: str = "tensor", code: str = "F32"
) -> bytes:
    """A header with one trimmed leaf of ``shape`` storing ``stored`` bytes, whose side
    table is ``record`` (``[runs, elements, which]``)."""
    return header(stored, 64, [[kind, code, shape, 0, stored]], [0], trims=[[0, *record]])


def f32(n: int, offset: int = 0) -> list[object]:
    return ["tensor", "F32", [n], offset, 4 * n]


VALID = header(16, 64, [f32(4)], [["d", 1, ["x"]], 0])

# name -> (what it attacks, bytes)
ATTACKS: dict[str, tuple[str, bytes]] = {
    # ---- framing
    "empty": ("zero bytes", b""),
    "truncated_prefix": ("7 of the 12 prefix bytes", VALID[:7]),
    "prefix_only": ("a prefix announcing a body that is absent", VALID[:12]),
    "bad_magic": ("magic `TCSX` instead of `TCST`", frame(VALID[12:], magic=b"TCSX")),
    "bad_magic_pickle": (
        "a pickle stream where a header belongs",
        b"\x80\x05\x95" + b"\x00" * 9 + b"cos\nsystem\n.",
    ),
    "leading_whitespace": ("a space before the magic", b" " + VALID),
    "future_version": ("format version 4, from the future", frame(VALID[12:], version=4)),
    "past_version": ("format version 1, whose body has no values", frame(VALID[12:], version=1)),
    "version_2": (
        "format version 2, whose body has no trims",
        frame(VALID[12:-4] + b"]", version=2),
    ),
    "version_zero": ("format version 0", frame(VALID[12:], version=0)),
    "version_max": ("format version 65535", frame(VALID[12:], version=0xFFFF)),
    "nonzero_flags": ("flags 0x0001, undefined in version 3", frame(VALID[12:], flags=1)),
    "length_too_long": (
        f"the body length says 1000, {len(VALID) - 12} bytes follow",
        frame(VALID[12:], length=1000),
    ),
    "length_too_short": (
        f"the body length says 10, {len(VALID) - 12} bytes follow",
        frame(VALID[12:], length=10),
    ),
    "length_u32_max": ("the body length says 4 GiB - 1", frame(VALID[12:], length=0xFFFFFFFF)),
    "length_over_limit": (
        "the body length is one byte over the 64 MiB cap",
        frame(b"", length=MAX_HEADER_BYTES + 1),
    ),
    "trailing_garbage": ("a valid header followed by 3 more bytes", VALID + b"abc"),
    # ---- body: JSON and top-level shape
    "non_ascii_body": (
        "raw UTF-8 (`é`) in the body",
        frame('[16,64,[["tensor","F32",[4],0,16]],[["d",1,["é"]],0],[],[]]'.encode()),
    ),
    "latin1_body": ("a 0xff byte in the body", frame(VALID[12:-2] + b"\xff]")),
    "nul_in_body": ("a NUL byte in the body", frame(VALID[12:-1] + b"\x00")),
    "not_json": ("a body that is not JSON", raw("[16,64,[[tensor]]", trims=False)),
    "json_object": (
        "a JSON object instead of the 6-list",
        raw('{"nbytes":16,"align":64,"leaves":[],"tokens":[null],"values":[null]}', trims=False),
    ),
    "json_string": ("a JSON string body", raw('"hello"', trims=False)),
    "three_fields": ("a 3-list body", raw("[0,64,[]]", trims=False)),
    "four_fields": (
        "a version-1 body, without values",
        raw('[16,64,[["tensor","F32",[4],0,16]],[["d",1,["x"]],0]]', trims=False),
    ),
    "five_fields": (
        "a version-2 body, without trims",
        raw('[16,64,[["tensor","F32",[4],0,16]],[["d",1,["x"]],0],[]]', trims=False),
    ),
    "six_fields": ("a 7-list body", raw("[0,64,[],[null],[null],[],0]", trims=False)),
    "nan_nbytes": ("NaN as the buffer size", raw("[NaN,64,[],[null],[null]]")),
    "infinity_nbytes": ("Infinity as the buffer size", raw("[Infinity,64,[],[null],[null]]")),
    "float_nbytes": (
        "16.0 as the buffer size",
        raw('[16.0,64,[["tensor","F32",[4],0,16]],[0],[]]'),
    ),
    "bool_nbytes": ("true as the buffer size", raw('[true,64,[["tensor","U8",[1],0,1]],[0],[]]')),
    "negative_nbytes": ("buffer size -1", header(-1, 64, [], [None])),
    "nbytes_u64_overflow": ("buffer size 2**64", header(2**64, 64, [], [None])),
    "nbytes_huge_digits": (
        "buffer size with 5000 decimal digits",
        raw("[" + "9" * 5000 + ",64,[],[null],[null]]"),
    ),
    "nbytes_over_limit": (
        "buffer size 2**44 + 64 for one leaf of that size (over the 16 TiB cap)",
        header(2**44 + 64, 64, [["tensor", "U8", [2**44 + 64], 0, 2**44 + 64]], [0]),
    ),
    "nbytes_slack": ("buffer size 32 but the only leaf ends at 16", header(32, 64, [f32(4)], [0])),
    "nbytes_short": ("buffer size 8 but the only leaf ends at 16", header(8, 64, [f32(4)], [0])),
    "align_zero": ("alignment 0", header(0, 0, [], [None])),
    "align_not_power_of_two": ("alignment 48", header(0, 48, [], [None])),
    "align_negative": ("alignment -64", header(0, -64, [], [None])),
    "align_huge": ("alignment 2**40", header(0, 2**40, [], [None])),
    "leaves_not_list": ("a leaf table that is a dict", raw('[0,64,{"0":1},[null],[null]]')),
    # ---- leaf table
    "leaf_not_list": ("a leaf that is a string", header(0, 64, ["tensor"], [0])),
    "leaf_four_fields": ("a leaf with 4 fields", header(16, 64, [["tensor", "F32", [4], 0]], [0])),
    "unknown_kind": ("leaf kind `pickle`", header(16, 64, [["pickle", "F32", [4], 0, 16]], [0])),
    "kind_not_str": (
        "leaf kind given as a list",
        header(16, 64, [[["tensor"], "F32", [4], 0, 16]], [0]),
    ),
    "unknown_dtype": ("dtype code `F128`", header(16, 64, [["tensor", "F128", [1], 0, 16]], [0])),
    "dtype_repr": (
        "dtype given as `torch.float32` (a repr, not a code)",
        header(16, 64, [["tensor", "torch.float32", [4], 0, 16]], [0]),
    ),
    "dtype_not_str": (
        "dtype code given as the number 4",
        header(16, 64, [["tensor", 4, [4], 0, 16]], [0]),
    ),
    "ndarray_bf16": (
        "an ndarray leaf with BF16, which numpy lacks",
        header(8, 64, [["ndarray", "BF16", [4], 0, 8]], [0]),
    ),
    "bytes_f32": (
        "a bytes leaf with dtype F32",
        header(16, 64, [["bytes", "F32", [4], 0, 16]], [0]),
    ),
    "bytes_2d": (
        "a bytes leaf with a 2-D shape",
        header(4, 64, [["bytes", "U8", [2, 2], 0, 4]], [0]),
    ),
    "shape_not_list": (
        "shape given as the number 4",
        header(16, 64, [["tensor", "F32", 4, 0, 16]], [0]),
    ),
    "giant_dim": (
        "a dimension of 2**63",
        header(0, 64, [["tensor", "U8", [2**63], 0, 2**63]], [0]),
    ),
    "giant_dim_u64": (
        "a dimension of 2**64 + 1",
        header(0, 64, [["tensor", "U8", [2**64 + 1], 0, 2**64 + 1]], [0]),
    ),
    "giant_element_count": (
        "shape [2**40, 2**40] with a matching 2**80-byte size",
        header(2**44, 64, [["tensor", "U8", [2**40, 2**40], 0, 2**80]], [0]),
    ),
    "giant_dims_many": (
        "64 dimensions of 2**44 (an element count of 2**2816)",
        header(0, 64, [["tensor", "U8", [2**44] * 64, 0, 2**2816]], [0]),
    ),
    "giant_dims_zero_elements_tensor": (
        "a tensor with no elements but dims [0, 2**44, 2**44, 2**44, 2**44], whose strides "
        "overflow int64",
        header(0, 64, [["tensor", "F32", [0] + [2**44] * 4, 0, 0]], [0]),
    ),
    "giant_dims_zero_elements_ndarray": (
        "an ndarray with no elements but dims [0, 2**44, 2**44, 2**44, 2**44], which numpy "
        "cannot create",
        header(0, 64, [["ndarray", "F32", [0] + [2**44] * 4, 0, 0]], [0]),
    ),
    "too_many_dims": (
        "65 dimensions of 1",
        header(4, 64, [["tensor", "F32", [1] * 65, 0, 4]], [0]),
    ),
    "negative_dim": (
        "a dimension of -4 with size -16",
        header(0, 64, [["tensor", "F32", [-4], 0, -16]], [0]),
    ),
    "negative_dims_cancel": (
        "dims [-2, -2] whose product (4) agrees with the size",
        header(16, 64, [["tensor", "F32", [-2, -2], 0, 16]], [0]),
    ),
    "float_dim": ("a dimension of 4.0", header(16, 64, [["tensor", "F32", [4.0], 0, 16]], [0])),
    "bool_dim": ("a dimension of true", header(4, 64, [["tensor", "F32", [True], 0, 4]], [0])),
    "size_mismatch": (
        "shape [4] of F32 but size 12",
        header(12, 64, [["tensor", "F32", [4], 0, 12]], [0]),
    ),
    "negative_size": ("size -16", header(0, 64, [["tensor", "F32", [4], 0, -16]], [0])),
    "size_overflow": (
        "size 2**70 for shape [2**68] of F32 in a 16-byte buffer",
        header(16, 64, [["tensor", "F32", [2**68], 0, 2**70]], [0]),
    ),
    "negative_offset": ("offset -64", header(16, 64, [f32(4, -64)], [0])),
    "offset_u64_wrap": (
        "offset 2**64 - 64 (wraps to -64 in u64 arithmetic)",
        header(16, 64, [f32(4, 2**64 - 64)], [0]),
    ),
    "offset_past_buffer": (
        "a leaf at offset 64 in a 16-byte buffer",
        header(16, 64, [f32(4, 64)], [0]),
    ),
    "leaf_ends_past_buffer": (
        "a leaf ending 4 bytes past the buffer",
        header(76, 64, [f32(4), f32(4, 64)], [["l", 2], 0, 1]),
    ),
    "overlapping_leaves": (
        "two leaves over the same 16 bytes",
        header(16, 16, [f32(4), f32(4)], [["l", 2], 0, 1]),
    ),
    "overlapping_partly": (
        "a leaf starting inside the previous one",
        header(24, 8, [f32(4), ["tensor", "F32", [2], 8, 8]], [["l", 2], 0, 1]),
    ),
    "decreasing_offsets": (
        "leaves out of buffer order",
        header(80, 64, [f32(4, 64), f32(4, 0)], [["l", 2], 0, 1]),
    ),
    "misaligned_offset": ("offset 3 with alignment 64", header(19, 64, [f32(4, 3)], [0])),
    "misaligned_for_itemsize": (
        "an F64 leaf at offset 4 with alignment 1",
        header(12, 1, [["tensor", "F64", [1], 4, 8]], [0]),
    ),
    "float_offset": ("offset 0.0", header(16, 64, [["tensor", "F32", [4], 0.0, 16]], [0])),
    # ---- tree tokens
    "tokens_not_list": ("the tree is a dict", raw('[0,64,[],{"l":0},[]]')),
    "tokens_empty": ("an empty tree", header(0, 64, [], [])),
    "token_float": ("a float token", header(0, 64, [], [1.5])),
    "token_object": ("a JSON-object token", raw('[0,64,[],[{"l":1}],[]]')),
    "token_empty_list": ("an empty list token", header(0, 64, [], [[]])),
    "token_unknown_tag": ("a token with tag `q`", header(0, 64, [], [["q", 1]])),
    "token_tag_not_str": ("a token whose tag is a number", header(0, 64, [], [[1, 2]])),
    "trailing_tokens": ("two roots", header(0, 64, [], [None, None])),
    "container_missing_children": (
        "a list of 3 with 2 children",
        header(0, 64, [], [["l", 3], 1, 2]),
    ),
    "container_claims_billions": (
        "a list claiming 10**9 children",
        header(0, 64, [], [["l", 10**9], None]),
    ),
    "container_negative_count": ("a list of -1 children", header(0, 64, [], [["l", -1]])),
    "container_count_float": ("a list of 1.0 children", header(0, 64, [], [["l", 1.0], None])),
    "container_extra_field": ("a list token with 3 fields", header(0, 64, [], [["l", 1, 2], None])),
    "deep_flat_truncated": (
        f"{DEEP:,} nested one-element lists as flat tokens, with the innermost child missing",
        header(0, 64, [], [["l", 1]] * DEEP),
    ),
    "deep_json_tree": (
        f"the tree as JSON arrays nested {DEEP:,} deep",
        raw("[0,64,[]," + "[" * DEEP + "]" * DEEP + ",[]]"),
    ),
    "deep_json_token": (
        f"one token nested {DEEP:,} deep",
        raw("[0,64,[],[" + "[" * DEEP + "]" * DEEP + "],[]]"),
    ),
    # Just past Python's default recursion limit: the depth where a recursive walker breaks.
    "deep_json_shape": (
        "a leaf shape nested 1,200 deep",
        raw('[0,64,[["tensor","U8",' + "[" * 1200 + "]" * 1200 + ",0,0]],[0],[]]"),
    ),
    "deep_json_key": (
        "a dict key nested 1,200 deep",
        raw('[0,64,[],[["d",1,[' + "[" * 1200 + "]" * 1200 + "]],null],[null]]"),
    ),
    "deep_json_token_under_limit": (
        "one token nested 900 deep (parses, then must be refused)",
        raw("[0,64,[],[" + "[" * 900 + "]" * 900 + "],[]]"),
    ),
    "huge_string_kind": (
        "a 100,000-character leaf kind",
        header(16, 64, [["A" * DEEP, "F32", [4], 0, 16]], [0]),
    ),
    "huge_string_tag": (
        "a token whose 100,000-character tag is unknown",
        header(0, 64, [], [["Z" * DEEP, 1]]),
    ),
    "huge_bad_hex": (
        "a bytes token of 100,000 non-hex characters",
        header(0, 64, [], [["y", "zz" * (DEEP // 2)]]),
    ),
    "huge_bad_bigint": (
        "a big-int token of 100,000 non-hex characters",
        header(0, 64, [], [["I", "g" * DEEP]]),
    ),
    "huge_int_digits": (
        "an int token with 5000 decimal digits",
        raw('[0,64,[],[null],[["i",' + "7" * 5000 + "]]]"),
    ),
    "duplicate_dict_keys": (
        "a dict with the key `a` twice",
        header(0, 64, [], [["d", 2, ["a", "a"]], 1, 2]),
    ),
    "duplicate_keys_true_and_1": (
        "dict keys true and 1 (equal in Python)",
        header(0, 64, [], [["d", 2, [True, 1]], None, None]),
    ),
    "duplicate_keys_bigint": (
        'dict keys 1 and ["I", "1"]',
        header(0, 64, [], [["o", 2, [1, ["I", "1"]]], None, None]),
    ),
    "dict_keys_count_mismatch": (
        "a dict of 2 with 1 key",
        header(0, 64, [], [["d", 2, ["a"]], 1, 2]),
    ),
    "dict_key_float": ("a dict key 1.5", header(0, 64, [], [["d", 1, [1.5]], None])),
    "dict_key_object": (
        "a dict key that is a JSON object",
        raw('[0,64,[],[["d",1,[{"k":1}]],null],[null]]'),
    ),
    "dict_key_bad_bigint": (
        'a dict key ["I", "xyz"]',
        header(0, 64, [], [["d", 1, [["I", "xyz"]]], None]),
    ),
    "leaf_ref_missing": (
        "a reference to buffer leaf 1 when there is 1 leaf",
        header(16, 64, [f32(4)], [["l", 2], 0, 1]),
    ),
    "leaf_ref_repeated": (
        "buffer leaf 0 referenced twice",
        header(16, 64, [f32(4)], [["l", 2], 0, 0]),
    ),
    "leaf_ref_negative": (
        "a reference to buffer leaf -1",
        header(16, 64, [f32(4)], [["l", 2], 0, -1]),
    ),
    "leaf_ref_huge": (
        "a reference to buffer leaf 2**63",
        header(16, 64, [f32(4)], [["l", 2], 0, 2**63]),
    ),
    "leaf_unreferenced": (
        "two buffer leaves, one referenced",
        header(80, 64, [f32(4), f32(4, 64)], [["l", 1], 0]),
    ),
    "leaf_ref_without_leaves": (
        "a reference to buffer leaf 0 with an empty leaf table",
        header(0, 64, [], [0]),
    ),
    "unregistered_type": (
        "a registered-type token naming `evil.Payload`",
        header(0, 64, [], [["r", "evil.Payload", []]]),
    ),
    "unregistered_type_os": (
        "a registered-type token naming `os.system`",
        header(0, 64, [], [["r", "os.system", ["command"]], "id"]),
    ),
    "unregistered_codec": (
        "a codec token naming `subprocess.Popen`",
        header(0, 64, [], [["x", "subprocess.Popen"], "id"]),
    ),
    "unregistered_lhotse_name": (
        "a registered-type token naming `lhotse.cut.Evil` (a package with a lazily loaded codec)",
        header(0, 64, [], [["r", "lhotse.cut.Evil", []]]),
    ),
    "unregistered_lhotse_codec": (
        "a codec token naming `lhotse.Evil`",
        header(0, 64, [], [["x", "lhotse.Evil"], None]),
    ),
    "registered_type_wrong_fields": (
        f"`{POINT}` with fields [x] instead of [x, y]",
        header(0, 64, [], [["r", POINT, ["x"]], 1]),
    ),
    "registered_type_fields_not_list": (
        f"`{POINT}` with fields given as a string",
        header(0, 64, [], [["r", POINT, "xy"], 1, 2]),
    ),
    "registered_type_as_codec": (
        f"`{POINT}`, a NamedTuple, named in a codec token",
        header(0, 64, [], [["x", POINT], None]),
    ),
    # ---- small values
    "values_not_list": ("the small values are a dict", raw('[0,64,[],[null],{"0":1}]')),
    "values_missing_one": (
        "a list of two small values with one value",
        header(0, 64, [], [["l", 2], None, None], [["i", 1]]),
    ),
    "values_one_too_many": (
        "one value slot and two values",
        header(0, 64, [], [None], [None, None]),
    ),
    "value_bare_int": ("a value that is a bare 5", header(0, 64, [], [None], [5])),
    "value_bare_float": ("a value that is a bare 1.5", header(0, 64, [], [None], [1.5])),
    "value_container": ("a value that is a list token", header(0, 64, [], [None], [["l", 0]])),
    "value_object": ("a value that is a JSON object", raw('[0,64,[],[null],[{"i":1}]]')),
    "float_bits_negative": ("float bits -1", header(0, 64, [], [["f", -1]])),
    "float_bits_overflow": ("float bits 2**64", header(0, 64, [], [["f", 2**64]])),
    "float_bits_float": ("float bits 1.5", header(0, 64, [], [["f", 1.5]])),
    "int_token_float": ("an int token holding 1.5", header(0, 64, [], [["i", 1.5]])),
    "int_token_bool": ("an int token holding true", header(0, 64, [], [["i", True]])),
    "complex_one_part": ("a complex token with one part", header(0, 64, [], [["c", 0]])),
    "bytes_odd_hex": ("a bytes token with odd-length hex", header(0, 64, [], [["y", "abc"]])),
    "bytes_hex_not_str": ("a bytes token holding a number", header(0, 64, [], [["y", 12]])),
    "scalar_unknown_code": ("a numpy scalar with code XX", header(0, 64, [], [["s", "XX", "00"]])),
    "scalar_wrong_size": (
        "an F32 numpy scalar of 2 bytes",
        header(0, 64, [], [["s", "F32", "0000"]]),
    ),
    "scalar_bf16": (
        "a numpy scalar of BF16, which numpy lacks",
        header(0, 64, [], [["s", "BF16", "0000"]]),
    ),
    "scalar_str_kind": (
        "a numpy string scalar of unknown kind Q",
        header(0, 64, [], [["S", "Q", "x"]]),
    ),
    "scalar_str_not_str": (
        "a numpy str scalar holding a number",
        header(0, 64, [], [["S", "U", 5]]),
    ),
    # ---- trimmed leaves (docs/format.md): a (2, 8) F32 leaf, rows of 8 elements
    "trims_not_list": (
        "the trims are a dict",
        raw('[16,64,[["tensor","F32",[4],0,16]],[0],[]]')[:-3] + b'{"0":1}]',
    ),
    "trim_not_list": (
        "a trim that is a number",
        header(32, 64, [["tensor", "F32", [2, 8], 0, 32]], [0], trims=[7]),
    ),
    "trim_three_fields": (
        "a trim without its leaf index",
        header(32, 64, [["tensor", "F32", [2, 8], 0, 32]], [0], trims=[[[4, 4], "00000000", None]]),
    ),
    "trim_index_out_of_range": (
        "a trim of leaf 1 when there is 1 leaf",
        header(
            32, 64, [["tensor", "F32", [2, 8], 0, 32]], [0], trims=[[1, [4, 4], "00000000", None]]
        ),
    ),
    "trim_index_bool": (
        "a trim whose leaf index is true",
        header(
            32,
            64,
            [["tensor", "F32", [2, 8], 0, 32]],
            [0],
            trims=[[True, [4, 4], "00000000", None]],
        ),
    ),
    "trim_index_repeated": (
        "leaf 0 trimmed twice",
        header(
            32,
            64,
            [["tensor", "F32", [2, 8], 0, 32]],
            [0],
            trims=[[0, [4, 4], "00000000", None], [0, [4, 4], "00000000", None]],
        ),
    ),
    "trim_1d_leaf": ("a trimmed 1-D leaf", trimmed([8], 16, [[4], "00000000", None])),
    "trim_bytes_leaf": (
        "a trimmed bytes leaf",
        trimmed([8], 4, [[4], "00", None], kind="bytes", code="U8"),
    ),
    "trim_run_past_row": (
        "a run of 9 in a row of 8",
        trimmed([2, 8], 28, [[9, -2], "00000000", None]),
    ),
    "trim_run_negative": ("a run of -1", trimmed([2, 8], 36, [[-1, 0], "00000000", None])),
    "trim_run_bool": ("a run length of true", trimmed([2, 8], 60, [[True, 0], "00000000", None])),
    "trim_run_float": ("a run length of 4.0", trimmed([2, 8], 32, [[4.0, 4], "00000000", None])),
    "trim_runs_short": ("one run length for 2 rows", trimmed([2, 8], 48, [[4], "00000000", None])),
    "trim_runs_huge_count": (
        "10**6 run lengths for 2 rows",
        trimmed([2, 8], 64, [[0] * 10**6, "00000000", None]),
    ),
    "trim_stored_disagrees": (
        "runs [4, 4] keep 32 bytes but the leaf table says 36",
        trimmed([2, 8], 36, [[4, 4], "00000000", None]),
    ),
    "trim_stored_overflow": (
        "runs that keep 2**70 bytes, as the leaf table says",
        trimmed([2**33, 2**33], 2**70, [[0, 0], "00000000", None]),
    ),
    "trim_full_over_cap": (
        "a 1-row leaf of 2**43 F32 elements, all run: 32 TiB rebuilt from 0 bytes",
        trimmed([1, 2**43], 0, [[2**43], "00000000", None]),
    ),
    "trim_bomb_gib": (
        "a 1-row leaf of 2**28 F32 elements, all run: 1 GiB rebuilt from a 100-byte header",
        trimmed([1, 2**28], 0, [[2**28], "00000000", None]),
    ),
    "trim_bomb_over_ratio": (
        "2 rows of 2**24 F32 elements keeping 8 each: 128 MiB from 64 stored bytes, over "
        "1024 times what travelled",
        trimmed([2, 2**24], 64, [[2**24 - 8, 2**24 - 8], "00000000", None]),
    ),
    "trim_element_wrong_width": (
        "a 2-byte run element for an F32 leaf",
        trimmed([2, 8], 32, [[4, 4], "0000", None]),
    ),
    "trim_element_not_hex": (
        "a run element `zzzzzzzz`",
        trimmed([2, 8], 32, [[4, 4], "zzzzzzzz", None]),
    ),
    "trim_element_upper_hex": (
        "a run element in uppercase hex",
        trimmed([2, 8], 32, [[4, 4], "0000803F", None]),
    ),
    "trim_element_number": (
        "a run element given as the number 0",
        trimmed([2, 8], 32, [[4, 4], 0, None]),
    ),
    "trim_elements_unordered": (
        "two run elements out of order",
        trimmed([2, 8], 32, [[4, 4], "0000803f00000000", [0, 1]]),
    ),
    "trim_elements_more_than_rows": (
        "three run elements for 2 rows",
        trimmed([2, 8], 32, [[4, 4], "000000000000803f00000040", [0, 1]]),
    ),
    "trim_which_with_one_element": (
        "a `which` list with one run element",
        trimmed([2, 8], 32, [[4, 4], "00000000", [0, 0]]),
    ),
    "trim_which_missing": (
        "two run elements and no `which`",
        trimmed([2, 8], 32, [[4, 4], "000000000000803f", None]),
    ),
    "trim_which_out_of_range": (
        "a `which` index 2 with two run elements",
        trimmed([2, 8], 32, [[4, 4], "000000000000803f", [0, 2]]),
    ),
}


def write(folder: Path = HERE) -> list[Path]:
    """Write every attack file and README.md into ``folder``; return the .bin paths."""
    paths = []
    for name, (_, data) in ATTACKS.items():
        path = folder / f"{name}.bin"
        path.write_bytes(data)
        paths.append(path)
    lines = [
        "# Decoder attack corpus",
        "",
        "Crafted headers a hostile or broken peer could send. Every file must make both",
        "`tensorcast.read_header(data)` and `tensorcast.unpack(data, buffer)` raise",
        "`tensorcast.HeaderError`: never another exception, never a hang, never a large",
        "allocation. `test_header_attacks.py` runs them all.",
        "",
        "Regenerate with `python tests/codec/attacks/make_attacks.py` (deterministic; the test",
        "checks the files match the script). Framing: `<4sHHI` prefix (magic `TCST`, version,",
        "flags, body length) then an ASCII JSON body `[nbytes, align, leaves, tokens, values,",
        "trims]` (`docs/format.md`).",
        "",
        "| file | attacks | bytes |",
        "| --- | --- | ---: |",
    ]
    for name, (what, data) in ATTACKS.items():
        lines.append(f"| `{name}.bin` | {what.replace('|', '/')} | {len(data):,} |")
    (folder / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return paths


def main() -> int:
    paths = write()
    print(f"wrote {len(paths)} attack files and README.md to {HERE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
