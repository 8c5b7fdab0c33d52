"""A tree's structure compiled, and the tree built: a header's tokens and small values
decoded, validated, and rebuilt into the tree.

A structure is compiled once (validating every token) into a :class:`Program`, run for
each batch of that structure with that batch's buffer leaves and small values, which are
decoded anew for each header: by a receiver's ``codec.decode.Decoded``, and by the
source for its own tree (``codec.encode``), from what its encoder knows. The tokens and the values are those of NOTE [ The token
and value grammar ] (``codec/__init__.py``); a peer may send anything, so each one is
checked and an invalid one is a :class:`HeaderError`.
"""

from __future__ import annotations

import collections
import operator
import re
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorcast._errors import HeaderError
from tensorcast.codec import registry as _registry
from tensorcast.codec.dtypes import NUMPY_CODES
from tensorcast.codec.paths import Path, render_path

__all__ = [
    "I64_MAX",
    "I64_MIN",
    "MAX_SAME_HASH",
    "Program",
    "compile_tokens",
    "crowded",
    "decode_values",
    "run",
]

_OrderedDict = collections.OrderedDict
_CONTAINER_TAGS = frozenset("ltdorx")
_F64 = struct.Struct("<d")  # a float value's bits, as an unsigned int
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1  # an "i" value's or an int key's range
_BIG_INT = re.compile(r"-?0x[0-9a-f]+")
_U64 = struct.Struct("<Q")

# A container step while compiling: (tag, extra, path, child references).
_Step = tuple[str, Any, Path, list[tuple[int, int]]]

# NOTE [ Keys that share a hash ]
# A dict takes time quadratic in the number of its keys that share one hash to build (and
# to check for duplicates). A str's hash is salted per process, but an int's is its value
# modulo 2**61 - 1 (``sys.hash_info.modulus``): a peer could send big-int keys a multiple
# of that apart, and a header of a few MB would take minutes to decode. Ints of 64 bits
# share a hash a few at a time at most, so only a dict with big-int keys (``["I", hex]``
# tokens) is counted, in one pass: one with more than MAX_SAME_HASH keys of one hash
# is refused, by the encoder (``UnsupportedLeafError``, before anything is sent) as by
# a receiver (``HeaderError``).
#: the most keys of one dict that may share a hash (NOTE [ Keys that share a hash ])
MAX_SAME_HASH = 16


def crowded(keys: Sequence[Any]) -> bool:
    """Whether more than :data:`MAX_SAME_HASH` of a dict's ``keys`` share one hash, which
    only big-int keys can (NOTE [ Keys that share a hash ]). Linear: the hashes are ints
    below 2**61, each its own hash."""
    if len(keys) <= MAX_SAME_HASH or not any(
        type(k) is int and not I64_MIN <= k <= I64_MAX for k in keys
    ):
        return False
    return max(collections.Counter(map(hash, keys)).values()) > MAX_SAME_HASH


class Program:
    """A compiled tree: how to rebuild it from its buffer leaves' values.

    A program depends on the tree's structure only: every batch of that structure runs
    it, with its own small values.

    ``run`` lays out one list of values: the buffer leaves, then the small values, then
    each container as it is built. Containers are built children first, each from its
    children's values picked out of that list by one ``itemgetter`` call, so rebuilding
    costs a few C calls per container, none per leaf.

    Attributes:
        steps: per container, children first: ``(tag, extra, path, pick, n)``; ``pick``
            is an ``itemgetter`` of the ``n`` children's places when ``n > 1``, the one
            child's place when ``n == 1``.
        root: the root's place.
        n_values: how many small values the tree holds.
    """

    __slots__ = ("n_values", "root", "steps")

    def __init__(self, steps: list[tuple[Any, ...]], root: int, n_values: int):
        self.steps = steps
        self.root = root
        self.n_values = n_values


def compile_tokens(
    tokens: Any, n_leaves: int, *, want_paths: bool = False
) -> tuple[Program, list[Path] | None]:
    """Validate ``tokens`` completely and compile them into a :class:`Program`.

    Returns:
        ``(program, paths)``, ``paths[i]`` the path of buffer leaf ``i`` when asked for.

    Raises:
        HeaderError: the tokens are not a valid tree for ``n_leaves`` buffer leaves.
    """
    if type(tokens) is not list or not tokens:
        raise HeaderError("the header's tree is missing or not a token list")
    used = bytearray(n_leaves)
    paths: list[Path] = [None] * n_leaves
    # A value is referenced as (0, leaf), (1, small value) or (2, container step) until
    # the number of small values is known; then as its place in run()'s list of values.
    n_values = 0
    steps: list[_Step] = []
    stack: list[_Frame] = []
    root: tuple[int, int] | None = None
    total = len(tokens)
    for i, tok in enumerate(tokens):
        if not stack and root is not None:
            raise HeaderError(f"trailing tokens after the root, at token {i}")
        path = _child_path(stack[-1]) if stack else None
        t = type(tok)
        if t is int:
            if not 0 <= tok < n_leaves or used[tok]:
                raise HeaderError(f"buffer leaf reference {tok} is out of range or repeated")
            used[tok] = 1
            paths[tok] = path
            ref = (0, tok)
        elif tok is None:
            ref = (1, n_values)
            n_values += 1
        elif t is list and tok and type(tok[0]) is str and tok[0] in _CONTAINER_TAGS:
            frame = _open(tok, total - i - 1, path)
            if frame.n:
                stack.append(frame)
                continue
            ref = (2, len(steps))
            steps.append((frame.tag, frame.extra, path, []))
        else:
            raise HeaderError(f"invalid token {tok!r:.80} at position {i}")
        # The value is complete: add it to its parent, closing every parent it completes.
        while stack:
            top = stack[-1]
            top.children.append(ref)
            if len(top.children) < top.n:
                break
            stack.pop()
            ref = (2, len(steps))
            steps.append((top.tag, top.extra, top.path, top.children))
        else:
            root = ref
    if stack or root is None:
        raise HeaderError("the header's tree is truncated: a container is missing children")
    return _link(steps, root, used, n_values), paths if want_paths else None


def _link(steps: list[_Step], root: tuple[int, int], used: bytearray, n_values: int) -> Program:
    """The program of ``steps``, once every buffer leaf is known to be ``used``: each
    reference made a place in run()'s list of values."""
    n_leaves = len(used)
    if n_leaves and not all(used):
        raise HeaderError("the header lists buffer leaves that the tree never references")
    base = (0, n_leaves, n_leaves + n_values)
    compiled = []
    for tag, extra, path, children in steps:
        places = [base[kind] + k for kind, k in children]
        pick: Any = (
            operator.itemgetter(*places) if len(places) > 1 else places[0] if places else None
        )
        compiled.append((tag, extra, path, pick, len(places)))
    return Program(compiled, base[root[0]] + root[1], n_values)


def run(program: Program, leaf_values: Sequence[Any], small_values: Sequence[Any]) -> Any:
    """Rebuild a tree from a compiled program, the buffer leaves' values and the small
    values (as :func:`decode_values` returns them; their count is the program's)."""
    values = [*leaf_values, *small_values]
    add = values.append
    for tag, extra, path, pick, n in program.steps:
        items = pick(values) if n > 1 else (values[pick],) if n else ()
        if tag == "d":
            add(dict(zip(extra, items)))
        elif tag == "l":
            add(list(items))
        elif tag == "t":
            add(items)
        elif tag == "o":
            add(_OrderedDict(zip(extra, items)))
        else:
            add(_make(tag, list(items), extra, path))
    return values[program.root]


class _Frame:
    """An open container while compiling."""

    __slots__ = ("children", "extra", "n", "path", "tag")

    def __init__(self, tag: str, n: int, extra: Any, path: Path):
        self.tag = tag
        self.n = n
        self.extra = extra
        self.path = path
        self.children: list[tuple[int, int]] = []  # value references, see compile_tokens


def _child_path(frame: _Frame) -> Any:
    """(parent, key, style, depth): the depth keeps ``render_path`` bounded per leaf."""
    i = len(frame.children)
    tag = frame.tag
    parent = frame.path
    depth = parent[3] + 1 if parent is not None else 1
    if tag == "d" or tag == "o":
        return (parent, frame.extra[i], 0, depth)
    if tag == "r":
        return (parent, frame.extra.fields[i], 1, depth)
    if tag == "x":
        return (parent, frame.extra.name, 2, depth)
    return (parent, i, 0, depth)


def _open(tok: list[Any], remaining: int, path: Path) -> _Frame:
    tag = tok[0]
    if tag == "l" or tag == "t":
        if len(tok) != 2 or type(tok[1]) is not int or not 0 <= tok[1] <= remaining:
            raise HeaderError(f"invalid container token {tok!r:.80}")
        return _Frame(tag, tok[1], None, path)
    if tag == "d" or tag == "o":
        if (
            len(tok) != 3
            or type(tok[1]) is not int
            or not 0 <= tok[1] <= remaining
            or type(tok[2]) is not list
            or len(tok[2]) != tok[1]
        ):
            raise HeaderError(f"invalid dict token {tok!r:.80}")
        keys = tuple(_decode_key(k) for k in tok[2])
        if crowded(keys):
            raise HeaderError(
                f"more than {MAX_SAME_HASH} keys of one dict share a hash (big ints a "
                f"multiple of 2**61 - 1 apart); such a dict would take quadratic time to build"
            )
        if len(dict.fromkeys(keys)) != len(keys):
            raise HeaderError(f"duplicate dict keys in {tok[2]!r:.120}")
        return _Frame(tag, tok[1], keys, path)
    if tag == "r":
        if len(tok) != 3 or type(tok[1]) is not str or type(tok[2]) is not list:
            raise HeaderError(f"invalid registered-type token {tok!r:.80}")
        entry = _registry.by_name(tok[1])
        if entry is None or entry.kind == "codec":
            raise HeaderError(
                f"the header holds a `{tok[1]}` container but no such type is registered "
                f"on this rank; call tensorcast.register_type on every rank"
            )
        if tuple(tok[2]) != entry.fields:
            raise HeaderError(
                f"registered type `{entry.name}` has fields {list(entry.fields)} on this rank "
                f"but {tok[2]!r:.200} on the sender; register the same definition everywhere"
            )
        return _Frame(tag, len(entry.fields), entry, path)
    if tag == "x":
        if len(tok) != 2 or type(tok[1]) is not str:
            raise HeaderError(f"invalid codec token {tok!r:.80}")
        entry = _registry.by_name(tok[1])
        if entry is None or entry.kind != "codec":
            raise HeaderError(f"the header holds a `{tok[1]}` object but no codec for it exists")
        return _Frame(tag, 1, entry, path)
    raise HeaderError(f"invalid token {tok!r:.80}")


def _make(tag: str, items: list[Any], extra: Any, path: Path) -> Any:
    if tag == "l":
        return items
    if tag == "t":
        return tuple(items)
    if tag == "d":
        return dict(zip(extra, items))
    if tag == "o":
        return _OrderedDict(zip(extra, items))
    try:
        if tag == "x":
            return extra.from_tree(items[0])
        if extra.kind == "namedtuple":
            return extra.cls._make(items)
        # as copy.copy rebuilds one: the fields as sent, no __init__ (registry.register_type)
        obj = object.__new__(extra.cls)  # not the class's own __new__, which may want args
        for k, v in zip(extra.fields, items):
            object.__setattr__(obj, k, v)
        return obj
    except HeaderError:
        raise
    except Exception as e:
        raise HeaderError(
            f"cannot rebuild `{extra.name}` at `{render_path(path, 'batch')}`: "
            f"{type(e).__name__}: {e}"
        ) from e


# -- the small values and the dict keys ---------------------------------------------------


def decode_values(values: Any) -> list[Any]:
    """The small values of a header, decoded and validated.

    Raises:
        HeaderError: ``values`` is not a list of value tokens.
    """
    if type(values) is not list:
        raise HeaderError("the header's small values are not a list")
    out = values[:]
    for i, tok in enumerate(values):
        t = type(tok)
        if t is list:
            out[i] = _decode_small(tok)
        elif not (t is str or tok is None or t is bool):
            raise HeaderError(f"invalid value token {tok!r:.80} at position {i}")
    return out


def _decode_key(key: Any) -> Any:
    """A dict key from its token.

    Raises:
        HeaderError: ``key`` is not a key token.
    """
    t = type(key)
    if t is str or t is bool or key is None or (t is int and I64_MIN <= key <= I64_MAX):
        return key
    if t is list and len(key) == 2 and key[0] == "I" and type(key[1]) is str:
        return _parse_big_int(key[1])
    raise HeaderError(f"invalid dict key token {key!r:.80}")


def _decode_small(tok: list[Any]) -> Any:
    """Decode a small-value token that is a list."""
    if not tok:
        raise HeaderError("invalid value token []")
    tag = tok[0]
    n = len(tok)
    if tag == "i" and n == 2 and type(tok[1]) is int and I64_MIN <= tok[1] <= I64_MAX:
        return tok[1]
    if tag == "f" and n == 2:
        return _bits_to_float(tok[1])
    if tag == "I" and n == 2 and type(tok[1]) is str:
        return _parse_big_int(tok[1])
    if tag == "c" and n == 3:
        return complex(_bits_to_float(tok[1]), _bits_to_float(tok[2]))
    if tag == "y" and n == 2:
        return _fromhex(tok[1])
    if tag == "s" and n == 3 and type(tok[1]) is str:
        dtype = NUMPY_CODES.get(tok[1])
        data = _fromhex(tok[2])
        if dtype is None or len(data) != dtype.itemsize or (dtype.kind == "b" and data > b"\x01"):
            raise HeaderError(f"invalid numpy scalar token {tok!r:.80}")
        return np.frombuffer(data, dtype=dtype)[0]
    if tag == "S" and n == 3:
        if tok[1] == "U" and type(tok[2]) is str:
            return np.str_(tok[2])
        if tok[1] == "S":
            return np.bytes_(_fromhex(tok[2]))
    raise HeaderError(f"invalid token {tok!r:.80}")


def _parse_big_int(text: str) -> int:
    """An int as Python's ``hex()`` writes it (``-0x1f``), and no other spelling."""
    if _BIG_INT.fullmatch(text) is None:
        raise HeaderError(f"invalid big-int token {text!r:.80}")
    return int(text, 16)


def _bits_to_float(bits: Any) -> float:
    if type(bits) is not int or not 0 <= bits <= 0xFFFF_FFFF_FFFF_FFFF:
        raise HeaderError(f"invalid float bits {bits!r:.80}")
    return float(_F64.unpack(_U64.pack(bits))[0])


def _fromhex(text: Any) -> bytes:
    if type(text) is not str:
        raise HeaderError(f"expected a hex string, found {type(text).__name__}")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise HeaderError(f"invalid hex string {text!r:.80}") from None
