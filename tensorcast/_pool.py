"""A pool of reusable uint8 buffers.

Copying a large batch into freshly allocated memory costs more than the transfer itself
(page faults), so both the source and the receivers take their buffers from a pool. A
buffer is handed out again only when nothing else holds its storage: every tensor or
array view handed to the caller keeps a reference to the storage, so its use count says
whether the caller still holds any of it. Reuse therefore needs no promise from the
caller; a batch kept for long simply keeps its buffer out of the pool.
"""

from __future__ import annotations

import threading
import time

import torch

__all__ = ["BufferPool"]

_MIN_CAPACITY = 4096
_LARGE = 1 << 20
_LARGE_RETRIES = 20
_STALE_AFTER = 64  # takes without reuse after which an idle buffer is dropped
_RETRY_SLEEP = 50e-6  # 20 x 50 us: at most ~1 ms before allocating anew


class _Entry:
    """A pooled buffer and the storage use count that means "nobody else holds it".

    The storage object is kept so a check is one cheap call: it holds one reference
    of its own, which the idle count includes.
    """

    __slots__ = ("buffer", "capacity", "cdata", "idle", "last_used", "storage")

    def __init__(self, buffer: torch.Tensor, now: int):
        self.last_used = now
        self.buffer = buffer
        self.capacity = buffer.numel()
        self.storage = buffer.untyped_storage()
        self.cdata = self.storage._cdata
        self.idle = self.use_count()

    def use_count(self) -> int:
        return int(torch._C._storage_Use_Count(self.cdata))


def _capacity_of(entry: _Entry) -> int:
    return entry.capacity


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
    """

    def __init__(self, *, max_buffers: int = 6) -> None:
        self._max_buffers = max_buffers
        self._lock = threading.Lock()
        self._takes = 0  # a clock: how many takes this pool has served
        # key -> entries, most recently used last
        self._buffers: dict[tuple[torch.device, bool], list[_Entry]] = {}

    def take(self, nbytes: int, device: torch.device, *, pinned: bool = False) -> torch.Tensor:
        """A 1-D uint8 tensor of exactly ``nbytes`` bytes, a view into a pooled buffer."""
        key = (device, pinned)
        limit = 2 * max(nbytes, _MIN_CAPACITY)
        # gloo's worker thread drops its reference to a finished broadcast's tensor just
        # after wait() returns; for a large buffer a short wait beats a fresh allocation.
        retries = _LARGE_RETRIES if nbytes >= _LARGE else 0
        for attempt in range(retries + 1):
            with self._lock:
                entries = self._buffers.setdefault(key, [])
                if attempt == 0:
                    self._takes += 1
                    self._evict_stale(entries)
                fits = [e for e in entries if nbytes <= e.capacity <= limit]
                fits.sort(key=_capacity_of)
                for entry in fits:
                    if entry.use_count() == entry.idle:
                        entry.last_used = self._takes
                        entries.remove(entry)
                        entries.append(entry)
                        return entry.buffer[:nbytes]
                if not fits or attempt == retries:
                    return self._allocate(entries, nbytes, device, pinned)
            time.sleep(_RETRY_SLEEP)
        raise AssertionError("unreachable")

    def _allocate(
        self, entries: list[_Entry], nbytes: int, device: torch.device, pinned: bool
    ) -> torch.Tensor:
        buf = torch.empty(_capacity(nbytes), dtype=torch.uint8, device=device, pin_memory=pinned)
        entries.append(_Entry(buf, self._takes))
        if len(entries) > self._max_buffers:
            # Forget the least recently used idle buffer (a busy one stays with its user).
            for i, old in enumerate(entries[:-1]):
                if old.use_count() == old.idle:
                    del entries[i]
                    break
            else:
                del entries[0]
        return buf[:nbytes]

    def _evict_stale(self, entries: list[_Entry]) -> None:
        """Forget idle buffers not reused lately: a rare large batch should not pin its
        memory for the rest of the run, while buffers in steady rotation stay."""
        stale = self._takes - _STALE_AFTER
        if entries and entries[0].last_used < stale:
            entries[:] = [e for e in entries if e.last_used >= stale or e.use_count() != e.idle]

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()
