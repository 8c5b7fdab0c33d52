"""The header: its framing, its body, the leaf table, the trimmed leaves' side tables,
and their validation.

A header is a 12-byte prefix (all integers little-endian) and a body::

    offset  size  field
    0       4     magic  b"TCST"
    4       2     format version (u16), currently 3
    6       2     flags (u16), must be 0 in version 3
    8       4     body length in bytes (u32), at most MAX_HEADER_BYTES
    12      n     body: compact ASCII JSON (:data:`dumps`)
                  [nbytes, align, leaves, tokens, values, trims]

``leaves`` is the leaf table, in buffer order: ``[kind, dtype_code, shape, offset, nbytes]``
with kind one of ``"tensor" "ndarray" "bytes" "str"``; ``tokens`` is the tree's structure
and ``values`` its small values (NOTE [ The token and value grammar ] in
``codec/__init__.py``); ``trims`` the side tables of the trimmed leaves (``[index, runs,
elements, which]`` each, in leaf order: ``docs/format.md``), whose rows in the leaf table
state the bytes stored, not their shape's. Everything is validated before the caller allocates anything from
the sizes it states: offsets aligned, in increasing order, not overlapping, inside the
buffer; each leaf's nbytes equal to its shape times its itemsize; the buffer size equal to
the end of the last leaf.

Everything but the values and the trims comes first, so headers of one structure share
their bytes up to the values (:func:`structure_bytes`): ``codec.decode`` reads a header
that starts with the bytes of a structure validated before, and trims no leaf, by
parsing its values alone.
"""

from __future__ import annotations

import itertools
import json
import json.scanner
import math
import os
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensorcast._errors import HeaderError
from tensorcast.codec.dtypes import CODE_ITEMSIZE, NUMPY_CODES

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_ALIGN",
    "MAX_BUFFER_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_LEAF_BYTES",
    "MAX_REBUILD_RATIO",
    "PREFIX_BYTES",
    "REBUILD_LIMIT",
    "REBUILD_LIMIT_ENV",
    "SUPPORTED_VERSIONS",
    "NO_TRIMS",
    "Body",
    "LeafSpec",
    "Schema",
    "Trim",
    "check_rebuild",
    "check_trims",
    "dumps",
    "encode",
    "parse",
    "read_body",
    "rebuild_limit",
    "structure_bytes",
    "validate",
]

MAGIC = b"TCST"
FORMAT_VERSION = 3
SUPPORTED_VERSIONS = (3,)
PREFIX = struct.Struct("<4sHHI")
PREFIX_BYTES = PREFIX.size
MAX_HEADER_BYTES = 64 << 20  # 64 MiB of JSON; long strings and bytes go to the buffer
MAX_BUFFER_BYTES = 1 << 44  # 16 TiB: far above any batch, far below int64 overflow
MAX_NDIM = 64
MAX_ALIGN = 1 << 16
KINDS = ("tensor", "ndarray", "bytes", "str")

# -- JSON as headers use it: compact and ASCII, with no whitespace. Reading is the C
# scanner's work alone; the small values, encoded anew on every step, get a C encoder
# made once.

dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, check_circular=False).encode

# One JSON value from the start of a string, and where it ends: what json.loads does
# without its whitespace skipping (headers hold none) and its Python-level wrappers.
scan: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(
    json.JSONDecoder()  # type: ignore[arg-type]  # typeshed types it as its own class
)


def values_encoder() -> Callable[[list[Any]], str]:
    """:data:`dumps` for the small values, which are encoded on every step: the C encoder
    made once instead of per call (``JSONEncoder.encode`` builds one each time, a cost a
    small batch's step feels; see ``docs/design.md``, "A small frame's path runs cold"). Checked against ``dumps`` here; any
    Python without it, or with another signature, gets ``dumps`` itself."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return dumps

    def unsupported(obj: Any) -> Any:
        raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")

    try:
        chunks = make(
            None,  # markers: the values hold no cycles
            unsupported,  # default
            json.encoder.encode_basestring_ascii,
            None,  # indent
            ":",  # key separator
            ",",  # item separator
            False,  # sort_keys
            False,  # skipkeys
            True,  # allow_nan
        )
        sample: list[Any] = [
            ["i", -(1 << 63)],
            ["f", 1 << 64],
            'a\u00e9\\"',
            None,
            True,
            False,
            [[]],
        ]
        if "".join(chunks(sample, 0)) != dumps(sample):
            return dumps
    except (TypeError, ValueError):
        return dumps

    def encode(values: list[Any]) -> str:
        return "".join(chunks(values, 0))

    return encode


_dumps = dumps
_scan = scan
_values_encoder = values_encoder
_encode_values = _values_encoder()
NO_TRIMS = b",[]]"  # how a body without trimmed leaves ends


@dataclass(frozen=True, slots=True)
class LeafSpec:
    """One leaf stored in the buffer.

    Attributes:
        path: the leaf's place in the tree, e.g. ``['audio']`` or ``[2]['x']``.
        kind: ``"tensor"``, ``"ndarray"``, ``"bytes"`` or ``"str"`` (UTF-8 in the buffer).
        dtype: the dtype code, e.g. ``"F32"``; ``"U8"`` for bytes and str.
        shape: the shape; ``(len,)`` for bytes and str.
        offset: where the leaf's bytes start in the buffer.
        nbytes: how many bytes it occupies (a trimmed leaf's prefixes: fewer than its
            shape's).
        trimmed: whether the leaf travels without its rows' trailing runs (NOTE
            [ Trimmed leaves ], ``codec.trim``).
    """

    path: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    trimmed: bool = False


@dataclass(frozen=True, slots=True)
class Schema:
    """A decoded, validated header.

    Attributes:
        leaves: one :class:`LeafSpec` per leaf stored in the buffer, in buffer order.
        nbytes: the buffer size the header requires.
        version: the format version it was written with.
        align: the alignment every leaf offset is a multiple of.
    """

    leaves: tuple[LeafSpec, ...]
    nbytes: int
    version: int
    align: int


def _fail(what: str) -> HeaderError:
    """The error for a header that breaks the format, ``what`` saying how."""
    return HeaderError(f"invalid tensorcast header: {what}")


def _unframe(header: bytes | bytearray | memoryview) -> bytes:
    """The body of ``header``, once its prefix is checked.

    Raises:
        HeaderError: bad magic, an unknown version or flags, or a length that is over
            the limit or disagrees with the header's size.
    """
    if len(header) < PREFIX_BYTES:
        raise _fail(f"{len(header)} bytes is shorter than the {PREFIX_BYTES}-byte prefix")
    magic, version, flags, length = PREFIX.unpack_from(header)
    if magic != MAGIC:
        raise _fail(
            f"bad magic {bytes(magic)!r}, expected {MAGIC!r}; this is not a tensorcast header"
        )
    if version not in SUPPORTED_VERSIONS:
        raise HeaderError(
            f"unknown tensorcast format version {version}. Available versions: "
            f"{list(SUPPORTED_VERSIONS)}; upgrade tensorcast on the ranks that cannot read it"
        )
    if flags != 0:
        raise _fail(f"unknown flags 0x{flags:04x} for version {version}")
    if length > MAX_HEADER_BYTES:
        raise _fail(f"body length {length} is over the {MAX_HEADER_BYTES}-byte limit")
    if len(header) != PREFIX_BYTES + length:
        raise _fail(
            f"the prefix says the body has {length} bytes but {len(header) - PREFIX_BYTES} follow "
            f"(truncated or padded header)"
        )
    return bytes(header[PREFIX_BYTES:])


def structure_bytes(nbytes: int, align: int, leaves: list[Any], tokens: list[Any]) -> bytes:
    """The bytes a header body of this structure starts with, up to its values."""
    if not 0 <= nbytes <= MAX_BUFFER_BYTES:
        raise ValueError(f"a {nbytes}-byte buffer is over the {MAX_BUFFER_BYTES}-byte limit")
    return _dumps([nbytes, align, leaves, tokens]).encode("ascii")[:-1] + b","


def encode(
    structure: bytes,
    values: list[Any],
    *,
    values_encoder: Callable[[list[Any]], str] | None = None,
    trims: dict[int, Trim] | None = None,
) -> bytes:
    """Frame a header body: the :func:`structure_bytes` of its structure, the small
    values (encoded by ``values_encoder``, default the fastest this Python has) and the
    side tables of its trimmed leaves. The caller guarantees the leaf table is consistent."""
    values_json = (values_encoder or _encode_values)(values).encode("ascii")
    if trims:
        records = [[i, *trims[i].record] for i in sorted(trims)]
        body = structure + values_json + b"," + _dumps(records).encode("ascii") + b"]"
    else:
        body = structure + values_json + NO_TRIMS
    if len(body) > MAX_HEADER_BYTES:
        raise ValueError(
            f"the batch's header would be {len(body)} bytes, over the {MAX_HEADER_BYTES}-byte "
            f"limit: the tree has too many leaves or containers; batch small values into "
            f"tensors"
        )
    return PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body)) + body


@dataclass(frozen=True, slots=True)
class Body:
    """A header's body, its framing checked, its leaf table and its trims' side tables
    validated (its tokens and small values are validated when compiled and decoded,
    ``codec.build``).

    Attributes:
        raw: the body's bytes.
        nbytes: the buffer size the header requires.
        align: the alignment every leaf offset is a multiple of.
        leaves: the leaf table, ``[kind, dtype_code, shape, offset, nbytes]`` rows.
        tokens: the tree's structure, as the header carries it.
        values: the small values' tokens, as the header carries them.
        trimmed: the indices of the trimmed leaves.
        trims: their side tables by leaf index; None when no leaf is trimmed.
    """

    raw: bytes
    nbytes: int
    align: int
    leaves: list[list[Any]]
    tokens: Any
    values: list[Any]
    trimmed: frozenset[int]
    trims: dict[int, Trim] | None


def read_body(header: bytes | bytearray | memoryview) -> Body:
    """The body of ``header``, checked in bounded time and memory for any input and before
    anything is allocated from the sizes it states (the trims against this moment's
    rebuild limit).

    Raises:
        HeaderError: the header is not valid for this version of tensorcast.
    """
    raw = _unframe(header)
    body = parse(raw)
    if type(body) is not list or len(body) != 6:
        raise _fail("the body must be a list [nbytes, align, leaves, tokens, values, trims]")
    nbytes, align, leaves, tokens, values, trims = body
    if type(nbytes) is not int or not 0 <= nbytes <= MAX_BUFFER_BYTES:
        raise _fail(f"buffer size {nbytes!r:.40} is not an int in [0, {MAX_BUFFER_BYTES}]")
    if type(align) is not int or not 1 <= align <= MAX_ALIGN or align & (align - 1):
        raise _fail(f"alignment {align!r:.40} is not a power of two in [1, {MAX_ALIGN}]")
    if type(leaves) is not list:
        raise _fail("the leaf table is not a list")
    trimmed = _trimmed_indices(trims, len(leaves))
    end = 0
    for i, leaf in enumerate(leaves):
        end = _check_leaf(i, leaf, align, end, nbytes, i in trimmed)
    if end != nbytes:
        raise _fail(f"the leaves end at byte {end} but the buffer size is {nbytes}")
    if type(values) is not list:
        raise _fail("the small values are not a list")
    side_tables = check_trims(trims, leaves, nbytes + len(header))
    return Body(raw, nbytes, align, leaves, tokens, values, trimmed, side_tables)


def _trimmed_indices(trims: Any, n_leaves: int) -> frozenset[int]:
    """The leaves ``trims`` says are trimmed: a list of records ``[index, ...]`` whose
    indices are ints, in range and strictly increasing (the rest: :func:`check_trims`)."""
    if type(trims) is not list:
        raise _fail("the trims are not a list")
    prev = -1
    for record in trims:
        if type(record) is not list or len(record) != 4 or type(record[0]) is not int:
            raise _fail("a trim is not [leaf index, runs, elements, which]")
        if not prev < record[0] < n_leaves:
            raise _fail(
                f"trimmed leaf {record[0]} is out of range or out of order ({n_leaves} leaves)"
            )
        prev = record[0]
    return frozenset(record[0] for record in trims)


def parse(raw: bytes) -> Any:
    try:
        text = raw.decode("ascii")
        value, end = _scan(text, 0)
    except StopIteration as e:  # no JSON value starts at that character
        raise _fail(
            f"the body is not valid JSON (nothing to read at character {e.value})"
        ) from None
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise _fail(f"the body is not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if end != len(text):
        raise _fail(f"the body is not valid JSON (extra data at character {end})")
    return value


def _check_leaf(
    i: int, leaf: Any, align: int, prev_end: int, nbytes: int, trimmed: bool = False
) -> int:
    if type(leaf) is not list or len(leaf) != 5:
        raise _fail(f"leaf {i} is not [kind, dtype, shape, offset, nbytes]")
    kind, code, shape, offset, size = leaf
    if kind not in KINDS:
        raise _fail(f"leaf {i} has unknown kind {kind!r:.40}; known kinds: {list(KINDS)}")
    table = NUMPY_CODES if kind == "ndarray" else CODE_ITEMSIZE
    if type(code) is not str or code not in table or (kind in ("bytes", "str") and code != "U8"):
        raise _fail(f"leaf {i} ({kind}) has unknown dtype code {code!r:.40}")
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise _fail(f"leaf {i} has a shape that is not a list of at most {MAX_NDIM} dims")
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_BUFFER_BYTES:
            raise _fail(f"leaf {i} has an invalid dimension {d!r:.40}")
    if kind in ("bytes", "str") and len(shape) != 1:
        raise _fail(f"leaf {i} ({kind}) must be 1-D")
    if type(offset) is not int or type(size) is not int:
        raise _fail(f"leaf {i} has a non-integer offset or size")
    itemsize = CODE_ITEMSIZE[code]
    # A zero-element leaf may still not claim dims whose strides would overflow int64.
    if math.prod(d for d in shape if d) * itemsize > MAX_BUFFER_BYTES:
        raise _fail(f"leaf {i} has dims {shape} too large for any buffer")
    if trimmed:  # its side table checks its size (check_trims)
        if kind not in ("tensor", "ndarray"):
            raise _fail(f"leaf {i} ({kind}) is trimmed, but only tensors and arrays can be")
    elif size != math.prod(shape) * itemsize:
        raise _fail(f"leaf {i} claims {size} bytes but shape {shape} x {itemsize} bytes disagrees")
    if offset < prev_end or offset % max(align, itemsize):
        raise _fail(
            f"leaf {i} offset {offset} overlaps the previous leaf (ending at {prev_end}) or is "
            f"not aligned to {max(align, itemsize)}"
        )
    if offset + size > nbytes:
        raise _fail(f"leaf {i} ends at byte {offset + size}, past the {nbytes}-byte buffer")
    return offset + size


# --------------------------------------------------------------------------- trimmed leaves

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
        raise _fail(
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
            raise _fail(f"the trimmed leaves rebuild to over {MAX_LEAF_BYTES} bytes")
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
        raise _fail("a trimmed leaf's record is not [runs, elements, which]")
    runs, elements, which = record
    if len(shape) < 2:
        raise _fail(f"a trimmed leaf must have 2 or more dims, got shape {list(shape)}")
    rows, n = shape[0], math.prod(shape[1:])
    if rows * n * itemsize > max_bytes:
        raise _fail(f"a trimmed leaf of shape {list(shape)} is over {max_bytes} bytes")
    _check_ints(runs, rows, "run lengths")
    if rows and (min(runs) < 0 or max(runs) > n):
        raise _fail(f"a trimmed leaf has a run length outside [0, {n}], its row length")
    stored = (rows * n - sum(runs)) * itemsize
    if stored != nbytes:
        raise _fail(
            f"a trimmed leaf's prefixes hold {stored} bytes but the leaf table says {nbytes}"
        )
    if type(elements) is not str or _HEX.fullmatch(elements) is None:
        raise _fail("a trimmed leaf's elements are not a lowercase hex string")
    raw = bytes.fromhex(elements)
    k, rest = divmod(len(raw), itemsize)
    if rest or k > max(rows, 1):
        raise _fail(
            f"a trimmed leaf's elements hold {len(raw)} bytes, not up to {max(rows, 1)} "
            f"elements of {itemsize} bytes"
        )
    pieces = [raw[i * itemsize : (i + 1) * itemsize] for i in range(k)]
    if any(a >= b for a, b in itertools.pairwise(pieces)):
        raise _fail("a trimmed leaf's elements are not distinct and in increasing order")
    if k == 1:
        if which is not None:
            raise _fail("a trimmed leaf with one element has a `which` list, not null")
        return Trim(n, itemsize, tuple(runs), raw)
    _check_ints(which, rows, "element indices")
    if min(which) < 0 or max(which) >= k:
        raise _fail(f"a trimmed leaf has an element index outside [0, {k})")
    return Trim(n, itemsize, tuple(runs), raw, tuple(which))


def _check_ints(values: Any, count: int, what: str) -> None:
    if type(values) is not list or len(values) != count:
        raise _fail(f"a trimmed leaf's {what} are not a list of {count}, one per row")
    if values and not set(map(type, values)) <= {int}:
        raise _fail(f"a trimmed leaf's {what} hold something other than ints")
