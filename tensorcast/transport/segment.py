"""One segment of a shared-memory arena, mapped in this process: its layout (NOTE
[ Shared-memory slots ] in ``transport/shm.py``), and what this process sees of it.

NOTE [ Private views of a slot ]
Every rank maps a segment twice: shared, for the head, the cells and the writes (the
source's payload, a relay leader's receive), and private (``MAP_PRIVATE``), for the views
it hands out. A page of the private mapping that nobody in the process wrote is the
segment's own page, so the views read what the writer wrote, with no copy; the first write
into a page (a caller's in-place ``x.mul_(2)``) gives this process its own copy of that
page, so no other rank, the source included, sees it. Before a slot's views are handed out
again, :meth:`MappedSegment.drop_written` drops the pages the process wrote among those it
handed out (``MADV_DONTNEED``: the next read maps the segment's page again), found in
``/proc/self/pagemap``; only where the release rule says nothing in the process sees the
slot, so no caller's write is dropped under it: a reader as it releases the slot (while
it waits for the next frame), the writer as it takes it. The cost is that look, about 1
ms for 60 MB (measured in ``docs/design.md``). Two limits: a process forked while it
holds a view shares the private mapping's unwritten pages with its child, which then
sees later frames there (the guide says so); and a process that locks its memory
(``mlockall``) has its private pages copied when they are mapped or locked, and they
cannot be dropped: its views go through the shared mapping then, with one warning
(:meth:`MappedSegment._share_views`; a reader's slot locked after it was mapped and
before it was first handed out is not seen).
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import warnings

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tensorcast._errors import HeaderError
from tensorcast.transport.pool import reusable

__all__ = ["HEAD", "LINE", "MAGIC", "PAGE", "SHM_DIR", "MappedSegment", "data_at"]

#: where segments live
SHM_DIR = "/dev/shm"
#: a segment's first bytes
MAGIC = b"TCSHM001"
#: its head: the magic, the data's offset, the capacity, the readers
HEAD = struct.Struct("<8sQQQ")
#: the bytes of the head, and of each reader's cells (no two writers share a line)
LINE = 64
PAGE = 4096


def data_at(readers: int) -> int:
    """Where a segment's data starts: after the head and the readers' cells, on a page."""
    return (LINE * (1 + readers) + PAGE - 1) // PAGE * PAGE


class MappedSegment:
    """One segment mapped in this process, twice (NOTE [ Private views of a slot ]): its
    cells and ``shared``, its data as a uint8 tensor to write into; and ``data``, the same
    bytes through the private mapping, whose storage every view handed out shares.
    ``base`` is how many references tensorcast itself holds to it (:meth:`idle`)."""

    __slots__ = (
        "address", "at", "base", "capacity", "cells", "data", "handed", "mm", "moved",
        "private", "readers", "refs", "shared",
    )  # fmt: skip

    def __init__(self, fd: int, size: int) -> None:
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        magic, at, capacity, readers = HEAD.unpack_from(self.mm, 0)
        if magic != MAGIC or at != data_at(readers) or at + capacity > size:
            raise HeaderError("a shared-memory segment that is not tensorcast's")
        self.at, self.capacity, self.readers = at, capacity, readers
        words = np.frombuffer(self.mm, dtype=np.uint64, count=at // 8)
        # each reader's cells: mapped, released (its own), and its pid (the writer's)
        self.cells = words[LINE // 8 :].reshape(-1, LINE // 8)[:readers, :3]
        self.shared = torch.frombuffer(self.mm, dtype=torch.uint8, count=capacity, offset=at)
        self.private: mmap.mmap | None = mmap.mmap(
            fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE
        )
        self.handed = 0  # the most bytes of ``data`` handed out since the last drop
        self.moved: list[StorageWeakRef] = []  # storages moved off the slot, while they live
        self._viewing()
        if _written(self.address, capacity, unread_all=False) is not None:  # mlockall: copied
            self._share_views()

    def idle(self) -> bool:
        """Whether nothing in this process sees the slot: no storage a caller moved off it
        lives (:meth:`_moved`), and the rule of any memory tensorcast hands out holds for
        ``data``'s storage (``pool.reusable``, NOTE [ Memory handed out ]). A slot is shared
        with the host's other ranks by design, but its storage is ``torch.frombuffer`` over
        the mapping, which never says ``is_shared()``: that clause sees only a
        ``share_memory_()`` of the caller's, which also moves the storage off the slot."""
        self._moved()
        if self.moved:
            self.moved = [gone for gone in self.moved if not gone.expired()]
            if self.moved:
                return False
        storage = self.data.untyped_storage()
        counted = sys.getrefcount(storage)  # read as _counted reads it
        return reusable(storage, self.address, self.base, self.refs, counted)

    def _counted(self) -> None:
        """Count what tensorcast itself holds of ``data``'s storage, as :meth:`idle` reads it."""
        storage = self.data.untyped_storage()
        self.base = _use_count(storage._cdata)
        self.refs = sys.getrefcount(storage)

    def view(self, nbytes: int) -> torch.Tensor:
        """The slot's first ``nbytes`` as this process's views read them: ``data``, made
        anew when it no longer views the mapping (NOTE [ Private views of a slot ])."""
        self._moved()
        self.handed = max(self.handed, nbytes)
        return self.data[:nbytes]

    def drop_written(self, nbytes: int = 0) -> None:
        """Make every page handed out, and the first ``nbytes`` about to be, the segment's
        own again: drop those this process wrote into (NOTE [ Private views of a slot ]).
        Only for a slot nothing in the process sees (:meth:`idle`)."""
        if self.private is None:  # views of the shared mapping: nothing to drop
            return
        written = _written(self.address, min(max(self.handed, nbytes), self.capacity))
        self.handed = 0
        if written is None:
            return
        page = mmap.PAGESIZE
        start = (self.at + written[0]) // page * page
        try:
            self.private.madvise(mmap.MADV_DONTNEED, start, self.at + written[1] - start)
        except OSError:  # EINVAL: its pages are locked (mlockall), copies that stay
            self._share_views()

    def _share_views(self) -> None:
        """Views through the shared mapping from now on: this process locks its memory
        (``mlockall``), so the kernel copied every page of the private mapping when it was
        mapped or locked, and keeps them. Said once a process."""
        if not _locked_warned:
            _locked_warned.append(True)
            warnings.warn(
                "tensorcast: this process locks its memory (mlockall), so a batch read from "
                "the shared-memory lane is the same memory on every rank of the host: a "
                "write into it in place is seen by all of them. Clone before writing in "
                "place, or pass shm=False",
                RuntimeWarning,
                stacklevel=2,
            )
        self.private = None
        self._viewing()

    def _viewing(self) -> None:
        """``data`` made anew over the mapping the views come from: the private one, or
        the shared one where this process locks its memory."""
        viewed = self.mm if self.private is None else self.private
        self.data = torch.frombuffer(viewed, dtype=torch.uint8, count=self.capacity, offset=self.at)
        self.address = self.data.data_ptr()
        self._counted()

    def _moved(self) -> bool:
        """Whether a caller's ``share_memory_()`` moved ``data``'s storage (and with it the
        views tensorcast handed out) off the mapping: then ``data`` is made anew over it.
        The moved storage is watched until it dies: a raw pointer made before the move (a
        numpy array, a numpy leaf of the same batch) still reads the slot's pages, and
        holds that storage through its base."""
        if self.data.data_ptr() == self.address:
            return False
        self.moved.append(StorageWeakRef(self.data.untyped_storage()))
        self._viewing()
        return True


def _written(address: int, nbytes: int, *, unread_all: bool = True) -> tuple[int, int] | None:
    """The span of the ``nbytes`` at ``address`` (a private mapping's) whose pages this
    process wrote into, as offsets from ``address``: from the first such page to the end
    of the last; None when it wrote into none. Read from ``/proc/self/pagemap`` (a page
    written is no longer the file's: bit 61 clear, present or swapped), which costs
    about a tenth of dropping every page and mapping them again; where it cannot be read,
    every page counts as written (none, with ``unread_all`` False)."""
    if nbytes <= 0:
        return None
    page = mmap.PAGESIZE
    first, end = address // page, (address + nbytes + page - 1) // page
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)  # this process's, after a fork too
        try:
            raw = os.pread(fd, 8 * (end - first), 8 * first)
        finally:
            os.close(fd)
    except OSError:
        raw = b""
    if len(raw) != 8 * (end - first):
        return (0, nbytes) if unread_all else None
    flags = np.frombuffer(raw, dtype=np.uint64) >> np.uint64(61)  # bits 63, 62, 61
    mine = np.flatnonzero((flags == 0b100) | (flags & np.uint64(0b010) != 0))
    if mine.size == 0:  # (present, not the file's) or swapped: pages this process wrote
        return None
    lo = (int(mine[0]) + first) * page - address
    hi = (int(mine[-1]) + first + 1) * page - address
    return max(lo, 0), min(hi, nbytes)


_use_count = torch._C._storage_Use_Count
_locked_warned: list[bool] = []  # whether this process said its memory is locked
