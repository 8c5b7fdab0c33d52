"""lhotse cuts and cut sets travel as their dict form, never pickled.

A cut travels as ``cut.to_dict()``, encoded like any other subtree: its numpy arrays
(e.g. token ids that NeMo keeps in ``cut.custom``) and its large ``bytes`` (the audio of
an in-memory recording) go into the packed buffer; ids, durations and texts go into the
header. Receivers rebuild the cut with lhotse's own ``from_dict``, so what comes back is
what lhotse would read from a manifest: the same fields, and the same audio when loaded.

A ``CutSet`` travels as the list of its items: cuts, or registered NamedTuples and
dataclasses (NeMo's conversation batches are a ``CutSet`` of dataclasses), each through
its own codec or registry entry, and comes back as a ``CutSet`` of equal items in the
same order. Registered items are rebuilt as they are anywhere else in a batch.

``tensorcast.codec.registry`` imports this module the first time it meets a lhotse object
(sending) or a ``lhotse.*`` name in a header (receiving); ``import tensorcast`` alone never
imports lhotse. A rank without lhotse that receives cuts raises ``HeaderError``.

A cut's dict names where its audio lives (a path, a URL, or a shell command for
``type: command`` sources): the receiving rank reads it from there if it loads the audio,
exactly as it would from a manifest. Only in-memory audio travels inside the buffer.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch

from tensorcast._errors import HeaderError, UnsupportedLeafError
from tensorcast.codec.registry import by_type, register_codec, register_type

try:
    from lhotse import CutSet, MonoCut, MultiCut, Recording, SupervisionSegment
    from lhotse.cut import Cut, MixedCut, PaddingCut
    from lhotse.supervision import AlignmentItem
except ImportError as e:
    raise HeaderError(
        f"this batch holds lhotse objects (cuts, cut sets, recordings or supervisions) but "
        f"lhotse cannot be imported on this rank ({type(e).__name__}: {e}); install it on "
        f"every rank that receives them: pip install lhotse (or tensorcast[lhotse])"
    ) from e

__all__: list[str] = []


def _to_dict(obj: Any) -> Any:
    return obj.to_dict()


def _owned(tree: Any) -> Any:
    """Copy the arrays and tensors of a freshly rebuilt subtree, in place.

    Rebuilt arrays are views into the whole batch's buffer. Cuts are often kept longer
    than their batch (e.g. collected for evaluation); copies keep them from pinning the
    buffer, and let lhotse or the user modify them freely. Cut metadata is small.
    """
    stack = [tree]
    while stack:
        node = stack.pop()
        keys: Any = node.keys() if type(node) is dict else range(len(node))
        for k in keys:
            v = node[k]
            t = type(v)
            if t is np.ndarray:
                node[k] = v.copy()
            elif t is torch.Tensor:
                node[k] = v.clone()
            elif t is dict or t is list:
                stack.append(v)
            elif t is tuple:
                node[k] = tuple(_owned(list(v)))
    return tree


def _expect_dict(tree: Any, name: str) -> dict[str, Any]:
    if type(tree) is not dict:
        raise HeaderError(
            f"a `{name}` travels as a dict (its to_dict() form), but the header holds a "
            f"{type(tree).__name__}"
        )
    return _owned(tree)


def _from_dict(cls: type, name: str) -> Any:
    def from_tree(tree: Any) -> Any:
        # the dict is fresh and ours: from_dict may pop keys from it (lhotse does)
        return cls.from_dict(_expect_dict(tree, name))  # type: ignore[attr-defined]

    return from_tree


# Values that travel anywhere in a batch but are not items of a CutSet.
_PLAIN_TYPES: frozenset[type] = frozenset(
    {
        dict,
        collections.OrderedDict,
        list,
        tuple,
        str,
        bytes,
        int,
        float,
        complex,
        bool,
        type(None),
        np.ndarray,
        torch.Tensor,
        torch.nn.Parameter,
    }
)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_item(obj: Any) -> bool:
    """Whether ``obj`` may be an item of a travelling CutSet: a cut, or a registered
    NamedTuple / dataclass (exactly its type, as the registry matches it)."""
    if isinstance(obj, Cut):
        return True
    entry = by_type(type(obj))
    return entry is not None and entry.kind != "codec"


def _cutset_to_tree(cuts: CutSet) -> list[Any]:
    # Each item then travels through its own codec or registry entry. Items of types the
    # registry does not know are left to the walk, whose error names their path. Plain
    # values and other lhotse objects would travel, but only cuts and registered types
    # are CutSet items to the receiver: refuse them here, on the encoding side.
    items = list(cuts)
    for i, item in enumerate(items):
        t = type(item)
        plain = t in _PLAIN_TYPES or (isinstance(item, np.generic) and t.__module__ == "numpy")
        if (plain or by_type(t) is not None) and not _is_item(item):
            raise UnsupportedLeafError(
                f"a `lhotse.CutSet` travels with items that are cuts or registered "
                f"NamedTuples / dataclasses, but its item {i} is of type `{_qualname(t)}`; "
                f"send it beside the CutSet (e.g. in a dict), or wrap it in a dataclass "
                f"registered with tensorcast.register_type"
            )
    return items


def _cutset_from_tree(tree: Any) -> CutSet:
    if type(tree) is not list:
        raise HeaderError(
            f"a `lhotse.CutSet` travels as a list of its items, but the header holds a "
            f"{type(tree).__name__}"
        )
    for i, item in enumerate(tree):
        if not _is_item(item):
            raise HeaderError(
                f"a `lhotse.CutSet` holds only cuts and registered NamedTuples / "
                f"dataclasses, but its item {i} is of type {type(item).__name__}"
            )
    return CutSet(tree)


# lhotse types that travel as their to_dict() form, rebuilt by their own from_dict().
# A PaddingCut needs PaddingCut.from_dict: lhotse's deserialize_item rejects it.
_DICT_TYPES: tuple[tuple[type, str], ...] = (
    (MonoCut, "lhotse.MonoCut"),
    (MultiCut, "lhotse.MultiCut"),
    (MixedCut, "lhotse.MixedCut"),
    (PaddingCut, "lhotse.PaddingCut"),
    (Recording, "lhotse.Recording"),
    (SupervisionSegment, "lhotse.SupervisionSegment"),
)

for _cls, _name in _DICT_TYPES:
    register_codec(_cls, name=_name, to_tree=_to_dict, from_tree=_from_dict(_cls, _name))
register_codec(CutSet, name="lhotse.CutSet", to_tree=_cutset_to_tree, from_tree=_cutset_from_tree)
# A cut's to_dict() keeps word alignments as AlignmentItem NamedTuples (dataclasses.asdict
# leaves NamedTuples as they are); they travel as a registered container.
register_type(AlignmentItem, name="lhotse.AlignmentItem")
