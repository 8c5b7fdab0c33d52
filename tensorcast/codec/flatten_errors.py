"""Why a tree cannot be flattened, said with the path of the leaf at fault.

The walk in ``codec.flatten`` keeps no paths (they cost allocations on every node): it raises
:class:`Fail` with the object at fault and a ``report`` callable. Once the walk has
stopped, :func:`locate` finds that object's path in the tree and ``report(path)`` raises
the real error, naming it.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch

from tensorcast._errors import UnsupportedLeafError
from tensorcast.codec import registry as _registry
from tensorcast.codec.build import MAX_SAME_HASH
from tensorcast.codec.dtypes import CODE_OF_TORCH
from tensorcast.codec.paths import Path, render_path

__all__ = [
    "Fail",
    "bad_array",
    "bad_key",
    "changed",
    "check_tensor",
    "contains_itself",
    "crowded_keys",
    "locate",
    "mixed_devices",
    "unsupported",
    "unsupported_because",
    "unsupported_leaf",
]

_OrderedDict = collections.OrderedDict
_Parameter = torch.nn.Parameter
_STRIDED = torch.strided


class Fail(Exception):
    """Raised inside the walk; ``report(path)`` raises the real error once the path of
    ``obj`` is known."""

    def __init__(self, obj: Any, report: Any):
        super().__init__()
        self.obj = obj
        self.report = report


def locate(tree: Any, target: Any, codec_trees: dict[int, tuple[str, Any]]) -> Path:
    """The path of ``target`` in ``tree`` (first occurrence in preorder), or None.

    ``codec_trees`` maps the id of each codec object the walk met to its codec's name and
    the subtree it made, so a leaf inside that subtree is found too.
    """
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


def unsupported(obj: Any, path: Path, why: str = "") -> UnsupportedLeafError:
    """The error for a leaf of a type that cannot travel, ``why`` saying how to fix it."""
    cls = type(obj)
    where = render_path(path, "batch")
    why = why or (
        "register it with tensorcast.register_type (NamedTuple or dataclass) "
        "or convert it to a tensor, array or plain value"
    )
    return UnsupportedLeafError(
        f"unsupported leaf of type `{cls.__module__}.{cls.__qualname__}` at `{where}`; {why}"
    )


def check_tensor(t: torch.Tensor, path: Path) -> str:
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
    raise unsupported(obj, path, why)


def unsupported_because(obj: Any, why: str, path: Path) -> None:
    raise unsupported(obj, path, why)


def unsupported_leaf(obj: Any, path: Path) -> None:
    raise unsupported(obj, path)


def lost_attributes(obj: Any, entry: _registry.TypeEntry, path: Path) -> None:
    own = set(getattr(obj, "__dict__", ())) - entry.attrs
    lost = sorted(own | {name for name in entry.slots if hasattr(obj, name)})
    raise unsupported(
        obj,
        path,
        f"its attributes {lost} are not dataclass fields, and only fields travel (the "
        f"receivers rebuild it from its fields, without running __init__); declare each "
        f"as a field (dataclasses.field(init=False) for one set in __post_init__), or "
        f"delete it before sending",
    )


def bad_key(key: Any, path: Path) -> None:
    raise UnsupportedLeafError(
        f"unsupported dict key of type `{type(key).__qualname__}` ({key!r}) in `"
        f"{render_path(path, 'batch')}`; dict keys must be str, int, bool or None"
    )


def crowded_keys(path: Path) -> None:
    raise UnsupportedLeafError(
        f"more than {MAX_SAME_HASH} keys of the dict `{render_path(path, 'batch')}` share one "
        f"hash (big ints a multiple of 2**61 - 1 apart): receivers would take time "
        f"quadratic in their number to rebuild it, so they refuse it; use str keys, or ints "
        f"of 64 bits"
    )


def bad_array(obj: np.ndarray, path: Path) -> None:
    raise unsupported(
        obj,
        path,
        f"numpy arrays of dtype {obj.dtype!s} cannot travel; use bool, int, uint, "
        f"float or complex arrays in native byte order "
        f"(e.g. arr.astype(arr.dtype.newbyteorder('=')))",
    )


def contains_itself(path: Path) -> None:
    raise ValueError(f"the tree contains itself at `{render_path(path, 'batch')}`")


def changed(path: Path) -> None:
    raise RuntimeError(
        f"the dict at `{render_path(path, 'batch')}` changed while it was being packed "
        f"(keys were added or removed); do not mutate a batch while it is being sent"
    )


def mixed_devices(obj: torch.Tensor, first: torch.Tensor, path: Path) -> None:
    raise ValueError(
        f"tensors on mixed devices: `{render_path(path, 'batch')}` is on {obj.device} but an "
        f"earlier tensor is on {first.device}; move the batch to one device before sending it"
    )
