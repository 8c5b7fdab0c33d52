"""Tree <-> token list: the structural half of the codec.

A batch tree is flattened, in preorder and without recursion (any nesting depth works),
into a flat list of JSON-able *tokens* (its structure), the list of its small *values*,
and the list of *buffer leaves* whose bytes go into the packed buffer. The rebuild walks
the same tokens with an explicit stack.

The structure and the values are apart because batches of one loader repeat their
structure while their values change (step numbers, ids): the structure is then laid
out, encoded, validated and compiled once, and only the values travel anew.

Tokens::

    7                    buffer leaf number 7 (a bare int; never a bool)
    null                 the next small value
    ["l", n] ["t", n]    list / tuple of the next n subtrees
    ["d", n, keys]       dict; keys are str, int, bool, null or ["I", hex]
    ["o", n, keys]       collections.OrderedDict
    ["r", name, fields]  a registered NamedTuple / dataclass; one subtree per field
    ["x", name]          a registered codec type; the next subtree is its to_tree()

Values, in preorder::

    null / true / false  None / True / False
    "text"               a str leaf (short ones; long ones are buffer leaves)
    ["i", 5]             int that fits in 64 bits     ["I", "-0x1f..."] any other int
    ["f", bits]          float, its IEEE-754 bits     ["c", re_bits, im_bits] complex
    ["y", "00ff"]        short bytes, hex
    ["s", "F32", "hex"]  numpy scalar                 ["S", "U", text] / ["S", "S", hex]

Nothing here knows about byte layouts or process groups.
"""

from __future__ import annotations

import collections
import functools
import operator
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tensorcast import _registry
from tensorcast._dtypes import CODE_OF_TORCH, NUMPY_CODES, numpy_code
from tensorcast._errors import HeaderError, UnsupportedLeafError

__all__ = [
    "BufferLeaf",
    "Program",
    "compile_tokens",
    "decode_values",
    "flatten",
    "render_path",
    "run",
]

# Strings and bytes longer than this travel in the buffer, not in the header.
INLINE_LIMIT = 1024

_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_OrderedDict = collections.OrderedDict
_Parameter = torch.nn.Parameter
_STRIDED = torch.strided

# A path is a chain of (parent, key, style) tuples; rendered only when someone asks.
# style 0: [key]   style 1: .field   style 2: <codec name>
Path = tuple[Any, ...] | None


_MAX_PATH_PARTS = 64


def render_path(path: Path, root: str = "") -> str:
    """Render a path chain as ``root['audio'][2].field``.

    Deep paths keep their last 64 parts (``root…(9,936 levels)…[0][0]``), so describing
    a header never costs more than a bounded amount per leaf.
    """
    parts: list[str] = []
    while path is not None and len(parts) < _MAX_PATH_PARTS:
        path, key, style = path[0], path[1], path[2]
        parts.append(f"[{key!r}]" if style == 0 else f".{key}" if style == 1 else f"<{key}>")
    if path is not None:
        # Chains built while compiling carry their depth; others are counted once.
        if len(path) > 3:
            hidden = path[3]
        else:
            hidden = 0
            while path is not None:
                path, hidden = path[0], hidden + 1
        parts.append(f"…({hidden:,} levels)…")
    return root + "".join(reversed(parts))


# A buffer leaf, as flatten returns it: (kind, code, shape, data) where data is a
# tensor, an ndarray, or bytes (str leaves already encoded as UTF-8).
BufferLeaf = tuple[str, str, Any, Any]


def _unsupported(obj: Any, path: Path, why: str = "") -> UnsupportedLeafError:
    cls = type(obj)
    where = render_path(path, "batch")
    why = why or (
        "register it with tensorcast.register_type (NamedTuple or dataclass) "
        "or convert it to a tensor, array or plain value"
    )
    return UnsupportedLeafError(
        f"unsupported leaf of type `{cls.__module__}.{cls.__qualname__}` at `{where}`; {why}"
    )


def _check_tensor(t: torch.Tensor, path: Path) -> str:
    """The tensor's dtype code; raises for anything but a dense strided tensor with data."""
    if type(t) is not torch.Tensor and type(t) is not _Parameter:
        return _raise(
            t,
            path,
            "tensor subclasses (DTensor, FakeTensor, ...) cannot travel; "
            "send a plain tensor, e.g. dtensor.full_tensor() or .to_local()",
        )
    if t.layout is not _STRIDED:
        return _raise(
            t,
            path,
            f"only dense strided tensors travel, this one is {t.layout}; call .to_dense() first",
        )
    if t.is_nested:
        return _raise(
            t,
            path,
            "nested tensors cannot travel; send the padded tensor and "
            "its lengths, or a list of tensors",
        )
    if t.is_quantized:
        return _raise(
            t, path, "quantized tensors cannot travel; send .int_repr() and the scale / zero point"
        )
    if t.is_meta:
        return _raise(t, path, "meta tensors have no data to send")
    code = CODE_OF_TORCH.get(t.dtype)
    if code is not None:
        return code
    return _raise(t, path, f"dtype {t.dtype} is not in tensorcast's dtype table")


def _raise(obj: Any, path: Path, why: str) -> str:
    raise _unsupported(obj, path, why)


def _encode_key(key: Any, container: Any) -> Any:
    t = type(key)
    if t is str or t is bool or key is None:
        return key
    if t is int:
        return key if _I64_MIN <= key <= _I64_MAX else ["I", hex(key)]
    raise _Fail(container, functools.partial(_bad_key, key))


def _bad_key(key: Any, path: Path) -> None:
    raise UnsupportedLeafError(
        f"unsupported dict key of type `{type(key).__qualname__}` ({key!r}) in `"
        f"{render_path(path, 'batch')}`; dict keys must be str, int, bool or None"
    )


def _encode_scalar(obj: np.generic) -> list[Any]:
    if isinstance(obj, np.str_):
        # str() of a numpy str drops trailing NULs; the str it is keeps them.
        return ["S", "U", str.__str__(obj)]
    if isinstance(obj, np.bytes_):
        return ["S", "S", bytes(obj).hex()]
    code = numpy_code(obj.dtype)
    if code is None:
        raise _Fail(
            obj,
            functools.partial(
                _raise_unsupported_why, obj, f"numpy scalars of dtype {obj.dtype} cannot travel"
            ),
        )
    return ["s", code, obj.tobytes().hex()]


def _raise_unsupported_why(obj: Any, why: str, path: Path) -> None:
    raise _unsupported(obj, path, why)


class _Fail(Exception):
    """Raised inside the walk; ``report(path)`` raises the real error once the path of
    ``obj`` is known. The walk keeps no paths: they cost allocations on every node."""

    def __init__(self, obj: Any, report: Any):
        super().__init__()
        self.obj = obj
        self.report = report


def flatten(tree: Any) -> tuple[list[Any], list[Any], list[BufferLeaf], bool]:
    """Flatten ``tree`` into preorder tokens, its small values and its buffer leaves.

    Returns:
        ``(tokens, values, leaves, loose)``: ``loose`` is True when the tokens hold a
        bool or int dict key, whose ``==`` cannot tell ``True`` from ``1``: such token
        lists must not be compared to decide that two trees are alike. (Values compare
        strictly: a bare value token is never an int.)

    Raises:
        UnsupportedLeafError: a leaf, key or container type cannot travel.
        ValueError: the tree contains itself, or its tensors are on several devices.
        RuntimeError: a dict changed size while it was being read.
    """
    codec_trees: dict[int, tuple[str, Any]] = {}
    try:
        return _walk(tree, codec_trees)
    except _Fail as f:
        fail = f
    # Outside the except block, so the error does not chain the internal _Fail.
    fail.report(_locate(tree, fail.obj, codec_trees))
    raise AssertionError("unreachable: report() raises")


def _locate(tree: Any, target: Any, codec_trees: dict[int, tuple[str, Any]]) -> Path:
    """The path of ``target`` in ``tree`` (first occurrence in preorder), or None."""
    stack: list[tuple[Any, Path]] = [(tree, None)]
    seen: set[int] = set()
    while stack:
        obj, path = stack.pop()
        if obj is target:
            return path
        t = type(obj)
        if t is dict or t is _OrderedDict or t is list or t is tuple or id(obj) in codec_trees:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
        if t is dict or t is _OrderedDict:
            for k, v in reversed(list(obj.items())):
                stack.append((v, (path, k, 0)))
        elif t is list or t is tuple:
            for i in range(len(obj) - 1, -1, -1):
                stack.append((obj[i], (path, i, 0)))
        elif id(obj) in codec_trees:
            name, sub = codec_trees[id(obj)]
            stack.append((sub, (path, name, 2)))
        else:
            entry = (
                _registry.by_type(t) if not isinstance(obj, (torch.Tensor, np.ndarray)) else None
            )
            if entry is not None and entry.kind != "codec":
                for name in reversed(entry.fields):
                    stack.append((getattr(obj, name), (path, name, 1)))
    return None


def _walk(
    tree: Any, codec_trees: dict[int, tuple[str, Any]]
) -> tuple[list[Any], list[Any], list[BufferLeaf], bool]:
    # The hot loop of the source: every name it uses is a local, and the common types are
    # tested first. A batch of 200 small tensors spends most of its packing time here.
    tokens: list[Any] = []
    smalls: list[Any] = []  # the small values
    leaves: list[BufferLeaf] = []
    append, add_leaf, value = tokens.append, leaves.append, smalls.append
    # A stack of objects; _EXIT followed by an id leaves a container (cycle detection).
    stack: list[Any] = [tree]
    pop, push, extend = stack.pop, stack.append, stack.extend
    active: set[int] = set()
    codes = CODE_OF_TORCH
    tensor_t, param_t, strided, exit_t = torch.Tensor, _Parameter, _STRIDED, _Exit
    n_leaves = 0
    device: int | None = None  # get_device() of the first tensor: -1 for CPU
    first_tensor: Any = None
    loose = False
    while stack:
        obj = pop()
        t = type(obj)
        if t is tensor_t or t is param_t:
            code = codes.get(obj.dtype)
            if code is None or obj.layout is not strided or obj.is_nested or obj.is_meta:
                raise _Fail(obj, functools.partial(_check_tensor, obj))
            dev = obj.get_device()
            if dev != device:
                if device is not None:
                    raise _Fail(obj, functools.partial(_mixed_devices, obj, first_tensor))
                device, first_tensor = dev, obj
            append(n_leaves)
            n_leaves += 1
            add_leaf(("tensor", code, obj.shape, obj))
        elif t is dict or t is _OrderedDict:
            key = id(obj)
            if key in active:
                raise _Fail(obj, _contains_itself)
            # Keys, then each key's value: cheaper than listing items, and a key removed
            # or added meanwhile (another thread) is seen below, never mispaired.
            try:
                keys = list(obj)
                children = list(map(obj.__getitem__, keys))
            except (RuntimeError, KeyError):
                raise _Fail(obj, _changed) from None
            if len(obj) != len(keys):
                raise _Fail(obj, _changed)
            for k in keys:
                if type(k) is not str:  # rare: encode them, and note bool / int keys
                    keys = [_encode_key(k, obj) for k in keys]
                    loose = loose or any(type(k) is bool or type(k) is int for k in keys)
                    break
            append(["d" if t is dict else "o", len(keys), keys])
            active.add(key)
            push(key)
            push(_EXIT)
            extend(reversed(children))
        elif t is exit_t:
            active.discard(pop())
        elif t is str:
            if len(obj) <= INLINE_LIMIT:
                append(None)
                value(obj)
            else:
                append(n_leaves)
                n_leaves += 1
                data = obj.encode("utf-8", "surrogatepass")
                add_leaf(("str", "U8", (len(data),), data))
        elif t is int:
            append(None)
            value(["i", obj] if _I64_MIN <= obj <= _I64_MAX else ["I", hex(obj)])
        elif t is list or t is tuple:
            key = id(obj)
            if key in active:
                raise _Fail(obj, _contains_itself)
            append(["l" if t is list else "t", len(obj)])
            active.add(key)
            push(key)
            push(_EXIT)
            extend(reversed(obj))
        elif obj is None:
            append(None)
            value(None)
        elif t is float:
            append(None)
            value(["f", _U64.unpack(_F64.pack(obj))[0]])
        elif t is bool:
            append(None)
            value(obj)
        elif t is np.ndarray:
            code = numpy_code(obj.dtype)
            if code is None:
                raise _Fail(obj, functools.partial(_bad_array, obj))
            append(n_leaves)
            n_leaves += 1
            add_leaf(("ndarray", code, obj.shape, obj))
        elif t is bytes:
            if len(obj) <= INLINE_LIMIT:
                append(None)
                value(["y", obj.hex()])
            else:
                append(n_leaves)
                n_leaves += 1
                add_leaf(("bytes", "U8", (len(obj),), obj))
        elif t is complex:
            append(None)
            value(["c", _U64.unpack(_F64.pack(obj.real))[0], _U64.unpack(_F64.pack(obj.imag))[0]])
        elif isinstance(obj, np.generic) and t.__module__ == "numpy":
            append(None)
            value(_encode_scalar(obj))
        else:
            entry = _registry.by_type(t)
            if entry is None:
                if isinstance(obj, torch.Tensor):
                    raise _Fail(obj, functools.partial(_check_tensor, obj))
                raise _Fail(obj, functools.partial(_raise_unsupported, obj))
            key = id(obj)
            if key in active:
                raise _Fail(obj, _contains_itself)
            active.add(key)
            push(key)
            push(_EXIT)
            if entry.kind == "codec":
                assert entry.to_tree is not None
                append(["x", entry.name])
                sub = entry.to_tree(obj)
                codec_trees[key] = (entry.name, sub)  # for error paths inside it
                push(sub)
            else:
                append(["r", entry.name, list(entry.fields)])
                for name in reversed(entry.fields):
                    push(getattr(obj, name))
    return tokens, smalls, leaves, loose


def _contains_itself(path: Path) -> None:
    raise ValueError(f"the tree contains itself at `{render_path(path, 'batch')}`")


def _changed(path: Path) -> None:
    raise RuntimeError(
        f"the dict at `{render_path(path, 'batch')}` changed while it was being packed "
        f"(keys were added or removed); do not mutate a batch while it is being sent"
    )


def _mixed_devices(obj: torch.Tensor, first: torch.Tensor, path: Path) -> None:
    raise ValueError(
        f"tensors on mixed devices: `{render_path(path, 'batch')}` is on {obj.device} but an "
        f"earlier tensor is on {first.device}; move the batch to one device before sending it"
    )


def _bad_array(obj: np.ndarray, path: Path) -> None:
    raise _unsupported(
        obj,
        path,
        f"numpy arrays of dtype {obj.dtype!s} cannot travel; use bool, int, uint, "
        f"float or complex arrays in native byte order "
        f"(e.g. arr.astype(arr.dtype.newbyteorder('=')))",
    )


def _raise_unsupported(obj: Any, path: Path) -> None:
    raise _unsupported(obj, path)


class _Exit:
    """The marker that closes a container on the walk's stack."""


_EXIT = _Exit()


def _decode_key(key: Any) -> Any:
    t = type(key)
    if t is str or t is int or t is bool or key is None:
        return key
    if t is list and len(key) == 2 and key[0] == "I" and type(key[1]) is str:
        return _parse_big_int(key[1])
    raise HeaderError(f"invalid dict key token {key!r:.80}")


def _parse_big_int(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        raise HeaderError(f"invalid big-int token {text!r:.80}") from None


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


def _decode_small(tok: list[Any]) -> Any:
    """Decode a small-value token that is a list."""
    if not tok:
        raise HeaderError("invalid value token []")
    tag = tok[0]
    n = len(tok)
    if tag == "i" and n == 2 and type(tok[1]) is int:
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
        if dtype is None or len(data) != dtype.itemsize:
            raise HeaderError(f"invalid numpy scalar token {tok!r:.80}")
        return np.frombuffer(data, dtype=dtype)[0]
    if tag == "S" and n == 3:
        if tok[1] == "U" and type(tok[2]) is str:
            return np.str_(tok[2])
        if tok[1] == "S":
            return np.bytes_(_fromhex(tok[2]))
    raise HeaderError(f"invalid token {tok!r:.80}")


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


_CONTAINER_TAGS = frozenset("ltdorx")


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
        values = dict(zip(extra.fields, items))
        obj = extra.cls(**{k: v for k, v in values.items() if k in extra.init_fields})
        for k, v in values.items():
            if k not in extra.init_fields:
                object.__setattr__(obj, k, v)
        return obj
    except HeaderError:
        raise
    except Exception as e:
        raise HeaderError(
            f"cannot rebuild `{extra.name}` at `{render_path(path, 'batch')}`: "
            f"{type(e).__name__}: {e}"
        ) from e


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
    paths: list[Path] | None = [None] * n_leaves if want_paths else None
    # A value is referenced as (0, leaf), (1, small value) or (2, container step) until
    # the number of small values is known; then as its place in run()'s list of values.
    n_values = 0
    steps: list[tuple[str, Any, Path, list[tuple[int, int]]]] = []
    stack: list[_Frame] = []
    root: tuple[int, int] = (0, 0)
    roots = 0
    total = len(tokens)
    for i, tok in enumerate(tokens):
        if not stack and roots:
            raise HeaderError(f"trailing tokens after the root, at token {i}")
        path = _child_path(stack[-1]) if stack else None
        t = type(tok)
        if t is int:
            if not 0 <= tok < n_leaves or used[tok]:
                raise HeaderError(f"buffer leaf reference {tok} is out of range or repeated")
            used[tok] = 1
            if paths is not None:
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
            roots += 1
            root = ref
    if stack or roots != 1:
        raise HeaderError("the header's tree is truncated: a container is missing children")
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
    return Program(compiled, base[root[0]] + root[1], n_values), paths


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
