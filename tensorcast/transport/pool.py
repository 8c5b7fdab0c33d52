"""Pools of reusable uint8 buffers, handed out again once nothing else holds them.

Writing a large batch into fresh memory costs more than its transfer (page faults), so
both sides take payload buffers from a :class:`BufferPool`, and first messages from a
:class:`FramePool`. A buffer is reused only when nothing but the pool holds its storage:
every view handed to the caller holds a storage reference, so the storage's use count
says whether the caller still holds any of it, and reuse needs no promise from the
caller. Each buffer also keeps the views of the last layout it was viewed as, whose
references count as the buffer's own (``transport.kept``, with their state table).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from tensorcast.transport.kept import Keeper, KeptOutputs, KeptViews

__all__ = ["BufferPool", "FirstMessage", "FramePool"]

_MIN_CAPACITY = 4096
_LARGE = 1 << 20
_LARGE_RETRIES = 20
_STALE_AFTER = 64  # takes without reuse after which an idle buffer is dropped
_RETRY_SLEEP = 50e-6  # with _LARGE_RETRIES: about 1 ms at most before allocating anew


class _Entry:
    """A pooled buffer, the storage use count that means "nobody else holds it", and the
    views it keeps (``transport.kept``).

    The storage object is kept so a check is one cheap call: it holds one reference
    of its own, which ``_base`` includes.
    """

    __slots__ = ("_base", "buffer", "capacity", "cdata", "kept", "last_used", "storage")

    def __init__(self, buffer: torch.Tensor, now: int):
        self.last_used = now
        self.buffer = buffer
        self.capacity = buffer.numel()
        self.storage = buffer.untyped_storage()
        self.cdata = self.storage._cdata
        self.kept = KeptViews()
        self._base = self.use_count()  # the references of the buffer and its storage

    def use_count(self) -> int:
        return int(_use_count(self.cdata))

    def is_idle(self) -> bool:
        """Whether nothing but this entry (its buffer, storage and kept views) holds the
        buffer's storage."""
        return _use_count(self.cdata) == self._base + self.kept.held


def _capacity(nbytes: int) -> int:
    """Round up to the next of 2**k or 1.5 * 2**k: at most a third wasted, few sizes."""
    if nbytes <= _MIN_CAPACITY:
        return _MIN_CAPACITY
    p = 1 << (nbytes - 1).bit_length()
    return p * 3 // 4 if nbytes <= p * 3 // 4 else p


class BufferPool:
    """Buffers bucketed by capacity, reused once no view of them is alive.

    Args:
        max_buffers: how many idle buffers to keep per device; older ones are dropped.
        allocate: ``allocate(nbytes)`` makes a host buffer (pinned staging for a GPU);
            by default plain memory on the device asked for.
    """

    def __init__(
        self, *, max_buffers: int = 6, allocate: Callable[[int], torch.Tensor] | None = None
    ) -> None:
        self._max_buffers = max_buffers
        self._allocate_host = allocate
        self._lock = threading.Lock()
        self._takes = 0  # a clock: how many takes this pool has served
        # key -> entries, most recently used last
        self._buffers: dict[torch.device, list[_Entry]] = {}
        #: the kept views of this pool's buffers: the codec's ``KeepsViews`` for them
        self.kept = Keeper()
        #: host tensors that trimmed leaves are rebuilt into (NOTE [ Kept outputs ])
        self.outputs = KeptOutputs()

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A 1-D uint8 tensor of exactly ``nbytes`` bytes, a view into a pooled buffer."""
        limit = 2 * max(nbytes, _MIN_CAPACITY)
        # gloo's worker thread drops its reference to a finished broadcast's tensor just
        # after wait() returns; for a large buffer a short wait beats a fresh allocation.
        retries = _LARGE_RETRIES if nbytes >= _LARGE else 0
        for attempt in range(retries + 1):
            with self._lock:
                entries = self._buffers.setdefault(device, [])
                if attempt == 0:
                    self._takes += 1
                    self._evict_stale(entries)
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
        self.kept.add(entry.cdata, entry.kept)
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
        self.kept.forget(entry.cdata, entry.kept)

    def _evict_stale(self, entries: list[_Entry]) -> None:
        """Forget idle buffers not reused lately: a rare large batch should not pin its
        memory for the rest of the run, while buffers in steady rotation stay."""
        stale = self._takes - _STALE_AFTER
        if entries and entries[0].last_used < stale:
            keep: list[_Entry] = []
            for e in entries:
                if e.last_used >= stale or not e.is_idle():
                    keep.append(e)
                else:
                    self._forget(e)
            entries[:] = keep


class FirstMessage(_Entry):
    """One first-message buffer: the tensor the wire moves, its host view, and what was
    made from it for the caller (kept, so that a repeating frame makes nothing anew: the
    views of its leaves, and the slice of its inline payload, :meth:`inline_payload`).

    Attributes:
        host: a numpy view of the whole buffer (no storage reference of its own), and
            ``mem`` a memoryview of it.
        written: what the source's last frame wrote here: the end of its head, and the
            start and end of its inline payload (see ``Sender``).
    """

    __slots__ = ("_inline", "_inline_span", "host", "mem", "written")

    def __init__(self, capacity: int) -> None:
        super().__init__(torch.zeros(capacity, dtype=torch.uint8), 0)
        self.host: np.ndarray = self.buffer.numpy()
        self.mem: memoryview = self.host.data
        self._base = self.use_count()  # the host views count as the entry's own
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
    each handed out again once nothing made from it is alive (see :class:`FirstMessage`).

    Used by one lane's jobs, one after another: no lock.

    Args:
        max_buffers: how many to keep; the oldest beyond it is forgotten (it stays with
            whoever still holds a batch made from it).
    """

    def __init__(self, *, max_buffers: int = 8) -> None:
        self._max_buffers = max_buffers
        self._messages: list[FirstMessage] = []

    def take(self, capacity: int) -> FirstMessage:
        """An idle message of exactly ``capacity`` bytes."""
        for message in self._messages:
            if message.capacity == capacity and message.is_idle():
                return message
        # Capacities only grow: idle buffers of another size are not needed again.
        kept = [m for m in self._messages if m.capacity == capacity or not m.is_idle()]
        del kept[: max(0, len(kept) + 1 - self._max_buffers)]
        message = FirstMessage(capacity)
        self._messages = [*kept, message]
        return message


_use_count = torch._C._storage_Use_Count
