"""The shared-memory lane: a frame's payload written once per host, read in place.

Where every rank of a channel shares the source's host (``TENSORCAST_HOST_ID``, else the
boot id and host name: ``agreement.host_id``), the source writes a large payload into a
*slot* of its arena instead of the wire, and the frame's first message carries the slot's
:class:`Ref` in place of the payload (``Flags.SHM``, ``transport.frame``). The first
message still travels on the group's ordered lane, so order, agreement, errors, timeouts
and interrupts are the wire's. Receivers rebuild the batch as views of the slot: no copy.
Each rank's views are its own (NOTE [ Private views of a slot ]).
A channel spread over hosts has one arena per host (``transport.relay``).

The arena is the source's :class:`Writer`; each receiver holds a :class:`Reader`. A slot
is one file in ``/dev/shm`` (mode 0600, ``os.open`` + ``mmap``: no resource tracker),
named by the channel's token (made by the source, told at the setup agreement) and a
number that is never reused. A segment is unlinked as soon as every reader mapped it, by
whichever of the writer and the last reader sees that first (a writer that ends before a
live reader mapped it leaves it to that reader: NOTE [ An arena that ends before its
readers read ]), so a killed process leaves nothing behind; what a kill leaves before
that, the survivors sweep by the token (:meth:`Writer.close`, :meth:`Reader.sweep`) when
the lane breaks. What no survivor sweeps (every rank of the host killed at once, by
SIGKILL or a SIGTERM Python does not catch, or survivors that ended on another error
first) is swept by whichever process of the same PID namespace next makes an arena or
ends with one: a token names its writer's namespace and pid, and a segment whose writer
is dead, and that no live reader awaits, is no one's (:func:`sweep_dead`).

# NOTE [ Shared-memory slots ]
A segment's layout (little-endian; one 64-byte line per reader, so that no two writers
of the cells share a cache line)::

    [0, 64)                magic b"TCSHM001", data offset u64, capacity u64, readers u64
    [64 (1 + i), +64)      reader i's cells: mapped u64, released u64 (a generation),
                           and its pid u64 (0: unknown), written by the writer
    [data offset, +cap)    the payload, at most ``capacity`` bytes

Each of the first two cells is written by its reader only and read by the writer only;
the writer writes the head, the pids and the data, the readers only read those. A slot's
life, ``g`` the generation of its last write (the writer's count, carried by the frame's
:class:`Ref`):

    ======================  =====================  ======================================
    state                   cells                  what happens next
    ======================  =====================  ======================================
    created, not mapped     mapped 0, released 0   a reader maps it on its first Ref:
                                                   mapped 1 (the last one unlinks it)
    written, in use         some released < g      the writer does not touch it: another
                                                   slot, a new one within the cap, or
                                                   the wire for this payload
    released                every released = g,    the writer may write generation g + 1
                            and the writer's own   (or replace it with a larger segment)
                            tree let go of it
    ======================  =====================  ======================================

A reader releases a slot (stores ``g`` in its cell) at its next frame once nothing in
its process can see the slot: :meth:`MappedSegment.idle`. Nothing ever waits on a cell: the writer
reads them when it looks for a slot and never blocks (none free: a new slot, or the
wire); readers only write them. So no wait here needs a bound of its own, and a killed
peer is found by the wire as before (``PeerError`` within the timeout).

Memory ordering. Data before header: the writer's stores into the slot precede, in its
program order, the first message's send on the lane, which goes through gloo's work
queue (a mutex) and the socket's syscalls; the receiver's loads of the slot follow its
receive of that message. The mutexes and the socket's kernel locks give a happens-before
edge on x86 and on ARM alike, so a reader that has the Ref sees the bytes written before
it was sent. Release after reads: a reader's loads of a slot happen in earlier frames, and
before it stores ``g`` it takes and releases a lock twice (:func:`_fence`): the release
orders its earlier loads before it, the next acquire of the same lock orders the cell's
store after it, a full barrier on ARM (where a load followed by a store to another
address may otherwise be reordered) and free on x86 (TSO never reorders a store before an
earlier load). The 8-byte aligned cell stores and loads are single instructions on both.
The writer stores into a slot only after loading every cell as ``g``: a control
dependency, which orders a load before later stores on ARM too (stores are not
speculated). A :class:`Ref` is read once, from the first message, and every check of it
uses that one copy (no index read outside its retry loop).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import struct
import threading
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tensorcast._errors import HeaderError
from tensorcast.transport import sweep as _sweep
from tensorcast.transport.segment import HEAD, LINE, MAGIC, PAGE, SHM_DIR, MappedSegment, data_at
from tensorcast.transport.sweep import new_token, sweep_dead

__all__ = [
    "FIX",
    "MIN_PAYLOAD",
    "NO_FREE_SPACE",
    "REF_SIZE",
    "SHM_DIR",
    "Reader",
    "Ref",
    "Taken",
    "Writer",
    "available",
    "limit",
    "no_room",
    "new_token",
    "sweep_dead",
    "warn_wire",
]

#: payloads smaller than this travel on the wire (they mostly ride in the first message)
MIN_PAYLOAD = 256 << 10
#: how many slots one arena holds at most
MAX_SLOTS = 6
_DEFAULT_SHARE = 4  # with no limit set, an arena takes at most 1/4 of /dev/shm's free space
#: what to change where a payload cannot use the lane for want of room
FIX = (
    "give the container more shared memory (docker run --shm-size=2g, or a memory-backed "
    "emptyDir on /dev/shm in Kubernetes), or set TENSORCAST_SHM_LIMIT (bytes; 0 turns the "
    "lane off and silences this)"
)


@dataclass(frozen=True, slots=True)
class Ref:
    """Where a frame's payload lies: slot ``slot`` of the arena, backed by segment number
    ``segment``, written for the ``generation``-th time. Travels in the first message
    (``REF_SIZE`` bytes, ``docs/format.md``)."""

    slot: int
    segment: int
    generation: int

    _STRUCT = struct.Struct("<IIQ")

    def pack_into(self, buffer: memoryview, at: int) -> None:
        Ref._STRUCT.pack_into(buffer, at, self.slot, self.segment, self.generation)

    @classmethod
    def unpack(cls, buffer: memoryview, at: int) -> Ref:
        slot, segment, generation = cls._STRUCT.unpack_from(buffer, at)
        if slot >= MAX_SLOTS or generation == 0:
            raise HeaderError(f"invalid shared-memory slot {slot} (generation {generation})")
        return cls(slot, segment, generation)


REF_SIZE = Ref._STRUCT.size


def _first_arena() -> None:
    """Once a process, as it makes its first arena: sweep what dead writers left, now and
    as it ends."""
    if not _swept:
        _swept.append(True)
        sweep_dead()
        atexit.register(sweep_dead)


_swept: list[bool] = []
_wire_warned: list[bool] = []  # whether this process said a payload went on the wire


def limit() -> int:
    """The bytes one arena may take: ``TENSORCAST_SHM_LIMIT``, else a share of the free
    space in ``/dev/shm``; 0 when there is none (or the lane is turned off)."""
    text = os.environ.get("TENSORCAST_SHM_LIMIT")
    if text is not None and text.strip():
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(
                f"TENSORCAST_SHM_LIMIT must be a number of bytes (0 turns the lane off), got "
                f"{text!r}"
            )
        return value
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize // _DEFAULT_SHARE


def warn_wire(what: str, stacklevel: int = 5) -> None:
    """Say once per process why a payload goes on the wire (its first arena to fall back,
    or its first setup without room, says so; the others' reasons are alike: the same cap,
    the same ``/dev/shm``)."""
    if not _wire_warned:
        _wire_warned.append(True)
        warnings.warn(f"tensorcast: {what}", RuntimeWarning, stacklevel=stacklevel)


#: why a source has no arena where no limit is set and ``/dev/shm`` is full
NO_FREE_SPACE = f"no free space in {SHM_DIR}"


def no_room() -> str:
    """Why a source whose :func:`limit` is 0 cannot write an arena."""
    text = (os.environ.get("TENSORCAST_SHM_LIMIT") or "").strip()
    return f"TENSORCAST_SHM_LIMIT={text} turns it off" if text else NO_FREE_SPACE


def _leaves_half_free(grow: int) -> bool:
    """Whether ``/dev/shm`` keeps half of its space free once an arena takes ``grow`` more
    bytes, where no ``TENSORCAST_SHM_LIMIT`` is set: each arena's default cap is a share of
    the space free when it was made, and several sources on a host (one per DP slot) would
    otherwise fill it between them, leaving a DataLoader's workers and NCCL, which share
    it, none. A limit set explicitly is the user's call."""
    if grow <= 0 or os.environ.get("TENSORCAST_SHM_LIMIT", "").strip():
        return True
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return True  # the segment's own allocation says whether there is room
    return (st.f_bavail * st.f_frsize - grow) * 2 >= st.f_blocks * st.f_frsize


def available() -> str | None:
    """Why this process cannot use the lane, or None when it can."""
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK | os.X_OK):
        return f"{SHM_DIR} does not exist or is not writable here"
    if os.environ.get("TENSORCAST_SHM_LIMIT", "").strip() == "0":
        return "TENSORCAST_SHM_LIMIT=0 turns it off"
    return None


def _fence(lock: threading.Lock) -> None:
    """A full barrier between a reader's earlier loads and its next store (see
    NOTE [ Shared-memory slots ])."""
    with lock:
        pass
    with lock:
        pass


def _capacity(nbytes: int) -> int:
    """Round up to a page, then to 2**k or 1.5 * 2**k (few sizes, a third wasted at most)."""
    p = 1 << max(nbytes - 1, PAGE).bit_length()
    return p * 3 // 4 if nbytes <= p * 3 // 4 else p


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@dataclass(frozen=True, slots=True)
class Taken:
    """A slot taken for one payload (:meth:`Writer.take`).

    Attributes:
        ref: the write's :class:`Ref`, for the frame's first message.
        into: the slot's bytes to write the payload into, as the readers map them.
        seen: the same bytes as this process's own tree views them (NOTE [ Private views
            of a slot ]): read what ``into`` holds, and a write into them stays here.
    """

    ref: Ref
    into: torch.Tensor
    seen: torch.Tensor


class _Slot:
    __slots__ = ("generation", "mapping", "path", "segment", "unlinked")

    def __init__(self, path: str, segment: int, mapping: MappedSegment) -> None:
        self.path, self.segment, self.mapping = path, segment, mapping
        self.generation = 0
        self.unlinked = False


class Writer:
    """A source's arena for one channel: up to :data:`MAX_SLOTS` slots, within ``cap`` bytes
    for every arena this process writes together.

    Used by the channel's lane jobs one after another: no lock.

    Args:
        token: the segments' common prefix (:func:`new_token`).
        readers: the receivers on this host, each with its index in ``[0, readers)``.
        cap: the bytes this process's arenas may take together (:func:`limit`).
        reader_tokens: the readers' own tokens, in their order: a reader still alive that
            has not mapped a slot keeps it when the arena goes (NOTE [ An arena that ends
            before its readers read ]); none given, the arena unlinks everything.
    """

    def __init__(
        self, token: str, readers: int, cap: int, reader_tokens: Sequence[str] = ()
    ) -> None:
        self.token = token
        self.readers = readers
        self.cap = cap
        self._slots: list[_Slot | None] = [None] * MAX_SLOTS
        self._segments = 0
        #: whether the last payload offered went into a slot (the encoder trims otherwise)
        self.last_used = False
        #: each reader's pid, written into every segment (NOTE [ An arena that ends
        #: before its readers read ]); 0 where unknown
        self._pids = [_sweep.pid_of(token) or 0 for token in reader_tokens]
        self._cleanup = weakref.finalize(self, _unlink_all, self._slots, os.getpid())
        with _writers_lock:
            _writers.add(self)
            _first_arena()

    @property
    def nbytes(self) -> int:
        """The bytes the arena's segments take."""
        return sum(s.mapping.mm.size() for s in self._slots if s is not None)

    def take(self, nbytes: int) -> Taken | None:
        """A slot to write ``nbytes`` into (:class:`Taken`: the :class:`Ref` of that write,
        the bytes to write, the bytes this process's tree views); None when the payload
        goes on the wire (no slot free and no room). The write counts once :meth:`sent`
        says its frame went out: a frame that failed to write leaves the slot free."""
        self._unlink_mapped()
        best = self._free_fitting(nbytes)
        if best is None:
            best = self._grow(self._spare(nbytes), nbytes)
        self.last_used = best is not None
        if best is None:
            return None
        slot = self._slots[best]
        assert slot is not None
        mapping = slot.mapping
        ref = Ref(best, slot.segment, slot.generation + 1)
        mapping.drop_written(nbytes)
        return Taken(ref, mapping.shared[:nbytes], mapping.view(nbytes))

    def sent(self, ref: Ref) -> None:
        """The frame of ``ref`` goes out now: its readers release that generation."""
        slot = self._slots[ref.slot]
        assert slot is not None and slot.segment == ref.segment
        slot.generation = ref.generation

    def _free_fitting(self, nbytes: int) -> int | None:
        """The free slot of the least capacity that holds ``nbytes``: the slots that hold
        it are checked from the smallest up and the first free one is taken, so a frame
        whose slot came back asks the reuse rule once, not once a slot."""
        fitting = sorted(
            (s.mapping.capacity, i, s)
            for i, s in enumerate(self._slots)
            if s is not None and s.mapping.capacity >= nbytes
        )  # (capacity, index) never ties: a slot is never compared
        return next((i for _, i, slot in fitting if self._free(slot)), None)

    def _spare(self, nbytes: int) -> int | None:
        """Where a new segment for ``nbytes`` goes, when no slot that holds it is free: the
        first empty slot; but where a free slot too small for it comes before that, the
        last such slot (replaced by a larger one); None when there is neither."""
        spare: int | None = None
        for i, slot in enumerate(self._slots):
            if slot is None:
                spare = i if spare is None else spare
            elif (
                slot.mapping.capacity < nbytes
                and (spare is None or self._slots[spare] is not None)
                and self._free(slot)
            ):
                spare = i
        return spare

    def _free(self, slot: _Slot) -> bool:
        cells = slot.mapping.cells
        g = slot.generation
        return bool((cells[:, 1] == g).all()) and slot.mapping.idle()

    def _grow(self, at: int | None, nbytes: int) -> int | None:
        if at is None:  # every slot exists and is busy
            self._warn(
                f"all {MAX_SLOTS} slots of a shared-memory arena hold batches still referenced "
                f"(on this rank, or not yet let go of by a reader of the host), so a "
                f"{nbytes}-byte payload travels over the wire: let go of batches you no "
                f"longer need, and clone those you keep for long"
            )
            return None
        capacity = _capacity(nbytes)
        size = data_at(self.readers) + capacity
        old = self._slots[at]
        freed = old.mapping.mm.size() if old is not None else 0  # the slot it replaces
        # the cap is the process's: every arena it writes counts
        with _writers_lock:  # a writer made on another thread changes the set
            taken = sum(w.nbytes for w in list(_writers))
        room = self.cap - taken + freed
        if size > room:
            if size > self.cap:
                self._warn(
                    f"a {nbytes}-byte payload does not fit in the shared-memory arena's cap "
                    f"of {self.cap} bytes, so it travels over the wire: {FIX}"
                )
            else:
                self._warn(
                    f"this process's shared-memory arenas hold {taken} bytes of their cap of "
                    f"{self.cap} (batches still referenced, or other loaders' arenas), so a "
                    f"{nbytes}-byte payload travels over the wire: let go of batches you no "
                    f"longer need, or {FIX}"
                )
            return None
        if not _leaves_half_free(size - freed):
            self._warn(
                f"a new {size}-byte segment would leave less than half of {SHM_DIR} free for "
                f"its other users (DataLoader workers, NCCL), so payloads travel over the "
                f"wire: {FIX}"
            )
            return None
        try:
            slot = self._create(capacity, size)
        except OSError as e:
            self._warn(
                f"no room for a {size}-byte segment in {SHM_DIR} ({e}), so payloads travel "
                f"over the wire: {FIX}"
            )
            return None
        if old is not None:
            self._retire(old)
        self._slots[at] = slot
        return at

    @staticmethod
    def _warn(what: str) -> None:
        warn_wire(what, stacklevel=6)

    def _create(self, capacity: int, size: int) -> _Slot:
        self._segments += 1
        path = f"{SHM_DIR}/{self.token}-{self._segments}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on a later write
            head = HEAD.pack(MAGIC, data_at(self.readers), capacity, self.readers)
            os.pwrite(fd, head, 0)
            for i, pid in enumerate(self._pids):
                os.pwrite(fd, pid.to_bytes(8, "little"), LINE * (1 + i) + _sweep.PID_AT)
            mapping = MappedSegment(fd, size)
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        slot = _Slot(path, self._segments, mapping)
        if self.readers == 0:
            _unlink(path)
            slot.unlinked = True
        return slot

    @staticmethod
    def _retire(slot: _Slot) -> None:
        if not slot.unlinked:
            _unlink(slot.path)
            slot.unlinked = True

    def _unlink_mapped(self) -> None:
        for slot in self._slots:
            if slot is not None and not slot.unlinked and bool(slot.mapping.cells[:, 0].all()):
                _unlink(slot.path)
                slot.unlinked = True

    def close(self) -> None:
        """Unlink every segment not unlinked yet (the lane broke, or the channel goes)."""
        for slot in self._slots:
            if slot is not None:
                self._retire(slot)


#: every arena this process writes (their bytes count against one cap)
_writers: weakref.WeakSet[Writer] = weakref.WeakSet()
_writers_lock = threading.Lock()


def _unlink_all(slots: list[_Slot | None], pid: int) -> None:
    """An arena let go of, or its process ending: unlink its segments, but for one whose
    last payload went out and that a reader still alive has not mapped yet (NOTE [ An
    arena that ends before its readers read ])."""
    if os.getpid() != pid:  # a forked child (a DataLoader worker) leaves its parent's alone
        return
    for slot in slots:
        if slot is None or slot.unlinked:
            continue
        if not (slot.generation and _sweep.awaited(slot.mapping.cells)):
            _unlink(slot.path)


class Reader:
    """A receiver's view of its source's arena: maps segments as Refs name them and
    releases slots once nothing in this process sees them (NOTE [ Shared-memory slots ]).

    Args:
        token: the source's :attr:`Writer.token`.
        index: this receiver's index among the host's readers (its cells).
    """

    def __init__(self, token: str, index: int) -> None:
        self.token = token
        self.index = index
        self._mapped: list[tuple[int, MappedSegment] | None] = [None] * MAX_SLOTS
        self._held: dict[int, int] = {}  # slot -> the generation this rank has not released
        self._lock = threading.Lock()
        with _writers_lock:
            _first_arena()

    def payload(self, ref: Ref, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` of the slot ``ref`` names, mapping its segment on first sight.

        Raises:
            HeaderError: the Ref names bytes the segment does not hold.
            OSError: the segment is gone (its writer died).
        """
        entry = self._mapped[ref.slot]
        if entry is None or entry[0] != ref.segment:
            entry = (ref.segment, self._map(ref.segment))
            self._mapped[ref.slot] = entry
        mapping = entry[1]
        if nbytes > mapping.capacity or self.index >= mapping.readers:
            raise HeaderError(
                f"a {nbytes}-byte payload in a shared-memory slot of {mapping.capacity} bytes "
                f"for {mapping.readers} readers (this is reader {self.index})"
            )
        self._held[ref.slot] = ref.generation
        return mapping.view(nbytes)

    def _map(self, segment: int) -> MappedSegment:
        path = f"{SHM_DIR}/{self.token}-{segment}"
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = MappedSegment(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if self.index >= mapping.readers:
            raise HeaderError(
                f"a shared-memory segment for {mapping.readers} readers (this is reader "
                f"{self.index}): not this channel's"
            )
        mapping.cells[self.index, 0] = 1
        if bool(mapping.cells[:, 0].all()):  # the last reader to map it: nobody needs the name
            _unlink(path)
        return mapping

    def release(self) -> None:
        """Tell the writer of each slot this rank held and no longer sees
        (:meth:`MappedSegment.idle`)."""
        if not self._held:
            return
        done = []
        for slot, generation in self._held.items():
            entry = self._mapped[slot]
            if entry is None:
                done.append(slot)
                continue
            mapping = entry[1]
            if mapping.idle():
                mapping.drop_written()  # here, while this rank waits for the next frame
                _fence(self._lock)
                mapping.cells[self.index, 1] = generation
                done.append(slot)
        for slot in done:
            del self._held[slot]

    def sweep(self) -> None:
        """Unlink what the writer left in ``/dev/shm`` (the lane broke: it may be dead)."""
        for path in glob.glob(f"{SHM_DIR}/{glob.escape(self.token)}-*"):
            _unlink(path)
