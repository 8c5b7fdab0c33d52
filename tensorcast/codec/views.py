"""A buffer seen as one layout's leaves: typed tensor views, host arrays, bytes, str.

A :class:`ViewSpec` is worked out once per distinct leaf table; a receiver's rebuild
(``codec.decode.leaf_views``) and the sender's write (``codec.encode``) both go through one.
A trimmed leaf is no view: it is re-padded from its stored bytes (``codec.repad``), into
memory a :class:`Reuses` hands out when there is one.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence, Set
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tensorcast.codec.dtypes import CODE_ITEMSIZE, TORCH_CODES

if TYPE_CHECKING:
    pass

__all__ = ["MAX_ITEMSIZE", "Reuses", "ViewSpec"]


class Reuses(Protocol):
    """What reuses the memory a tree is built on, once nobody can see it (the transport's
    ``Keeper``, NOTE [ Memory handed out ] in ``transport/pool.py``)."""

    def views(
        self,
        buffer: torch.Tensor,
        key: Hashable,
        make: Callable[[torch.Tensor], list[torch.Tensor]],
    ) -> list[torch.Tensor]:
        """Fresh tensors on the views ``make(buffer)`` made the last time this buffer was
        viewed as ``key``, when the buffer is one it keeps views for; else ``make(buffer)``."""
        ...

    def output(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A contiguous host tensor of ``shape`` and ``dtype`` to rebuild trimmed leaf
        ``index`` into (reused memory), or None for fresh memory."""
        ...


MAX_ITEMSIZE = max(CODE_ITEMSIZE.values())

_strides_cache: dict[tuple[int, ...], tuple[int, ...]] = {}


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = _strides_cache.get(shape)
    if strides is None:
        acc = 1
        out = []
        for d in reversed(shape):
            out.append(acc)
            acc *= d if d > 1 else 1
        strides = tuple(reversed(out))
        if len(_strides_cache) > 4096:
            _strides_cache.clear()
        _strides_cache[shape] = strides
    return strides


class ViewSpec:
    """How to view a buffer as one layout's leaves; computed once per distinct layout.

    ``specs`` has one ``(code, shape, strides, element offset)`` per tensor leaf, in leaf
    order, so making the views is one comprehension of ``as_strided`` calls: with many
    small leaves, that is most of a receiver's work.
    """

    __slots__ = (
        "bools",
        "codes",
        "count",
        "host_nbytes",
        "host_spans",
        "host_trimmed",
        "others",
        "specs",
        "tensor_index",
        "trimmed",
    )

    def __init__(
        self,
        table: Sequence[Sequence[Any]],
        bool_as_bytes: bool = False,
        trimmed: Set[int] = frozenset(),
    ):
        self.count = len(table)  # the leaves in the table
        self.specs: list[tuple[str, tuple[int, ...], tuple[int, ...], int]] = []
        self.codes: dict[str, int] = {}  # code -> itemsize, for the typed bases
        self.tensor_index: list[int] = []  # the leaf index of each spec
        self.bools: list[int] = []  # positions in specs of bool leaves
        self.others: list[tuple[int, Any]] = []  # (leaf index, row) of the other leaves
        self.trimmed: list[tuple[int, Any]] = []  # (leaf index, row) of trimmed leaves
        for i, row in enumerate(table):
            kind, code, shape, off = row[0], row[1], row[2], row[3]
            if trimmed and i in trimmed:
                self.trimmed.append((i, row))
                continue
            if kind != "tensor":
                self.others.append((i, row))
                continue
            if code == "BOOL":
                self.bools.append(len(self.specs))
                if bool_as_bytes:
                    code = "U8"
            isz = CODE_ITEMSIZE[code]
            self.codes[code] = isz
            shape_t = tuple(shape)
            self.specs.append((code, shape_t, _contiguous_strides(shape_t), off // isz))
            self.tensor_index.append(i)
        #: where each other leaf's bytes sit in a *host block*: those bytes alone, one
        #: after another (aligned), for a buffer that lives on a GPU (``decode.leaf_views``)
        #: trimmed ndarray leaves follow the others, their stored bytes (a host result)
        self.host_spans: list[tuple[int, int, int]] = []  # (offset, nbytes, host position)
        self.host_trimmed: dict[int, tuple[int, int]] = {}  # leaf index -> (position, nbytes)
        pos = 0
        on_host = self.others + [(i, row) for i, row in self.trimmed if row[0] == "ndarray"]
        for k, (i, row) in enumerate(on_host):
            self.host_spans.append((row[3], row[4], pos))
            if k >= len(self.others):
                self.host_trimmed[i] = (pos, row[4])
            pos = (pos + row[4] + MAX_ITEMSIZE - 1) // MAX_ITEMSIZE * MAX_ITEMSIZE
        self.host_nbytes = pos

    def placed(self, tensors: list[Any]) -> list[Any]:
        """``tensors`` (one per spec) at their leaf indices in a list of every leaf; the
        other leaves' places are None, for the caller to fill."""
        values: list[Any] = [None] * self.count
        for i, value in zip(self.tensor_index, tensors):
            values[i] = value
        return values

    def tensor_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor leaf's typed view of ``buffer``, in leaf order."""
        total = buffer.numel()
        base_offset = buffer.storage_offset()  # as_strided offsets count from the storage
        bases = {
            code: buffer[: total - total % isz].view(TORCH_CODES[code])
            for code, isz in self.codes.items()
        }
        as_strided = torch.as_strided
        if not base_offset:
            return [as_strided(bases[c], sh, st, o) for c, sh, st, o in self.specs]
        shift = {code: base_offset // isz for code, isz in self.codes.items()}
        return [as_strided(bases[c], sh, st, o + shift[c]) for c, sh, st, o in self.specs]

    def kept_views(self, buffer: torch.Tensor, reuse: Reuses | None) -> list[torch.Tensor]:
        """:meth:`tensor_views`, as fresh tensors on views ``reuse`` keeps for ``buffer``
        when it came from there (:class:`Reuses`)."""
        if reuse is None:
            return self.tensor_views(buffer)
        return reuse.views(buffer, (self, buffer.storage_offset()), self.tensor_views)
