"""A buffer seen as one layout's leaves: typed tensor views, host arrays, bytes, str.

A :class:`ViewSpec` is worked out once per distinct leaf table; a receiver's rebuild
(``codec.decode.leaf_views``) and the sender's write (``codec.encode``) both go through one.
A trimmed leaf is no view: it is re-padded from its stored bytes (``codec.repad``), into
memory a :class:`Reuses` hands out when there is one. Views made once are kept with the
memory they view (:class:`KeptViews`), and handed out again as fresh tensors.

# NOTE [ Views made ahead ]
Memory whose views are handed out again (a pooled buffer, a first message) keeps the
views it was last viewed as, under a key naming the layout, and hands out ``detach()``-ed
copies of them (:class:`KeptViews`): with many small leaves, making one view per leaf is
most of a rank's work on a batch. Making the copies is itself one ``detach()`` per leaf,
so both roles make the next ones while a head is on the wire, where they would only
wait: a receiver once it has posted the receive of the first message it is about to
read, for the layout that message carried last; the source once it has posted its first
message, for the next frame of the same layout that comes back to that message (its
batch dropped by then). When the frame has that layout they are its leaves; when not,
they are dropped. The life of one buffer's kept views, ``n`` views of the layout ``K``
(each holds a storage reference, counted in ``held``, which the memory's keeper adds to
its own: NOTE [ Memory handed out ] in ``transport/pool.py``):

    =====================  ====  ======  ==================================================
    state                  key   held    what happens next
    =====================  ====  ======  ==================================================
    no views               None  0       ``views(K)``: None; the codec makes them,
                                         ``keep(K, views)`` -> kept
    kept                   K     n       ``views(K)``: n fresh copies handed out (stays);
                                         ``detach_ahead()``: n copies made -> ahead
    kept + ahead           K     2n      ``views(K)``: the copies handed out -> kept;
                                         ``drop_ahead()`` (the frame had another layout,
                                         or none) -> kept
    another key asked      K     n       ``views(K')``: None; ``keep(K', views')``: all
                                         dropped, the new ones kept -> kept (n')
    =====================  ====  ======  ==================================================

``held`` is lowered before a reference is dropped or handed out and raised after one is
made, so it never counts more than is there: a keeper that reads it from another thread
may see the memory busy a moment too long, never idle too early.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence, Set
from types import MappingProxyType
from typing import Any, Protocol

import torch

from tensorcast._errors import HeaderError
from tensorcast.codec.dtypes import CODE_ITEMSIZE, TORCH_CODES

__all__ = ["MAX_ITEMSIZE", "KeptViews", "Reuses", "ViewSpec"]

_detach = torch.Tensor.detach
_NO_OUTPUTS: Mapping[int, torch.Tensor] = MappingProxyType({})
# Leaves the encoder writes as their bytes (``ViewSpec(as_bytes=True)``): a bool copy
# would turn bytes other than 0 / 1 (masks made with ``.view(torch.bool)``) into 1, and
# float4 has no strided copy; as uint8, both are a plain copy of their bytes.
_AS_BYTES = frozenset(("BOOL", "F4_E2M1_X2"))


class KeptViews:
    """The views one piece of reused memory was last viewed as, and copies of them made
    ahead (NOTE [ Views made ahead ]).

    Used by whichever thread holds the memory, one at a time (its keeper hands it to one
    taker).
    """

    __slots__ = ("ahead", "held", "kept", "key")

    def __init__(self) -> None:
        self.key: Hashable = None
        self.kept: list[torch.Tensor] = []  # views never handed out: each holds a reference
        self.ahead: list[torch.Tensor] | None = None  # see detach_ahead
        #: the storage references held here: the kept views and the copies made ahead
        self.held = 0

    def views(self, key: Hashable) -> list[torch.Tensor] | None:
        """Fresh tensors on the views kept under ``key`` (the copies made ahead, if any),
        or None when the views kept are not ``key``'s: then :meth:`keep` them."""
        if self.key != key:
            return None
        ahead = self.ahead
        if ahead is not None:
            self.held = len(self.kept)  # handed to the caller
            self.ahead = None
            return ahead
        return list(map(_detach, self.kept))

    def keep(self, key: Hashable, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """Keep ``views`` (made for this memory) under ``key``, in place of what was kept,
        and return fresh tensors on them. Kept detached: a view made from another one
        would keep that one alive too, a reference ``held`` does not count."""
        self.held = 0  # lowered first
        self.ahead = None
        self.kept = kept = list(map(_detach, views))
        self.key = key
        self.held = len(kept)
        return list(map(_detach, kept))

    def detach_ahead(self) -> None:
        """Make the fresh tensors of the kept views now, for the next :meth:`views` of the
        same key, while a head is on the wire. Held here, they count as the memory's own."""
        kept = self.kept
        if kept:
            self.held = len(kept)
            ahead = self.ahead = list(map(_detach, kept))
            self.held = len(kept) + len(ahead)
        elif self.ahead is not None:
            self.drop_ahead()

    def drop_ahead(self) -> None:
        """Let go of the copies made ahead (the frame did not use them)."""
        self.held = len(self.kept)
        self.ahead = None


class Reuses(Protocol):
    """What reuses the memory a tree is built on, once nobody can see it (the transport's
    ``Keeper``, NOTE [ Memory handed out ] in ``transport/pool.py``)."""

    def memory(
        self, buffer: torch.Tensor, outputs: Sequence[tuple[tuple[int, ...], torch.dtype]]
    ) -> tuple[KeptViews | None, list[torch.Tensor]]:
        """What one tree on ``buffer`` is built on, asked once per tree: the views kept for
        ``buffer``'s memory (None when it is not memory this keeps views for), and one
        contiguous host tensor of each ``(shape, dtype)`` of ``outputs``, reused memory,
        to re-pad a trimmed leaf into."""
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
        "bytewise",
        "codes",
        "count",
        "host_nbytes",
        "host_spans",
        "host_trimmed",
        "others",
        "output_shapes",
        "outputs",
        "specs",
        "tensor_index",
        "trimmed",
    )

    def __init__(
        self,
        table: Sequence[Sequence[Any]],
        as_bytes: bool = False,
        trimmed: Set[int] = frozenset(),
    ):
        self.count = len(table)  # the leaves in the table
        self.specs: list[tuple[str, tuple[int, ...], tuple[int, ...], int]] = []
        self.codes: dict[str, int] = {}  # code -> itemsize, for the typed bases
        self.tensor_index: list[int] = []  # the leaf index of each spec
        self.bytewise: list[tuple[int, torch.dtype]] = []  # (position in specs, dtype)
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
            if as_bytes and code in _AS_BYTES:
                self.bytewise.append((len(self.specs), TORCH_CODES[code]))
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
        #: the trimmed tensor leaves, rebuilt into memory a Reuses hands out on a host
        self.outputs = [
            (i, tuple(row[2]), TORCH_CODES[row[1]]) for i, row in self.trimmed if row[0] == "tensor"
        ]
        self.output_shapes = [(shape, dtype) for _, shape, dtype in self.outputs]

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

    def kept_views(
        self, buffer: torch.Tensor, reuse: Reuses | None
    ) -> tuple[list[torch.Tensor], Mapping[int, torch.Tensor]]:
        """:meth:`tensor_views`, as fresh tensors on the views ``reuse`` keeps for
        ``buffer``'s memory, when it keeps them (:class:`KeptViews`); and the memory
        ``reuse`` hands out for the trimmed tensor leaves on a host, by leaf index (none
        without ``reuse``: each re-pad takes fresh memory).

        Raises:
            HeaderError: the trimmed leaves' memory cannot be allocated.
        """
        if reuse is None:
            return self.tensor_views(buffer), _NO_OUTPUTS
        outputs = self.outputs if buffer.is_cpu else ()
        try:
            kept, into = reuse.memory(buffer, self.output_shapes if outputs else ())
        except (RuntimeError, MemoryError) as e:  # torch's out of memory is a RuntimeError
            leaves = ", ".join(
                f"{i} ({dtype} of shape {list(shape)})" for i, shape, dtype in outputs
            )
            raise HeaderError(
                f"the memory of the header's trimmed leaves {leaves} could not be allocated: "
                f"{type(e).__name__}: {e}"
            ) from None
        memory = {i: t for (i, _, _), t in zip(outputs, into)} if outputs else _NO_OUTPUTS
        if kept is None:
            return self.tensor_views(buffer), memory
        key = (self, buffer.storage_offset())
        views = kept.views(key)
        if views is None:
            views = kept.keep(key, self.tensor_views(buffer))
        return views, memory

    def leaves(
        self, buffer: torch.Tensor, reuse: Reuses | None
    ) -> tuple[list[Any], Mapping[int, torch.Tensor]]:
        """:meth:`kept_views` :meth:`placed` among every leaf (as they are when every leaf
        is a tensor), and the memory for the trimmed ones."""
        tensors, memory = self.kept_views(buffer, reuse)
        if len(tensors) == self.count:
            return tensors, memory
        return self.placed(tensors), memory
