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
_RETRY_SLEEP = 50e-6  # 20 x 50 us: at most ~1 ms before allocating anew


def _use_count(t: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


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
        # key -> list of (buffer, idle use count); most recently used last
        self._buffers: dict[tuple[torch.device, bool], list[tuple[torch.Tensor, int]]] = {}

    def take(self, nbytes: int, device: torch.device, *, pinned: bool = False) -> torch.Tensor:
        """A 1-D uint8 tensor of exactly ``nbytes`` bytes, a view into a pooled buffer."""
        key = (device, pinned)
        # gloo's worker thread drops its reference to a finished broadcast's tensor just
        # after wait() returns; for a large buffer a short wait beats a fresh allocation.
        retries = _LARGE_RETRIES if nbytes >= _LARGE else 0
        for attempt in range(retries + 1):
            with self._lock:
                entries = self._buffers.setdefault(key, [])
                best = -1
                busy_fit = False
                for i, (buf, idle) in enumerate(entries):
                    cap = buf.numel()
                    if nbytes <= cap <= 2 * max(nbytes, _MIN_CAPACITY) and (
                        best < 0 or cap < entries[best][0].numel()
                    ):
                        if _use_count(buf) == idle:
                            best = i
                        else:
                            busy_fit = True
                if best >= 0:
                    entry = entries.pop(best)
                    entries.append(entry)
                    return entry[0][:nbytes]
                if not busy_fit or attempt == retries:
                    return self._allocate(entries, nbytes, device, pinned)
            time.sleep(_RETRY_SLEEP)
        raise AssertionError("unreachable")

    def _allocate(
        self,
        entries: list[tuple[torch.Tensor, int]],
        nbytes: int,
        device: torch.device,
        pinned: bool,
    ) -> torch.Tensor:
        buf = torch.empty(_capacity(nbytes), dtype=torch.uint8, device=device, pin_memory=pinned)
        entries.append((buf, _use_count(buf)))
        if len(entries) > self._max_buffers:
            # Forget the least recently used idle buffer (a busy one stays with its user).
            for i, (old, idle) in enumerate(entries[:-1]):
                if _use_count(old) == idle:
                    del entries[i]
                    break
            else:
                del entries[0]
        return buf[:nbytes]

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()
