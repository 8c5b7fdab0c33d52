"""lhotse cuts and cut sets travel as their dict form, never pickled.

A cut travels as ``cut.to_dict()``, encoded like any other subtree: its numpy arrays
(e.g. token ids that NeMo keeps in ``cut.custom``) and its large ``bytes`` (the audio of
an in-memory recording) go into the packed buffer; ids, durations and texts go into the
header. Receivers rebuild the cut with lhotse's own ``from_dict``, so what comes back is
what lhotse would read from a manifest: the same fields, and the same audio when loaded.
A ``CutSet`` travels as the list of its cuts.

``tensorcast._registry`` imports this module the first time it meets a lhotse object
(sending) or a ``lhotse.*`` name in a header (receiving); ``import tensorcast`` alone never
imports lhotse. A rank without lhotse that receives cuts raises ``HeaderError``.

A cut's dict names where its audio lives (a path, a URL, or a shell command for
``type: command`` sources): the receiving rank reads it from there if it loads the audio,
exactly as it would from a manifest. Only in-memory audio travels inside the buffer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tensorcast._errors import HeaderError
from tensorcast._registry import register_codec, register_type

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


def _cutset_to_tree(cuts: CutSet) -> list[Any]:
    # each cut then travels through its own codec
    return list(cuts)


def _cutset_from_tree(tree: Any) -> CutSet:
    if type(tree) is not list:
        raise HeaderError(
            f"a `lhotse.CutSet` travels as a list of cuts, but the header holds a "
            f"{type(tree).__name__}"
        )
    for i, cut in enumerate(tree):
        if not isinstance(cut, Cut):
            raise HeaderError(
                f"a `lhotse.CutSet` holds only cuts, but its item {i} is of type {type(cut).__name__}"
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
