"""Memory tensorcast hands out and takes back: pooled buffers, first messages, the views
they keep, and the memory trimmed leaves are rebuilt into, under one rule for reuse.

Writing a large batch into fresh memory costs more than its transfer (page faults), so
both sides take payload buffers from a :class:`BufferPool`, first messages from a
:class:`FramePool`, and the host memory of rebuilt trimmed leaves from their role's
:class:`Keeper`, which also finds the views a pooled buffer was last viewed as (the
codec's ``KeptViews``, NOTE [ Views made ahead ] in ``codec/views.py``) and is the codec's
``Reuses``. Every piece of it is written again only under NOTE [ Memory handed out ],
whose rule is :func:`reusable`.

# NOTE [ Memory handed out ]
Memory whose views went to the caller (a payload buffer, a first message, a rebuilt
trimmed leaf) is the caller's until nobody can see it any more. The pool keeps, for each
piece, its storage object, the references it holds itself (``held``: the buffer, the
storage, and its ``KeptViews``' own: the kept views and the copies made ahead), and the
storage's data pointer when it was pooled. :func:`reusable` is true only when

- the storage's use count is ``held``: no tensor, numpy array (which holds the storage
  through its base), DLPack capsule or slice of it is alive in this process;
- no caller holds the storage *object*, nor a weak reference to it: torch hands out one
  Python storage object per storage while it lives, so a caller's ``t.untyped_storage()``
  kept after ``t`` is the keeper's own object and adds no use count; its Python
  references tell it apart. Both counts are read with ``sys.getrefcount`` in a
  statement of its own, the storage a local of the frame, in frames alike: the count
  read when the piece was pooled and the count read now. Passed down a call, an object
  gains one reference per call on Python 3.11 and later, two on 3.10, and maybe none on
  a later one, so no count is read in a callee and compared with one read in its
  caller;
- the storage is not shared with another process: ``share_memory_()``, which a
  ``torch.multiprocessing`` queue runs on every CPU tensor it sends, leaves it
  ``is_shared()`` and mapped by the consumer, whose references this count never sees
  (CUDA storages say ``is_shared()`` always; CUDA IPC keeps a reference in this process
  while a consumer maps one, so the count sees them);
- its bytes have not moved: ``share_memory_()`` copies them into shared memory and frees
  the old block, so a raw pointer kept beside the tensor is stale after it. (A batch's
  leaves share one storage, so moving one tensor leaf moves them all; its ndarray leaves
  are copies for that reason, NOTE [ Numpy leaves beside tensors ] in ``codec/decode.py``.
  A shared-memory slot is not freed by a move: its old pages stay the slot's, and a
  caller's ``t.numpy()`` made before the move may still read them, so the slot stays
  held until the moved storage dies, ``MappedSegment.idle`` in ``transport/segment.py``.)

Anything else is *gone*: forgotten, never written again (it stays with whoever holds
it). No raw pointer into pooled memory is used unchecked: a first message's host views
are read and written only while it is taken, and only an idle message, its data pointer
the one it was pooled with, is taken.
The life of one pooled piece:

    ==========  ==============================  =========================================
    state       what :func:`reusable` sees      what happens next
    ==========  ==============================  =========================================
    handed out  use count > ``held``            stays; the pool takes another piece
    idle        use count == ``held``, not      handed out again (the least recently
                shared, pointer unchanged       used idle piece past the pool's bound,
                                                or one idle too long, is dropped)
    gone        shared, or its bytes moved      forgotten at the next take, never
                                                written again
    ==========  ==============================  =========================================

``held`` is lowered before a reference is dropped or handed to the caller and raised
after one is made, so it never counts more than is there: a pool that reads it from
another thread may see a piece busy a moment too long, never idle too early.

*Bounded.* A pool keeps at most ``max_buffers`` pieces per device, each within twice
the size it was taken for, and drops idle ones not reused within 64 takes: at most a
small multiple of the largest batch, whatever the batches' shapes. The memory of
rebuilt trimmed leaves is taken by size (a rounded capacity, viewed as the leaf's shape
and dtype), so batches whose shapes change every step reuse it as they reuse buffers.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tensorcast.codec import KeptViews

__all__ = ["BufferPool", "FirstMessage", "FramePool", "Keeper", "reusable"]

_MIN_CAPACITY = 4096
_LARGE = 1 << 20
_LARGE_RETRIES = 20
_STALE_AFTER = 64  # takes without reuse after which an idle buffer is dropped
_RETRY_SLEEP = 50e-6  # with _LARGE_RETRIES: about 1 ms at most before allocating anew
#: the pieces a role keeps for its rebuilt trimmed leaves (leaves x batches held at once)
OUTPUT_BUFFERS = 12

_use_count = torch._C._storage_Use_Count
_weakrefs = weakref.getweakrefcount
_detach = torch.Tensor.detach
_CPU = torch.device("cpu")


def reusable(
    storage: torch.UntypedStorage, pointer: int, held: int, refs: int, counted: int
) -> bool:
    """Whether memory tensorcast handed out may be written again (NOTE [ Memory handed
    out ]): nothing but its keeper's own ``held`` references holds ``storage`` in this
    process, nothing holds a weak reference to its storage object, no other process maps
    it, and its bytes are still at ``pointer``, where they were when it was pooled.

    Args:
        storage: the memory's storage object (one of the ``held``).
        pointer: ``storage.data_ptr()`` when the memory was pooled.
        held: the references the keeper holds itself (its tensor, the storage object,
            any views it keeps).
        refs: ``sys.getrefcount(storage)`` read when nothing but tensorcast could see the
            memory, and ``counted`` the same read now: torch hands out one storage object
            per storage while it lives, so a caller's ``t.untyped_storage()`` kept after
            ``t`` is that same object, which the use count cannot tell from the keeper's;
            its Python references can. Both are read by the caller, each in a statement of
            its own, ``storage`` a local of the frame (NOTE [ Memory handed out ]): what
            passing an object down a call adds differs between Python versions.
    """
    return (
        counted <= refs
        and _use_count(storage._cdata) == held
        and not _weakrefs(storage)
        and storage.data_ptr() == pointer
        and (storage.device.type == "cuda" or not storage.is_shared())
    )


class _Entry:
    """A pooled buffer, what it holds itself, where its bytes were, and the views it
    keeps (NOTE [ Memory handed out ]).

    The storage object is kept so a check is a few cheap calls: it holds one reference
    of its own, which ``_base`` includes.
    """

    __slots__ = (
        "_base",
        "_refs",
        "buffer",
        "capacity",
        "cuda",
        "kept",
        "last_used",
        "pointer",
        "storage",
    )

    def __init__(self, buffer: torch.Tensor, now: int):
        self.last_used = now
        self.buffer = buffer
        self.capacity = buffer.numel()
        storage = self.storage = buffer.untyped_storage()
        self._refs = sys.getrefcount(storage)  # read as is_idle reads it
        self.pointer = storage.data_ptr()
        self.cuda = buffer.is_cuda  # CUDA storages say is_shared() always
        self.kept = KeptViews()
        self._base = self.use_count()  # the references of the buffer and its storage

    @property
    def cdata(self) -> int:
        return int(self.storage._cdata)

    def use_count(self) -> int:
        return int(_use_count(self.storage._cdata))

    def is_idle(self) -> bool:
        """Whether the buffer may be written again: :func:`reusable`, inline (a take asks
        it of every buffer that fits)."""
        storage = self.storage
        return (
            sys.getrefcount(storage) <= self._refs  # no caller keeps the object (reusable)
            and _use_count(storage._cdata) == self._base + self.kept.held
            and not _weakrefs(storage)
            and storage.data_ptr() == self.pointer
            and (self.cuda or not storage.is_shared())
        )

    def is_gone(self) -> bool:
        """Whether the buffer left the pool for good: shared, or its bytes moved."""
        storage = self.storage
        return storage.data_ptr() != self.pointer or (not self.cuda and storage.is_shared())


def _capacity(nbytes: int) -> int:
    """Round up to the next of 2**k or 1.5 * 2**k: at most a third wasted, few sizes."""
    if nbytes <= _MIN_CAPACITY:
        return _MIN_CAPACITY
    p = 1 << (nbytes - 1).bit_length()
    return p * 3 // 4 if nbytes <= p * 3 // 4 else p


class Keeper:
    """One role's reuse of what it hands out (NOTE [ Memory handed out ]): the kept views
    of its pooled buffers and first messages, found from any slice of one (by its
    storage), and the host memory its trimmed leaves are rebuilt into. The codec's
    ``Reuses``; a buffer that is not the role's gets its views made anew.

    Args:
        max_outputs: the pieces of memory kept for rebuilt trimmed leaves.
    """

    __slots__ = ("__weakref__", "_by_storage", "_max_outputs", "_outputs")

    def __init__(self, *, max_outputs: int = OUTPUT_BUFFERS) -> None:
        self._by_storage: dict[int, KeptViews] = {}  # storage cdata -> its kept views
        self._max_outputs = max_outputs
        self._outputs: BufferPool | None = None  # made at the first trimmed leaf

    def add(self, cdata: int, kept: KeptViews) -> None:
        self._by_storage[cdata] = kept

    def forget(self, cdata: int, kept: KeptViews) -> None:
        if self._by_storage.get(cdata) is kept:
            del self._by_storage[cdata]

    def memory(
        self, buffer: torch.Tensor, outputs: Sequence[tuple[tuple[int, ...], torch.dtype]]
    ) -> tuple[KeptViews | None, list[torch.Tensor]]:
        """The codec's ``Reuses``: the kept views of the pooled buffer ``buffer`` views
        (None for a buffer that is not the role's), and a piece of host memory for each
        ``(shape, dtype)`` of ``outputs`` (trimmed leaves to re-pad): pooled memory taken by
        size, viewed as that shape and dtype, reused once nobody can see it."""
        kept = self._by_storage.get(buffer.untyped_storage()._cdata)
        if not outputs:
            return kept, []
        pool = self._outputs
        if pool is None:
            pool = self._outputs = BufferPool(
                max_buffers=self._max_outputs, keeper=self, wait=False
            )
        into = [
            pool.take(math.prod(shape) * dtype.itemsize, _CPU).view(dtype).view(shape)
            for shape, dtype in outputs
        ]
        return kept, into


class BufferPool:
    """Buffers bucketed by capacity, reused under NOTE [ Memory handed out ].

    Args:
        max_buffers: how many buffers to keep per device; the least recently used idle
            one past it is dropped (a busy one stays with its user).
        allocate: ``allocate(nbytes)`` makes a host buffer (pinned staging for a GPU);
            by default plain memory on the device asked for.
        keeper: where the buffers' kept views are found (:class:`Keeper`); default one of
            the pool's own.
        wait: wait up to about 1 ms for a large busy buffer to come back (gloo's worker
            lets go of a finished broadcast's tensor just after ``wait()`` returns).
    """

    def __init__(
        self,
        *,
        max_buffers: int = 6,
        allocate: Callable[[int], torch.Tensor] | None = None,
        keeper: Keeper | None = None,
        wait: bool = True,
    ) -> None:
        self._max_buffers = max_buffers
        self._allocate_host = allocate
        self._wait = wait
        self._lock = threading.Lock()
        self._takes = 0  # a clock: how many takes this pool has served
        # key -> entries, most recently used last
        self._buffers: dict[torch.device, list[_Entry]] = {}
        #: what finds this pool's buffers' kept views: the codec's ``Reuses`` for them
        self.keeper = Keeper() if keeper is None else keeper

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A 1-D uint8 tensor of exactly ``nbytes`` bytes, a view into a pooled buffer."""
        limit = 2 * max(nbytes, _MIN_CAPACITY)
        retries = _LARGE_RETRIES if nbytes >= _LARGE and self._wait else 0
        for attempt in range(retries + 1):
            with self._lock:
                entries = self._buffers.setdefault(device, [])
                if attempt == 0:
                    self._takes += 1
                    self._evict(entries)
                # The smallest idle buffer that fits (the first of equals).
                best: _Entry | None = None
                fits = False
                for entry in entries:
                    capacity = entry.capacity
                    if nbytes <= capacity <= limit:
                        fits = True
                        if (best is None or capacity < best.capacity) and entry.is_idle():
                            best = entry
                if best is not None:
                    best.last_used = self._takes
                    if entries[-1] is not best:
                        entries.remove(best)
                        entries.append(best)
                    return best.buffer[:nbytes]
                if not fits or attempt == retries:
                    return self._allocate(entries, nbytes, device)
            time.sleep(_RETRY_SLEEP)
        raise AssertionError("unreachable")

    def _allocate(self, entries: list[_Entry], nbytes: int, device: torch.device) -> torch.Tensor:
        if self._allocate_host is not None and device.type == "cpu":
            buf = self._allocate_host(_capacity(nbytes))
        else:
            buf = torch.empty(_capacity(nbytes), dtype=torch.uint8, device=device)
        entry = _Entry(buf, self._takes)
        entries.append(entry)
        self.keeper.add(entry.cdata, entry.kept)
        if len(entries) > self._max_buffers:
            # Forget the least recently used idle buffer (a busy one stays with its user).
            for i, old in enumerate(entries[:-1]):
                if old.is_idle():
                    self._forget(entries.pop(i))
                    break
            else:
                self._forget(entries.pop(0))
        return buf[:nbytes]

    def _forget(self, entry: _Entry) -> None:
        self.keeper.forget(entry.cdata, entry.kept)

    def _evict(self, entries: list[_Entry]) -> None:
        """Forget buffers that are gone (shared, or moved: NOTE [ Memory handed out ]), and
        idle buffers not reused lately: a rare large batch should not pin its memory for
        the rest of the run, while buffers in steady rotation stay."""
        stale = self._takes - _STALE_AFTER
        # A gone buffer is never taken again, so it grows stale: dropped here, as late.
        if entries and entries[0].last_used < stale:
            keep: list[_Entry] = []
            for e in entries:
                if not e.is_gone() and (e.last_used >= stale or not e.is_idle()):
                    keep.append(e)
                else:
                    self._forget(e)
            entries[:] = keep


class FirstMessage(_Entry):
    """One first-message buffer: the tensor the wire moves, and what was made from it for
    the caller (kept, so that a repeating frame makes nothing anew: the views of its
    leaves, and the slice of its inline payload, :meth:`inline_payload`).

    Attributes:
        host: a numpy view of the whole buffer.
        mem: a memoryview of the whole buffer.
        written: what the source's last frame wrote here: the end of its head, and the
            start and end of its inline payload (see ``Sender``).

    ``host`` and ``mem`` view the bytes where they were when the message was made: a
    message whose bytes moved (``share_memory_()``) is gone, never taken again
    (:meth:`FramePool.take` hands out idle messages alone), so a message taken is read
    and written through them as they are.
    """

    __slots__ = ("_inline", "_inline_span", "host", "mem", "written")

    def __init__(self, capacity: int) -> None:
        super().__init__(torch.zeros(capacity, dtype=torch.uint8), 0)
        self.host: np.ndarray = self.buffer.numpy()
        self.mem: memoryview = self.host.data
        self._base = self.use_count()  # the host view counts as the entry's own
        self.written = (0, capacity, capacity)
        self._inline: torch.Tensor | None = None
        self._inline_span = (0, -1)

    def inline_payload(self, at: int, n: int) -> torch.Tensor:
        """The inline payload's bytes ``[at, at + n)`` as a 1-D tensor, kept: a frame cut
        as the last one gets the same slice, with none made. Held here, the slice counts as
        the message's own (lowered before it is dropped, raised after one is made)."""
        view = self._inline
        if view is not None and self._inline_span == (at, n):
            return view
        if view is not None:
            self._base -= 1
            self._inline = view = None
        view = self.buffer[at : at + n]
        self._inline, self._inline_span = view, (at, n)
        self._base += 1
        return view


class FramePool:
    """The first messages of one side of a channel: buffers of the frame's capacity,
    each handed out again under NOTE [ Memory handed out ] (see :class:`FirstMessage`).

    Used by one lane's jobs, one after another: no lock.

    Args:
        max_buffers: how many to keep; the oldest beyond it is forgotten (it stays with
            whoever still holds a batch made from it).
        keeper: where the messages' kept views are found (the role's :class:`Keeper`).
    """

    def __init__(self, *, max_buffers: int = 8, keeper: Keeper | None = None) -> None:
        self._max_buffers = max_buffers
        self._keeper = keeper
        self._messages: list[FirstMessage] = []

    def take(self, capacity: int) -> FirstMessage:
        """An idle message of exactly ``capacity`` bytes."""
        for message in self._messages:
            if message.capacity == capacity and message.is_idle():
                return message
        # Capacities only grow: idle buffers of another size are not needed again.
        kept = [
            m
            for m in self._messages
            if not m.is_gone() and (m.capacity == capacity or not m.is_idle())
        ]
        del kept[: max(0, len(kept) + 1 - self._max_buffers)]
        message = FirstMessage(capacity)
        if self._keeper is not None:
            for old in self._messages:
                if old not in kept:
                    self._keeper.forget(old.cdata, old.kept)
            self._keeper.add(message.cdata, message.kept)
        self._messages = [*kept, message]
        return message
