"""The views a pooled buffer keeps, so that a repeating batch makes no view anew.

With many small leaves, making one view per leaf is most of a rank's work on a batch. A
pooled buffer (``transport.pool``) therefore keeps the views it was last viewed as, under
a key naming the layout, and hands out ``detach()``-ed copies of them. :class:`KeptViews`
is that cache, one per pooled buffer, and :class:`Keeper` finds a buffer's cache from any
slice of it; both are the codec's ``KeepsViews``.

# NOTE [ Views made ahead ]
Making the fresh copies is itself one ``detach()`` per leaf, so both sides make the next
ones while a head is on the wire, where they would only wait: a receiver once it has
posted the receive of the first message it is about to read, for the layout that message
carried last; the source once it has posted its first message, for the next frame of the
same layout that comes back to that message (its batch dropped by then). When the frame
has that layout they are its leaves; when not, they are dropped. Nothing travels and
nothing waits on them: they are made after the posting, before the wait.

The life of one buffer's kept views, with ``n`` views of the layout ``K``:

    =====================  ====  ======  ==================================================
    state                  key   held    what happens next
    =====================  ====  ======  ==================================================
    no views               None  0       ``views(K)``: made by the codec, kept -> kept
    kept                   K     n       ``views(K)``: n fresh copies handed out (stays);
                                         ``detach_ahead()``: n copies made -> ahead
    kept + ahead           K     2n      ``views(K)``: the copies handed out -> kept;
                                         ``drop_ahead()`` (the frame had another layout,
                                         or none) -> kept
    another key asked      K'    0       all dropped, then made for ``K'`` -> kept (n')
    =====================  ====  ======  ==================================================

Every kept view and every copy made ahead holds a reference to the buffer's storage, and
the pool reuses a buffer only when its storage's use count is what the buffer holds
itself, ``held`` included. ``held`` is lowered before a reference is dropped or handed to
the caller and raised after one is made, so it never counts more than is there: a pool
that reads it from another thread may see a buffer busy a moment too long, never idle
too early. No lock is needed.

# NOTE [ Kept outputs ]
A trimmed leaf is no view of a buffer: it is rebuilt (``codec.untrim``), a write of the
whole leaf, which into fresh host memory costs its page faults, more than trimming saved.
:class:`KeptOutputs` keeps the host tensors a role rebuilt trimmed leaves into, by leaf
slot (the leaf's index, shape and dtype), and hands one out again once its storage's use
count says the caller let go of the batch it was in, as the pool does for buffers:

    ==========  ====================  ==============================================
    state       storage use count     what happens next
    ==========  ====================  ==============================================
    handed out  base + the caller's   ``output()`` of the slot: another one is made
                                      (up to ``MAX_PER_SLOT``), this one stays
    idle        base                  ``output()`` of the slot: handed out again
    ==========  ====================  ==============================================

The caller gets a ``detach()``-ed alias of the kept tensor, whose own reference to the
storage is what the use count sees; the kept tensor and its storage object are ``base``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["KeptOutputs", "Keeper", "KeptViews"]

_detach = torch.Tensor.detach
_use_count = torch._C._storage_Use_Count


class KeptViews:
    """The views one pooled buffer was last viewed as, and copies of them made ahead.

    Used by whichever thread holds the buffer, one at a time (the pool hands a buffer to
    one taker).
    """

    __slots__ = ("ahead", "held", "kept", "key")

    def __init__(self) -> None:
        self.key: Hashable = None
        self.kept: list[torch.Tensor] = []  # detached views: each holds a reference
        self.ahead: list[torch.Tensor] | None = None  # see detach_ahead
        #: the storage references held here: the kept views and the copies made ahead
        self.held = 0

    def views(
        self,
        buffer: torch.Tensor,
        key: Hashable,
        make: Callable[[torch.Tensor], list[torch.Tensor]],
    ) -> list[torch.Tensor]:
        """Fresh tensors on the views ``make(buffer)`` returned the last time ``key`` was
        asked; ``buffer`` views the storage these views are kept for."""
        ahead = self.ahead
        if self.key != key:
            self.held = 0  # lowered first (see the module's docstring)
            self.ahead = None  # made for another key
            self.kept = []
            kept = [v.detach() for v in make(buffer)]
            self.kept, self.key = kept, key
            self.held = len(kept)
        elif ahead is not None:
            self.held = len(self.kept)  # handed to the caller
            self.ahead = None
            return ahead
        return list(map(_detach, self.kept))

    def detach_ahead(self) -> None:
        """Make the fresh tensors of the kept views now, for the next :meth:`views` of the
        same key, while a head is on the wire (NOTE [ Views made ahead ]). Held here, they
        count as the buffer's own."""
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


class Keeper:
    """The kept views of one pool's buffers, found from any slice of a buffer (by its
    storage); a buffer that is not the pool's gets its views made anew."""

    __slots__ = ("_by_storage",)

    def __init__(self) -> None:
        self._by_storage: dict[int, KeptViews] = {}  # storage cdata -> its kept views

    def add(self, cdata: int, kept: KeptViews) -> None:
        self._by_storage[cdata] = kept

    def forget(self, cdata: int, kept: KeptViews) -> None:
        if self._by_storage.get(cdata) is kept:
            del self._by_storage[cdata]

    def views(
        self,
        buffer: torch.Tensor,
        key: Hashable,
        make: Callable[[torch.Tensor], list[torch.Tensor]],
    ) -> list[torch.Tensor]:
        """:meth:`KeptViews.views` of the pooled buffer ``buffer`` views; ``key`` must name
        everything the views depend on but the storage (the layout, and where ``buffer``
        starts in it)."""
        kept = self._by_storage.get(buffer.untyped_storage()._cdata)
        if kept is None:
            return make(buffer)
        return kept.views(buffer, key, make)


class KeptOutputs:
    """The host tensors a role rebuilt trimmed leaves into, handed out again once idle
    (NOTE [ Kept outputs ]); the codec's ``ReusesOutputs``.

    Args:
        max_per_slot: the tensors kept per leaf slot (batches held by the caller or in
            flight at once); past that, fresh memory that is not kept.
    """

    __slots__ = ("_lock", "_slots", "max_per_slot")

    MAX_SLOTS = 64

    def __init__(self, *, max_per_slot: int = 4) -> None:
        self.max_per_slot = max_per_slot
        self._lock = threading.Lock()  # a lane's worker and the caller may both rebuild
        # slot -> [(tensor, its storage, the use count when idle)]
        self._slots: dict[Hashable, list[tuple[torch.Tensor, Any, int]]] = {}

    def output(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous host tensor of ``shape`` and ``dtype`` for leaf ``index``: one the
        caller let go of, else a new one (kept when the slot has room)."""
        key = (index, shape, dtype)
        with self._lock:
            kept = self._slots.get(key)
            if kept is None:
                if len(self._slots) >= self.MAX_SLOTS:  # shapes that keep changing
                    self._slots.clear()
                kept = self._slots[key] = []
            for tensor, storage, base in kept:
                if _use_count(storage._cdata) == base:
                    return tensor.detach()
            tensor = torch.empty(shape, dtype=dtype)
            if len(kept) < self.max_per_slot:
                storage = tensor.untyped_storage()
                kept.append((tensor, storage, int(_use_count(storage._cdata))))
        return tensor.detach()
