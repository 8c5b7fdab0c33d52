"""The first step of packing: a batch tree flattened into tokens, values and leaves.

The tree is read in preorder and without recursion (any nesting depth works) into its
structure (a flat list of JSON-able tokens), its small values, and the buffer leaves
whose bytes go into the packed buffer, as NOTE [ The token and value grammar ]
(``codec/__init__.py``) describes them.
Nothing here knows about byte layouts or process groups.
"""

from __future__ import annotations

import collections
import functools
import struct
from typing import Any

import numpy as np
import torch

from tensorcast.codec import registry as _registry
from tensorcast.codec.build import I64_MAX, I64_MIN, crowded
from tensorcast.codec.dtypes import CODE_OF_TORCH, numpy_code
from tensorcast.codec.flatten_errors import (
    Fail,
    bad_array,
    bad_key,
    changed,
    check_tensor,
    contains_itself,
    crowded_keys,
    locate,
    lost_attributes,
    mixed_devices,
    unsupported_because,
    unsupported_leaf,
)

__all__ = ["INLINE_LIMIT", "BufferLeaf", "Flat", "flatten"]

# Strings and bytes longer than this travel in the buffer, not in the header.
INLINE_LIMIT = 1024

# A buffer leaf, as flatten returns it: (kind, code, shape, data) where data is a
# tensor, an ndarray, or bytes (str leaves already encoded as UTF-8).
BufferLeaf = tuple[str, str, Any, Any]
# What flatten returns: (tokens, values, leaves, loose).
Flat = tuple[list[Any], list[Any], list[BufferLeaf], bool]

_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")
_OrderedDict = collections.OrderedDict
_Parameter = torch.nn.Parameter
_STRIDED = torch.strided


def flatten(tree: Any) -> Flat:
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
    except Fail as f:
        fail = f
    # Outside the except block, so the error does not chain the internal Fail.
    fail.report(locate(tree, fail.obj, codec_trees))
    raise AssertionError("unreachable: report() raises")


class _Exit:
    """The marker that closes a container on the walk's stack."""


_EXIT = _Exit()


# NOTE [ The walk ]
# _walk is the source's hot loop: a batch of 200 small tensors spends most of its packing
# time in it. Every name it uses is a local and the common types are tested first; rarer
# ones leave the loop, one call each (_walk_other, and _read_dict for a dict). A container is opened by pushing its
# id, the _EXIT marker and its children: popping the marker closes it, and a container met
# again while it is open is a cycle. A dict is read as its keys, then each key's value:
# cheaper than listing items, and a key removed or added meanwhile (another thread) is
# seen, never mispaired.


def _walk(tree: Any, codec_trees: dict[int, tuple[str, Any]]) -> Flat:
    tokens: list[Any] = []
    value_tokens: list[Any] = []  # the small values
    leaves: list[BufferLeaf] = []
    stack: list[Any] = [tree]
    active: set[int] = set()  # the ids of the open containers
    append, value, add_leaf = tokens.append, value_tokens.append, leaves.append
    pop, push, extend = stack.pop, stack.append, stack.extend
    codes = CODE_OF_TORCH
    tensor_t, param_t, strided, exit_t = torch.Tensor, _Parameter, _STRIDED, _Exit
    device: int | None = None  # get_device() of the first tensor: -1 for CPU
    loose = False
    while stack:
        obj = pop()
        t = type(obj)
        if t is tensor_t or t is param_t:
            code = codes.get(obj.dtype)
            if code is None or obj.layout is not strided or obj.is_nested or obj.is_meta:
                raise Fail(obj, functools.partial(check_tensor, obj))
            dev = obj.get_device()
            if dev != device:
                if device is not None:
                    raise _mixed_devices(obj, leaves)
                device = dev
            append(len(leaves))
            add_leaf(("tensor", code, obj.shape, obj))
        elif t is dict or t is _OrderedDict or t is list or t is tuple:
            key = id(obj)
            if key in active:
                raise Fail(obj, contains_itself)
            if t is list or t is tuple:
                append(["l" if t is list else "t", len(obj)])
                children = obj
            else:
                keys, children = _read_dict(obj)
                for k in keys:
                    if type(k) is not str:  # rare: encode them, and note bool / int keys
                        keys, loose = _encode_keys(keys, obj, loose)
                        break
                append(["d" if t is dict else "o", len(keys), keys])
            active.add(key)
            push(key)
            push(_EXIT)
            extend(reversed(children))
        elif t is exit_t:
            active.discard(pop())
        elif (t is str and len(obj) <= INLINE_LIMIT) or obj is None or t is bool:
            append(None)
            value(obj)
        elif t is int:
            append(None)
            value(["i", obj] if I64_MIN <= obj <= I64_MAX else ["I", hex(obj)])
        elif t is float:
            append(None)
            value(["f", _U64.unpack(_F64.pack(obj))[0]])
        else:
            _walk_other(obj, t, tokens, value_tokens, leaves, stack, active, codec_trees)
    return tokens, value_tokens, leaves, loose


def _walk_other(
    obj: Any,
    t: type,
    tokens: list[Any],
    value_tokens: list[Any],
    leaves: list[BufferLeaf],
    stack: list[Any],
    active: set[int],
    codec_trees: dict[int, tuple[str, Any]],
) -> None:
    """The walk's step for the types it meets less often: ndarrays, long strings, bytes,
    complex and numpy scalars, registered types; anything else cannot travel."""
    if t is np.ndarray:
        code = numpy_code(obj.dtype)
        if code is None:
            raise Fail(obj, functools.partial(bad_array, obj))
        tokens.append(len(leaves))
        leaves.append(("ndarray", code, obj.shape, obj))
    elif t is str:  # longer than INLINE_LIMIT
        data = obj.encode("utf-8", "surrogatepass")
        tokens.append(len(leaves))
        leaves.append(("str", "U8", (len(data),), data))
    elif t is bytes:
        if len(obj) <= INLINE_LIMIT:
            tokens.append(None)
            value_tokens.append(["y", obj.hex()])
        else:
            tokens.append(len(leaves))
            leaves.append(("bytes", "U8", (len(obj),), obj))
    elif t is complex:
        tokens.append(None)
        value_tokens.append(
            ["c", _U64.unpack(_F64.pack(obj.real))[0], _U64.unpack(_F64.pack(obj.imag))[0]]
        )
    elif isinstance(obj, np.generic) and t.__module__ == "numpy":
        tokens.append(None)
        value_tokens.append(_encode_scalar(obj))
    else:
        entry = _registry.by_type(t)
        if entry is None:
            if isinstance(obj, torch.Tensor):
                raise Fail(obj, functools.partial(check_tensor, obj))
            raise Fail(obj, functools.partial(unsupported_leaf, obj))
        key = id(obj)
        if key in active:
            raise Fail(obj, contains_itself)
        active.add(key)
        stack.append(key)
        stack.append(_EXIT)
        if entry.kind == "codec":
            assert entry.to_tree is not None
            tokens.append(["x", entry.name])
            sub = entry.to_tree(obj)
            codec_trees[key] = (entry.name, sub)  # for error paths inside it
            stack.append(sub)
        else:
            _check_attrs(obj, entry)
            tokens.append(["r", entry.name, list(entry.fields)])
            for name in reversed(entry.fields):
                stack.append(getattr(obj, name))


def _check_attrs(obj: Any, entry: _registry.TypeEntry) -> None:
    """A registered dataclass travels as its fields: an attribute of the instance that is
    not one (nor a cached property) would be lost (``registry.register_type``)."""
    if entry.kind != "dataclass":
        return
    own = getattr(obj, "__dict__", None)
    if (own is not None and not own.keys() <= entry.attrs) or any(
        hasattr(obj, name) for name in entry.slots
    ):
        raise Fail(obj, functools.partial(lost_attributes, obj, entry))


def _read_dict(obj: Any) -> tuple[list[Any], list[Any]]:
    """A dict's keys, then each key's value (see NOTE [ The walk ])."""
    try:
        keys = list(obj)
        children = list(map(obj.__getitem__, keys))
    except (RuntimeError, KeyError):
        raise Fail(obj, changed) from None
    if len(obj) != len(keys):
        raise Fail(obj, changed)
    return keys, children


def _mixed_devices(obj: torch.Tensor, leaves: list[BufferLeaf]) -> Fail:
    """The failure for tensor ``obj``, on another device than the batch's first tensor."""
    first = next(leaf[3] for leaf in leaves if leaf[0] == "tensor")
    return Fail(obj, functools.partial(mixed_devices, obj, first))


def _encode_keys(keys: list[Any], container: Any, loose: bool) -> tuple[list[Any], bool]:
    """A dict's keys as tokens, and whether the tokens are now loose (see flatten)."""
    tokens = [_encode_key(k, container) for k in keys]
    if crowded(keys):
        raise Fail(container, crowded_keys)
    return tokens, loose or any(type(k) is bool or type(k) is int for k in tokens)


def _encode_key(key: Any, container: Any) -> Any:
    t = type(key)
    if t is str or t is bool or key is None:
        return key
    if t is int:
        return key if I64_MIN <= key <= I64_MAX else ["I", hex(key)]
    raise Fail(container, functools.partial(bad_key, key))


def _encode_scalar(obj: np.generic) -> list[Any]:
    if isinstance(obj, np.str_):
        # str() of a numpy str drops trailing NULs; the str it is keeps them.
        return ["S", "U", str.__str__(obj)]
    if isinstance(obj, np.bytes_):
        return ["S", "S", bytes(obj).hex()]
    code = numpy_code(obj.dtype)
    if code is None:
        raise Fail(
            obj,
            functools.partial(
                unsupported_because, obj, f"numpy scalars of dtype {obj.dtype} cannot travel"
            ),
        )
    return ["s", code, obj.tobytes().hex()]
