"""Moving a packed batch from one source rank to its peers: frames and their messages.

Each step is one *frame*, usually one or two messages from the source to every receiver:

1. the *first message*, of a fixed capacity that every rank knows in advance (it starts
   at 4 KiB and the source announces any growth in the previous frame)::

       frame prefix (52 bytes) | setup description | header | zeros | inline payload

   A batch whose header and buffer fit travels in this one message. The inline payload
   ends the message (at ``_inline_at``), 64-byte aligned: where it starts does not depend
   on the header's length, so batches of one structure put their leaves at the same place
   whatever their small values. On gloo groups of up to ``HEADER_SENDS_MAX_RANKS``
   ranks the source sends it to each receiver itself (``send`` / ``recv``):
   ProcessGroupGloo runs those on the calling thread, where a broadcast waits for a
   worker thread on every rank.
2. the *payload*, only when it did not fit inline: exactly ``payload_len`` bytes, a
   broadcast received into a pooled buffer on the transfer device.

A tensor leaf of at least ``DIRECT_MIN`` bytes is not copied into the source's buffer:
it travels from its own memory as a broadcast of its own, straight into its place in the
receivers' buffer (the frame's ``direct_min`` says which leaves, so both sides cut the
payload into the same pieces). The bytes between such leaves go inline in the first
message when they fit, else as broadcasts of their own. A batch of one large tensor and
some small values is thus two messages with no packing copy on the source.

Once the payload's layout repeats (its length, and how it is cut into pieces), the source
*promises* that the next frame's pieces follow its first message at once, with the same
layout, and receivers post their receive with the first message's: the payload lands
without waiting for the first message to be read (gloo sends a message only once its
receive is posted). A frame that keeps the promise says so (``_POSTED``); one that cannot
(a new layout, an END or ERROR frame) sends zeros in those pieces, which receivers drop
before they read the frame as usual. So a stream whose layout never repeats (lhotse
batches of varying length) is never promised anything, and one that changes now and then
pays one extra transfer per change. Promises are made on a CPU transfer device (gloo)
only, and a loader's new pass starts with none.

A header too large for the current capacity spills into a header-only second message
(the capacity then grows so later steps do not spill). END and ERROR frames are
first-message only (but for the zeros of a promise). Receivers validate the prefix and
the header before allocating anything from their sizes.

The prefix carries a pass number, a step number and a fingerprint of the sender's setup
(header format and frame versions, source, group ranks, axes): a receiver that disagrees
raises ``DesyncError`` instead of mis-assigning batches.

With NCCL the first message travels on a gloo group over the same ranks (no host-device
sync on receivers) and the payload on NCCL, on the current CUDA device.

Ranks named ``src`` here are global ranks, as in ``torch.distributed.broadcast``.
"""

from __future__ import annotations

import datetime
import hashlib
import struct
import threading
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from tensorcast import _codec, _schema
from tensorcast._codec import Packed
from tensorcast._errors import DesyncError, HeaderError, PeerError, SourceError, TensorcastError
from tensorcast._pool import BufferPool

__all__ = ["Channel", "Frame", "channel_for_group"]

FRAME_DATA, FRAME_END, FRAME_ERROR = 1, 2, 3
_KINDS = {FRAME_DATA: "data", FRAME_END: "end", FRAME_ERROR: "error"}
_INLINE, _CRC, _SPILL, _DIRECT = 1, 2, 4, 8
# _NEXT: the next frame's payload pieces follow its first message at once, in this
# frame's layout; _POSTED: this frame's payload is in those pieces (see the docstring).
_NEXT, _POSTED = 16, 32

# magic, kind, flags, desc_len, pass, step, fingerprint, header_len, payload_len,
# next_capacity, crc32, direct_min
_PREFIX = struct.Struct("<4sBBHIQQIQIII")
_HEADER_LEN_AT = 28  # where the header's length is in the prefix
_MAGIC = b"TCFR"
#: The tag of header messages, which travel point to point on gloo (see Channel._broadcasts).
_HEADER_TAG = 0x7C5A
#: The largest group whose header messages the source sends each receiver itself: it
#: sends them one after another, measured faster than gloo's broadcast up to 4 ranks.
HEADER_SENDS_MAX_RANKS = 4
#: How frames follow one another (part of every rank's setup fingerprint): 2 added the
#: payloads promised a frame ahead, 3 sends header messages point to point on gloo.
FRAMES_VERSION = 3
INITIAL_CAPACITY = 4096
MAX_CAPACITY = 256 << 10  # larger payloads always take a second message
_PAYLOAD_ALIGN = 64
_MAX_DESC = 1024
_MAX_ERROR = 64 << 10
_CPU = torch.device("cpu")
#: Tensor leaves of at least this many bytes travel from their own memory, as their own
#: broadcast: copying 2 MiB costs more than the extra collective.
DIRECT_MIN = 2 << 20
_DIRECT_FLOOR = 64 << 10  # a frame asking for smaller direct leaves is not ours


def header_sends(gloo: bool, ranks: int, debug_level: Any) -> bool:
    """Whether header messages go as sends from the source to each receiver (see
    ``Channel._broadcasts``), not as broadcasts: on a gloo header group of a few ranks,
    unless ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks every collective's sequence number
    across ranks (the source's sends count one per receiver, a receiver's one in all)."""
    return gloo and ranks <= HEADER_SENDS_MAX_RANKS and debug_level != dist.DebugLevel.DETAIL


class _Stage(NamedTuple):
    """Tensors posted together, from the source to every receiver."""

    tensors: list[torch.Tensor]
    what: str  # names the stage in errors
    header: bool  # on the header group (see Channel._broadcasts), else the batch's group


def _segments(table: list[Any], nbytes: int, direct_min: int) -> list[tuple[int, int, int]]:
    """The payload cut into ``(start, end, leaf)`` pieces that cover it in order.

    ``leaf`` is the index of a tensor leaf of at least ``direct_min`` bytes (it is a piece
    of its own), or -1 for the bytes between such leaves. ``table`` rows are the header's
    ``(kind, code, shape, offset, nbytes)``, validated: in order and not overlapping.
    """
    out: list[tuple[int, int, int]] = []
    at = 0
    for i, (kind, _code, _shape, off, n) in enumerate(table):
        if kind == "tensor" and n >= direct_min:
            if off > at:
                out.append((at, off, -1))
            out.append((off, off + n, i))
            at = off + n
    if at < nbytes:
        out.append((at, nbytes, -1))
    return out


class _PayloadLayout(NamedTuple):
    """What a promise names (see :func:`_payload_layout`); compared as a tuple."""

    payload_len: int
    flags: int  # only _INLINE and _DIRECT
    direct_min: int
    segments: list[tuple[int, int, int]] | None


def _payload_layout(
    payload_len: int, flags: int, direct_min: int, segments: list[tuple[int, int, int]] | None
) -> _PayloadLayout | None:
    """What a promise names: how a payload that follows the first message is laid out and
    cut into pieces. None when nothing follows the first message."""
    if not payload_len or (flags & _INLINE and segments is None):
        return None
    return _PayloadLayout(payload_len, flags & (_INLINE | _DIRECT), direct_min, segments)


def _piece_sizes(layout: _PayloadLayout) -> list[int]:
    """The sizes of the pieces that follow the first message, in order."""
    payload_len, flags, _, segments = layout
    if segments is None:
        return [payload_len]
    return [b - a for a, b, i in segments if i >= 0 or not flags & _INLINE]


def _align_up(n: int, a: int = _PAYLOAD_ALIGN) -> int:
    return (n + a - 1) // a * a


def _inline_len(payload_len: int, segments: list[tuple[int, int, int]] | None) -> int:
    """The payload bytes that go in the first message when they fit: all of them, or
    those between the leaves that travel from their own memory (see :func:`_segments`)."""
    return payload_len if segments is None else sum(b - a for a, b, i in segments if i < 0)


def _inline_at(capacity: int, inline_len: int) -> int:
    """Where an inline payload of ``inline_len`` bytes starts in a first message."""
    return capacity - _align_up(inline_len)


def _payload_at(
    capacity: int, payload_len: int, flags: int, segments: list[tuple[int, int, int]] | None
) -> int:
    """Where a received frame's inline payload starts in its first message."""
    return _inline_at(capacity, _inline_len(payload_len, segments) if flags & _INLINE else 0)


# Where a payload that follows the first message lands (see Channel._landing): its buffer,
# the pieces received into it, and the (destination, source) copies of its inline bytes.
_Landing = tuple[torch.Tensor, list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


@dataclass(slots=True)
class Frame:
    """A frame ready to go: prefix fields, header, and where the payload comes from."""

    kind: int
    header: bytes
    payload_len: int
    plan: _codec.PackPlan | None = None
    packed: torch.Tensor | None = None  # a pre-packed buffer
    # the typed views the plan was written into, when it was written into the payload
    tensor_views: list[torch.Tensor] | None = None
    decoded: _schema.Decoded | None = None  # a pre-packed batch's validated header
    # the leaves that travel from their own memory: where their bytes belong in the
    # payload, and the copies into the source's buffer made while they are on the wire
    direct_ranges: list[tuple[int, int, torch.Tensor]] | None = None
    later: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    in_first: bool = False  # the payload went inline, in the source's own first message


class _Ahead(NamedTuple):
    """A tree built before its frame arrived, on the assumption that the header repeats;
    its leaves serve any header of the same structure."""

    header: bytes
    at: int  # where the inline payload starts in the first message
    tree: Any
    head: bytes  # the prefix, description and header the frame must start with
    structure: _schema.Structure
    leaves: list[Any]  # the buffer leaves' views in ``buffer``
    flags: int
    direct_min: int
    buffer: torch.Tensor  # the first message, or the payload's own buffer
    # for a payload that follows the first message: the pieces to receive into ``buffer``
    # and the inline bytes to copy there (see Channel._landing); None when all is inline,
    # [] when the pieces were posted with the first message (promised)
    pieces: list[torch.Tensor] | None
    copies: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class _Prepared:
    """A frame whose messages are written and ready for the collectives."""

    frame: Frame
    first: torch.Tensor
    payload: torch.Tensor | None
    flags: int
    next_capacity: int
    # what follows the first message on the group, in order (None: nothing)
    pieces: list[torch.Tensor] | None = None
    layout: _PayloadLayout | None = None  # how they are laid out
    # zeros in the pieces promised by the last frame, when this one cannot use them
    void: list[torch.Tensor] | None = None


def _crc(buffer: torch.Tensor, start: int = 0) -> int:
    return zlib.crc32(buffer.cpu().numpy().data, start) if buffer.numel() else start


def _crc_of_direct(buffer: torch.Tensor, frame: Frame) -> int:
    """The CRC32 of the payload as receivers will hold it: ``buffer`` with the direct
    leaves' bytes in their places."""
    crc = at = 0
    for a, b, piece in frame.direct_ranges or ():
        crc = _crc(piece, _crc(buffer[at:a], crc))
        at = b
    return _crc(buffer[at : frame.payload_len], crc)


def _segments_of(decoded: _schema.Decoded, direct_min: int) -> list[tuple[int, int, int]]:
    """:func:`_segments` of a received header, computed once per structure."""
    structure = decoded.structure
    cached = structure.segments
    if cached is None or cached[0] != direct_min:
        cached = structure.segments = (
            direct_min,
            _segments(decoded.leaves, decoded.nbytes, direct_min),
        )
    return cached[1]


class Channel:
    """One source and its peers on one process group.

    Args:
        group: the process group the batch travels on.
        src: the source's *global* rank.
        axes: the mesh axes the group spans (for the setup fingerprint only).
        timeout: how long any rank waits for one message; None means the group's.
        verify: carry a CRC32 of the buffer and check it on receivers.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        src: int,
        *,
        axes: tuple[str, ...] = (),
        timeout: float | datetime.timedelta | None = None,
        verify: bool = False,
    ):
        # Weakly held: a channel cached for a group must not keep it (and the pooled
        # buffers) alive once the caller and torch have let it go.
        self._group = weakref.ref(group)
        self.ranks = tuple(dist.get_process_group_ranks(group))
        if src not in self.ranks:
            raise ValueError(
                f"src={src} is not a rank of the group (global ranks {list(self.ranks)}); "
                f"src is a global rank, as in torch.distributed.broadcast"
            )
        self.src = src
        self.rank = dist.get_rank()
        self.is_source = self.rank == src
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend:
            self.transfer_device = torch.device("cuda", torch.cuda.current_device())
            # Headers on a CPU group over the same ranks: no host-device sync on receivers.
            self._own_header_group = (
                None
                if "gloo" in backend
                else dist.new_group(
                    list(self.ranks), backend="gloo", use_local_synchronization=True
                )
            )
        else:
            self.transfer_device = torch.device("cpu")
            self._own_header_group = None
        self.inline_ok = self.transfer_device.type == "cpu"
        self._header_p2p = header_sends(
            self._own_header_group is not None or "gloo" in backend,
            len(self.ranks),
            dist.get_debug_level(),
        )
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        self.timeout = timeout
        self.verify = verify
        self.description = (
            f"tensorcast format v{_schema.FORMAT_VERSION}, frames v{FRAMES_VERSION}; "
            f"src={src}; group ranks={list(self.ranks)}; axes={list(axes)}"
        ).encode()[:_MAX_DESC]
        self.fingerprint = int.from_bytes(
            hashlib.blake2b(self.description, digest_size=8).digest(), "little"
        )
        self.pool = BufferPool()  # payloads
        self.frames = BufferPool()  # first messages: few sizes, kept apart so takes are quick
        # The source's first message: its own, never handed out (its rebuilt tree views a
        # copy), so the views an inline payload is written through can be kept too.
        self._out_first: torch.Tensor | None = None
        # The first message's bytes in use: the head's end, the inline payload's start and end.
        self._out_span = (0, 0, 0)
        self._out_host: np.ndarray = np.empty(0, np.uint8)  # a numpy view of _out_first
        self._out_bytes = self._out_host.data  # and its bytes, for plain copies
        self._out_slice: tuple[Any, ...] = ()  # (first, start, length, slice)
        self._inline_views: tuple[Any, ...] = ()  # (layout, first, payload_at, views)
        # A receiver's last data header, how it travelled (flags, direct_min), and how many
        # times in a row its structure repeated.
        self._last: tuple[bytes, _schema.Decoded, int, int] | None = None
        self._repeats = 0
        # What a receive left behind (the last header, the first message's tensor and
        # memoryview): freed at the start of the next receive, before it takes a buffer,
        # not on the way out of this one, right after a wait. No tensor handed out is here.
        self._dropped: list[Any] = []
        # The payload layout the last frame promised for the next one (see the module
        # docstring), on every rank; and on the source, the last data frame's layout.
        self._promise: _PayloadLayout | None = None
        self._sent: _PayloadLayout | None = None
        self.pass_index = 0
        self.step = 0
        self.capacity = INITIAL_CAPACITY
        self.broken: BaseException | None = None
        self._routes: dict[int, tuple[Any, list[int]]] = {}
        self._last_layout: _codec.Layout | None = None

    # -- state ---------------------------------------------------------------------

    def start_pass(self, pass_index: int) -> None:
        """Reset the per-pass counters; every rank calls this at the same point."""
        self.pass_index = pass_index
        self.step = 0
        self.capacity = INITIAL_CAPACITY
        self._promise = self._sent = None

    def _where(self) -> str:
        return f"rank {self.rank} (pass {self.pass_index}, step {self.step})"

    # -- collectives ---------------------------------------------------------------

    def _broadcasts(
        self,
        stages: list[_Stage],
        meanwhile: Callable[[], None] | None = None,
        arrived: Callable[[], None] | None = None,
    ) -> None:
        """Broadcast each stage's tensors, in order: all are posted, then all are waited
        for. A stage's ``what`` names it in errors.

        Header stages travel on the header group, as one send to each receiver where
        that group is gloo's and small (see :func:`header_sends`): ProcessGroupGloo posts
        a send or a receive on the calling thread, but queues a broadcast for a worker
        thread on every rank, and that hop costs a small message about a third of its
        time. Payloads are broadcasts, on the batch's group: gloo forwards them along a
        tree, so the source does not send every receiver its own copy.

        ``meanwhile`` runs while the broadcasts are in flight (gloo and NCCL run them
        outside the GIL): the source builds its own copy of the batch then, a receiver
        the tree of a payload it recognised. What it raises is raised as it is, once the
        broadcasts are done, so the group stays in step; a failed broadcast is a
        ``PeerError``.

        ``arrived`` runs once the first stage has arrived, before the others are waited
        for; what it raises is raised at once, and the others are left in flight. A
        receiver checks there that the first message is the one it expects: one out of
        step must say so, not wait for pieces its source will never send.
        """
        self._raise_if_broken()
        first = 0  # how many works the first stage posted
        works: list[tuple[Any, str]] = []
        what = stages[0].what
        try:
            # The group's own operations with cached options and ranks: dist.broadcast
            # re-derives them on every call, which shows up on small batches.
            for k, (tensors, what, header) in enumerate(stages):
                group = self.header_group if header else self.group
                opts, peers = self._route(group)
                if header and self._header_p2p:
                    for t in tensors:
                        if self.is_source:
                            for peer in peers:
                                works.append((group.send([t], peer, _HEADER_TAG), what))
                        else:
                            works.append((group.recv([t], opts.rootRank, _HEADER_TAG), what))
                else:
                    for t in tensors:
                        works.append((group.broadcast([t], opts), what))
                if k == 0:
                    first = len(works)
        except RuntimeError as e:
            raise self._peer_error(what, e) from e
        failed: BaseException | None = None  # raised by ``meanwhile``, not by the collective
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException as e:  # raised once the collectives are done
                failed = e
        if arrived is None:
            self._wait(works)
        else:
            self._wait(works[:first])
            arrived()
            self._wait(works[first:])
        if failed is not None:
            raise failed

    def _wait(self, works: list[tuple[Any, str]]) -> None:
        for work, what in works:
            try:
                if self.timeout is None:
                    work.wait()
                else:
                    work.wait(self.timeout)
            except RuntimeError as e:
                raise self._peer_error(what, e) from e

    def _peer_error(self, what: str, e: RuntimeError) -> PeerError:
        """A message failed: the channel is broken, and the error says who to suspect."""
        self.broken = e
        who = (
            "a receiver rank stopped answering"
            if self.is_source
            else f"the source rank {self.src} stopped answering (or another rank of the group did)"
        )
        return PeerError(
            f"{self._where()}: sending the {what} over ranks {list(self.ranks)} failed: "
            f"{who} (it died, or did not join within the timeout "
            f"{self.timeout or 'of the process group'}). Cause: {e}"
        )

    def _raise_if_broken(self) -> None:
        if self.broken is not None:
            raise PeerError(
                f"{self._where()}: this channel failed earlier ({self.broken}); "
                f"the process group cannot be trusted any more, restart the job"
            )

    def _route(self, group: dist.ProcessGroup) -> tuple[Any, list[int]]:
        """A group's broadcast options (the source's group-local rank is ``rootRank``)
        and the group-local ranks of the receivers."""
        # Keyed by id(): only this channel's group and header group come here, and both
        # are alive whenever they do (the ``group`` property raises for a dead one).
        route = self._routes.get(id(group))
        if route is None:
            opts = dist.BroadcastOptions()
            opts.rootRank = dist.get_group_rank(group, self.src)  # group-local
            opts.rootTensor = 0
            opts.asyncOp = True
            peers = [r for r in range(group.size()) if r != opts.rootRank]
            route = self._routes[id(group)] = (opts, peers)
        return route

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group the batch travels on."""
        group = self._group()
        if group is None:
            raise PeerError(
                f"{self._where()}: the process group of this channel was destroyed; "
                f"build a new loader (or call tensorcast.broadcast) on a live group"
            )
        return group

    @property
    def header_group(self) -> dist.ProcessGroup:
        """Where first messages travel: a gloo group over the same ranks."""
        own = self._own_header_group
        return own if own is not None else self.group

    # -- source --------------------------------------------------------------------

    def encode(self, batch: Any) -> Frame:
        """Turn a batch (a tree or a ``Packed``) into a frame. Raises on bad input."""
        if isinstance(batch, Packed):
            decoded = _schema.decode(batch.header)
            _codec._check_buffer(batch.buffer, decoded.nbytes)
            return Frame(
                FRAME_DATA, batch.header, decoded.nbytes, packed=batch.buffer, decoded=decoded
            )
        plan = _codec.plan(batch, previous=self._last_layout)
        self._last_layout = plan.layout  # no tensors: it keeps no batch alive
        return Frame(FRAME_DATA, plan.header, plan.nbytes, plan=plan)

    def error_frame(self, message: str) -> Frame:
        data = message.encode("utf-8", "replace")[:_MAX_ERROR]
        return Frame(FRAME_ERROR, data, 0)

    def end_frame(self) -> Frame:
        return Frame(FRAME_END, b"", 0)

    def _payload_on_device(self, frame: Frame) -> torch.Tensor:
        """The payload as one buffer on the transfer device."""
        dev = self.transfer_device
        if frame.packed is not None:
            buf = frame.packed
            return buf if buf.device == dev else _codec.copy_to_device(buf, dev)
        assert frame.plan is not None
        plan = frame.plan
        if dev.type == "cuda" and plan.device.type == "cpu":
            # Pack on the host into pinned memory, then one asynchronous copy to the GPU.
            staging = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=True)
            plan.write(staging)
            return _codec.copy_to_device(staging, dev)
        out = self.pool.take(plan.nbytes, dev)
        views = plan.layout.write_spec().pooled_views(out, self.pool)
        frame.tensor_views = plan.write(out, views=views)
        return out

    def _direct_segments(self, frame: Frame) -> list[tuple[int, int, int]] | None:
        """The payload's pieces when some of its tensor leaves can travel from their own
        memory (see the module docstring); None when it travels as one buffer."""
        plan = frame.plan
        if plan is None or plan.nbytes < DIRECT_MIN or plan.device != self.transfer_device:
            return None
        segments = _segments(plan.layout.table, plan.nbytes, DIRECT_MIN)
        return None if len(segments) == 1 and segments[0][2] < 0 else segments

    def _write_direct(
        self, frame: Frame, segments: list[tuple[int, int, int]], inline: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Write the payload except the leaves that travel from their own memory; return
        the source's buffer and the pieces to broadcast after the first message, in order.

        Those leaves are copied into the buffer too (the source's own result must not
        change when its loader reuses a tensor), but later: while they are on the wire
        (``frame.later``). ``inline`` is where the bytes between them go when they fit in
        the first message. A large leaf that is not contiguous is copied now, and sent
        from the buffer.
        """
        plan = frame.plan
        assert plan is not None
        own: dict[int, torch.Tensor] = {}
        for _a, _b, i in segments:
            if i >= 0:
                t = plan.leaves[i][3]
                if t.is_contiguous() and not t.is_conj() and not t.is_neg():
                    own[i] = t.reshape(-1).view(torch.uint8)
        buffer = self.pool.take(plan.nbytes, self.transfer_device)
        frame.later = []
        frame.tensor_views = plan.write(buffer, defer=own, later=frame.later)
        pieces: list[torch.Tensor] = []
        frame.direct_ranges = []
        at = 0
        for a, b, i in segments:
            if i < 0 and inline is not None:
                inline[at : at + b - a].copy_(buffer[a:b])
                at += b - a
                continue
            piece = own.get(i)
            if piece is None:
                pieces.append(buffer[a:b])
            else:
                pieces.append(piece)
                frame.direct_ranges.append((a, b, piece))
        return buffer, pieces

    def _prepare(self, frame: Frame) -> _Prepared:
        """Everything before the first collective: the first message and the payload.

        Nothing here communicates, so any failure (an allocation, a tensor changed since
        it was planned) can still be announced to the receivers with an ERROR frame.
        """
        header = frame.header
        desc = self.description
        head_end = _PREFIX.size + len(desc) + len(header)
        payload_len = frame.payload_len
        capacity = self.capacity
        segments = self._direct_segments(frame) if frame.kind == FRAME_DATA else None
        flags = _DIRECT if segments is not None else 0
        inline_len = _inline_len(payload_len, segments)  # the bytes that would go inline
        payload_at = _inline_at(capacity, inline_len)
        if head_end > capacity:
            flags |= _SPILL
        elif frame.kind == FRAME_DATA and self.inline_ok and head_end <= payload_at:
            flags |= _INLINE
        # Grow the next first message so a frame like this one fits inline (bounded by
        # MAX_CAPACITY: larger payloads take a second message, larger headers spill).
        want = head_end + (_align_up(inline_len) if self.inline_ok else 0)
        if want > MAX_CAPACITY:
            want = head_end if head_end <= MAX_CAPACITY else 0
        next_capacity = max(capacity, _pow2_at_least(want)) if want else capacity

        first = self._out_first
        if first is None or first.numel() != capacity:
            # Zeros: no stale memory of this process travels in the unused bytes.
            first = self._out_first = torch.zeros(capacity, dtype=torch.uint8)
            self._out_host = first.numpy()
            self._out_bytes = self._out_host.data
            self._out_span = (0, capacity, capacity)
        host = self._out_host
        payload: torch.Tensor | None = None
        pieces: list[torch.Tensor] | None = None
        # Every byte but the head and the inline payload is zero: clear what the last frame
        # wrote elsewhere (a longer head, a payload that started earlier or ended later).
        head_len = _PREFIX.size + len(desc) if flags & _SPILL else head_end
        tail, end = (payload_at, payload_at + inline_len) if flags & _INLINE else (capacity,) * 2
        last_head, last_tail, last_end = self._out_span
        if last_head > head_len:
            host[head_len:last_head] = 0
        if last_tail < tail:  # the last payload's bytes before this one's
            host[last_tail : min(last_end, tail)] = 0
        if last_end > end:  # and after it
            host[max(last_tail, end) : last_end] = 0
        self._out_span = (head_len, tail, end)
        if segments is not None:
            inline = first[payload_at : payload_at + inline_len] if flags & _INLINE else None
            payload, pieces = self._write_direct(frame, segments, inline)
        elif flags & _INLINE:
            payload = self._inline_slice(first, payload_at, payload_len)
            frame.in_first = True
            if frame.packed is not None:
                payload.copy_(frame.packed)
            elif frame.plan is not None:
                # Steady state writes a repeated layout through the views made for it the
                # first time: no view is made before the collective.
                layout = frame.plan.layout
                cached = self._inline_views
                # (Capacity changes make a new first message, and move the payload.)
                if (
                    cached
                    and cached[0] is layout
                    and cached[1] is first
                    and cached[2] == payload_at
                ):
                    frame.plan.write(payload, views=cached[3])
                else:
                    views = frame.plan.write(payload)
                    self._inline_views = (layout, first, payload_at, views)
        elif frame.kind == FRAME_DATA:
            payload = self._payload_on_device(frame)
            pieces = [payload] if payload_len else []
        crc = 0
        if self.verify and payload is not None:
            flags |= _CRC
            crc = _crc(payload) if segments is None else _crc_of_direct(payload, frame)
        direct_min = DIRECT_MIN if segments is not None else 0
        cut = _payload_layout(payload_len, flags, direct_min, segments) if pieces else None
        void: list[torch.Tensor] | None = None
        if self._promise is not None:
            if cut == self._promise:
                flags |= _POSTED
            else:
                void = self._void(self._promise)
        if cut is not None and cut == self._sent and self.inline_ok:
            flags |= _NEXT  # a layout that repeats is promised for the next frame
        prefix = self._prefix(
            frame.kind, flags, len(header), payload_len, next_capacity, crc, direct_min
        )
        head = prefix + desc if flags & _SPILL else prefix + desc + header
        self._out_bytes[: len(head)] = head  # one copy for the whole head
        return _Prepared(frame, first, payload, flags, next_capacity, pieces, cut, void)

    @staticmethod
    def _void(layout: _PayloadLayout) -> list[torch.Tensor]:
        """Zeros in the pieces of a promise this frame cannot keep: receivers posted them."""
        sizes = _piece_sizes(layout)
        zeros = torch.zeros(max(sizes), dtype=torch.uint8)
        return [zeros[:n] for n in sizes]

    def _inline_slice(self, first: torch.Tensor, start: int, length: int) -> torch.Tensor:
        """``first[start : start + length]``, the same tensor while the frames repeat."""
        cached = self._out_slice
        if cached and cached[0] is first and cached[1] == start and cached[2] == length:
            return cached[3]
        payload = first[start : start + length]
        self._out_slice = (first, start, length, payload)
        return payload

    def _prefix(
        self,
        kind: int,
        flags: int,
        header_len: int,
        payload_len: int,
        next_capacity: int,
        crc: int = 0,
        direct_min: int = 0,
    ) -> bytes:
        """A frame prefix for this channel's current pass and step: what the source sends,
        and what a receiver that built the tree ahead expects to receive."""
        return _PREFIX.pack(
            _MAGIC,
            kind,
            flags,
            len(self.description),
            self.pass_index,
            self.step,
            self.fingerprint,
            header_len,
            payload_len,
            next_capacity,
            crc,
            direct_min,
        )

    def _post(
        self, prepared: _Prepared, meanwhile: Callable[[], None] | None = None
    ) -> torch.Tensor | None:
        """The collectives of one frame: the first message (with the pieces the last frame
        promised, kept or zeros), then what did not fit in it.

        ``meanwhile`` runs while the frame's last collective is in flight.
        """
        frame, payload, flags = prepared.frame, prepared.payload, prepared.flags
        first = [_Stage([prepared.first], "frame header", True)]
        promised = prepared.pieces if flags & _POSTED else prepared.void
        if promised is not None:
            first.append(_Stage(promised, "batch buffer", False))
        waves = [first]
        if flags & _SPILL:
            spill = torch.frombuffer(bytearray(frame.header), dtype=torch.uint8)
            waves.append([_Stage([spill], "spilled header", True)])
        if prepared.pieces and not flags & _POSTED:
            waves.append([_Stage(prepared.pieces, "batch buffer", False)])
        try:
            for k, wave in enumerate(waves):
                self._broadcasts(wave, meanwhile if k == len(waves) - 1 else None)
        finally:  # a failed collective breaks the channel; anything else keeps it in step
            self.step += 1
            self.capacity = prepared.next_capacity
            self._promise = prepared.layout if flags & _NEXT else None
            self._sent = prepared.layout
        return payload

    def send(self, frame: Frame) -> torch.Tensor | None:
        """Broadcast ``frame`` from this (source) rank.

        Returns:
            The payload buffer as received by peers (for the source's own rebuild), or
            None for END / ERROR frames.
        """
        return self._post(self._prepare(frame))

    def send_batch(self, batch: Any, *, device: torch.device | None = None) -> Any:
        """Source side of one step: encode, send, and rebuild the tree this rank returns.

        Any failure before the first collective (encoding, allocating, writing the
        buffer) is announced to the receivers with an ERROR frame, then re-raised.
        """
        try:
            frame = self.encode(batch)
            prepared = self._prepare(frame)
        except Exception as e:
            self.send(self.error_frame(f"batch serialization failed: {type(e).__name__}: {e}"))
            raise
        payload = prepared.payload
        assert payload is not None
        if frame.packed is not None:
            payload = frame.packed  # this rank's tree views the caller's own buffer
        # This rank's own tree is built while the last collective is on the wire: every
        # byte it needs is in place before the first one is sent.
        own: list[Any] = []

        def build() -> None:
            for dst, src in frame.later or ():  # direct leaves: this rank's own copy
                dst.copy_(src)
            if device is not None and device != payload.device:
                return  # built after: moving to another device may synchronise
            if frame.tensor_views is not None:  # the views the batch was packed into
                assert frame.plan is not None
                values = frame.plan.values(payload, frame.tensor_views)
                own.append(_codec.rebuild(_schema.decode(frame.header), payload, values))
            elif frame.decoded is not None:  # pre-packed, its header validated in encode()
                own.append(_codec.rebuild(frame.decoded, payload))
            elif frame.in_first:
                # The first message is reused for the next frame: view a copy.
                copy = self.pool.take(payload.numel(), payload.device).copy_(payload)
                own.append(_codec.rebuild(_schema.decode(frame.header), copy, pool=self.pool))
            else:
                own.append(_codec.unpack(frame.header, payload))

        self._post(prepared, build)
        if own:
            return own[0]
        assert device is not None  # the tree goes to another device
        if frame.decoded is not None:
            return _codec.rebuild(frame.decoded, _codec.copy_to_device(payload, device))
        return _codec.unpack(frame.header, payload, device=device)

    # -- receivers -----------------------------------------------------------------

    def recv(self, *, device: torch.device | None = None) -> tuple[str, Any]:
        """Receive one frame.

        Returns:
            ``("data", tree)``, ``("end", None)`` or ``("error", message)``.

        Raises:
            HeaderError, DesyncError, PeerError: see the module docstring. After a
            ``HeaderError`` or ``DesyncError`` the channel is broken: the messages that
            followed the bad one were never received here, so the group is out of step,
            and every later call raises ``PeerError`` at once instead of misreading them.
        """
        try:
            return self._recv(device)
        except (HeaderError, DesyncError) as e:
            self.broken = e
            raise

    def _recv(self, device: torch.device | None) -> tuple[str, Any]:
        self._raise_if_broken()
        self._dropped.clear()  # before a first message is taken: it may be the last one
        capacity = self.capacity
        first = self.frames.take(capacity, _CPU)
        stages = [_Stage([first], "frame header", True)]
        # The pieces the last frame promised: posted with the first message, they land
        # without waiting for it to be read. They hold this frame's payload, or zeros.
        landing: _Landing | None = None
        promise = self._promise
        if promise is not None:
            landing = self._land(
                promise.payload_len, promise.flags, promise.segments, first, device
            )
            stages.append(_Stage(landing[1], "batch buffer", False))
        # Made while the first message is on the wire, with the tree built ahead: the
        # message's bytes (as a memoryview) and the guess. Right after the wait every call
        # costs several times what it costs in a hot loop, so what can go before it does.
        waited: list[Any] = []

        def meanwhile() -> None:
            waited.append(first.numpy().data)
            waited.append(self._guess(first, device, landing))

        def arrived() -> None:  # out of step: say so, do not wait for the pieces
            if waited:  # (else meanwhile failed: that is raised once all has arrived)
                self._read_prefix(waited[0], capacity)

        # Posted before the tree is built ahead: the source must never wait for this rank.
        self._broadcasts(stages, meanwhile, arrived if landing is not None else None)
        host: memoryview = waited[0]
        guess: _Ahead | None = waited[1]
        if guess is not None:
            if host[: len(guess.head)] == guess.head:
                # Byte for byte the frame that was expected (a header validated before,
                # this very pass and step): the tree built while waiting is the batch.
                if guess.pieces is not None:
                    self._receive(guess.pieces, guess.copies)
                self.step += 1
                self._repeats += 1
                self._dropped += (first, host)
                return "data", guess.tree
            renewed = self._with_new_values(guess, host, device)
            if renewed is not None:
                self._dropped += (first, host)
                return "data", renewed
        fields = self._read_prefix(host, capacity)
        kind, flags, desc_len = fields[1:4]
        header_len, payload_len, next_capacity, crc, direct_min = fields[7:]
        desc_end = _PREFIX.size + desc_len
        if not capacity <= next_capacity <= MAX_CAPACITY or next_capacity & (next_capacity - 1):
            raise HeaderError(f"{self._where()}: invalid next capacity {next_capacity}")
        if flags & _POSTED and landing is None:
            raise HeaderError(
                f"{self._where()}: the frame says its payload came with the first message, "
                f"but the frame before it promised no payload"
            )
        if landing is not None and not flags & _POSTED:
            # A promise the source could not keep: those pieces held zeros. Let go of their
            # buffer before this frame's own is taken.
            landing = guess = None
            waited.clear()
            stages.clear()
        if header_len > _schema.MAX_HEADER_BYTES:
            raise HeaderError(f"{self._where()}: header length {header_len} is over the limit")
        head_end = desc_end + header_len
        if flags & _SPILL:
            spill = torch.empty(header_len, dtype=torch.uint8)
            self._broadcasts([_Stage([spill], "spilled header", True)])
            header = spill.numpy().tobytes()
        elif head_end > capacity:
            raise HeaderError(f"{self._where()}: header overruns the first message")
        else:
            header = host[desc_end:head_end].tobytes()
        self.step += 1
        self.capacity = next_capacity
        if kind != FRAME_DATA:
            if flags & (_NEXT | _POSTED):
                raise HeaderError(f"{self._where()}: an END or ERROR frame with a payload")
            self._promise = None
        if kind == FRAME_END:
            return "end", None
        if kind == FRAME_ERROR:
            return "error", header.decode("utf-8", "replace")
        decoded = _schema.decode(header)  # validated before anything is allocated
        if payload_len != decoded.nbytes:
            raise HeaderError(
                f"{self._where()}: frame says {payload_len} payload bytes, "
                f"header says {decoded.nbytes}"
            )
        # Where the payload's bytes come from: all inline in the first message, or pieces
        # (the whole payload, or direct leaves and the bytes between them) that follow it.
        inline = flags & _INLINE
        segments: list[tuple[int, int, int]] | None = None
        if flags & _DIRECT:
            if direct_min < _DIRECT_FLOOR:
                raise HeaderError(f"{self._where()}: invalid direct leaf size {direct_min}")
            segments = _segments_of(decoded, direct_min)
        at = _payload_at(capacity, payload_len, flags, segments)
        if inline and at < head_end:
            raise HeaderError(f"{self._where()}: inline payload overruns the header")
        layout = _payload_layout(payload_len, flags, direct_min, segments)
        if flags & _POSTED and layout != promise:
            raise HeaderError(
                f"{self._where()}: the frame's payload layout is not the one the frame "
                f"before it promised, yet the frame says its payload came in those pieces"
            )
        if flags & _NEXT and (layout is None or not self.inline_ok):
            raise HeaderError(f"{self._where()}: the frame promises a payload it cannot have")
        self._promise = layout if flags & _NEXT else None
        tree: Any = None
        if inline and segments is None:
            payload = first[at : at + payload_len]
            if guess is not None and guess.pieces is None and guess.at == at:
                # Built while waiting, on these very bytes: the whole tree when the header
                # repeats, its leaves when only the small values changed.
                if guess.header == header:
                    tree = guess.tree
                elif guess.structure is decoded.structure:
                    tree = _codec.rebuild(decoded, payload, guess.leaves)
        elif landing is not None:  # received with the first message
            payload, _, copies = landing
            self._receive([], copies)
        else:
            # A payload buffer taken for a guess that missed goes back to the pool first.
            guess = None
            waited.clear()
            payload, pieces, copies = self._land(payload_len, flags, segments, first, device)
            self._receive(pieces, copies)
        self._remember(header, decoded, device, flags, direct_min)
        if flags & _CRC and _crc(payload) != crc:
            raise PeerError(
                f"{self._where()}: the received buffer's CRC32 is {_crc(payload):#010x} but the "
                f"source sent {crc:#010x}: the bytes were corrupted in transit"
            )
        if device is not None and device != payload.device:
            payload = _codec.copy_to_device(payload, device)
        if tree is None:
            pool = self.frames if inline and segments is None else self.pool
            tree = _codec.rebuild(decoded, payload, pool=pool)
        return "data", tree

    def _read_prefix(self, host: memoryview, capacity: int) -> tuple[Any, ...]:
        """A first message's prefix fields, checked to be a frame of this setup, pass and
        step (the rest is checked by the caller, field by field).

        Raises:
            HeaderError: not a tensorcast frame.
            DesyncError: a frame of another setup, pass or step.
        """
        fields = _PREFIX.unpack_from(host, 0)
        magic, kind, _flags, desc_len, pass_index, step, fingerprint = fields[:7]
        if magic != _MAGIC or kind not in _KINDS or desc_len > _MAX_DESC:
            raise HeaderError(
                f"{self._where()}: received a frame that is not a tensorcast frame "
                f"(magic {bytes(magic)!r}, kind {kind})"
            )
        desc_end = _PREFIX.size + desc_len
        if desc_end > capacity:
            raise HeaderError(f"{self._where()}: frame description overruns the first message")
        if fingerprint != self.fingerprint:
            theirs = bytes(host[_PREFIX.size : desc_end]).decode("utf-8", "replace")
            raise DesyncError(
                f"{self._where()}: the source's setup differs from this rank's.\n"
                f"  source:    {theirs}\n  this rank: {self.description.decode()}\n"
                f"Every rank of the group must use the same mesh, axes, source and "
                f"tensorcast version."
            )
        if (pass_index, step) != (self.pass_index, self.step):
            raise DesyncError(
                f"rank {self.rank} expected pass {self.pass_index} step {self.step} from source "
                f"rank {self.src}, but the source sent pass {pass_index} step {step}: a loader "
                f"was restarted, or skipped a batch, on one rank. Every rank must iterate the "
                f"same loader in lockstep."
            )
        return fields

    def _land(
        self,
        payload_len: int,
        flags: int,
        segments: list[tuple[int, int, int]] | None,
        first: torch.Tensor,
        device: Any,
    ) -> _Landing:
        """:meth:`_landing` for pieces this rank is about to receive: with no memory for
        them, the collective sequence is lost, and the channel is broken."""
        try:
            return self._landing(payload_len, flags, segments, first, device)
        except RuntimeError as e:
            self.broken = e
            raise TensorcastError(
                f"{self._where()}: cannot allocate the {payload_len}-byte batch buffer "
                f"on {self.transfer_device}: {e}"
            ) from e

    def _landing(
        self,
        payload_len: int,
        flags: int,
        segments: list[tuple[int, int, int]] | None,
        first: torch.Tensor,
        device: Any,
    ) -> _Landing:
        """Where a frame's payload lands when it does not all travel inline: the buffer,
        the pieces received into it after the first message (in order), and the
        ``(destination, source)`` copies of the bytes between direct leaves that came
        inline, from ``first``.

        Raises:
            RuntimeError: the buffer cannot be allocated.
        """
        at = _payload_at(first.numel(), payload_len, flags, segments)
        if device is not None and device.type == "cuda" and self.transfer_device.type == "cpu":
            # gloo into pinned memory, so the copy to the GPU below is asynchronous.
            payload = torch.empty(payload_len, dtype=torch.uint8, pin_memory=True)
        else:
            payload = self.pool.take(payload_len, self.transfer_device)
        if segments is None:
            return payload, [payload] if payload_len else [], []
        pieces: list[torch.Tensor] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for a, b, i in segments:
            if i < 0 and flags & _INLINE:
                copies.append((payload[a:b], first[at : at + b - a]))
                at += b - a
            else:
                pieces.append(payload[a:b])
        return payload, pieces, copies

    def _receive(
        self,
        pieces: list[torch.Tensor],
        copies: list[tuple[torch.Tensor, torch.Tensor]],
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Receive the pieces that follow the first message; while they are on the wire,
        copy the inline bytes into place and run ``meanwhile``."""

        def during() -> None:
            for dst, src in copies:
                dst.copy_(src)
            if meanwhile is not None:
                meanwhile()

        if pieces:
            self._broadcasts([_Stage(pieces, "batch buffer", False)], during)
        else:
            during()

    def _with_new_values(self, guess: _Ahead, host: memoryview, device: Any) -> Any | None:
        """The tree of a frame that is the expected one but for its small values, from the
        leaves built ahead; None for any other frame (the full path reads it).

        Its prefix and description must be the expected bytes but for the header's
        length, and its header the expected structure's bytes up to the values. That
        fixes every size, so a payload that follows the first message is received into
        the buffer taken ahead, and the values are parsed and validated and the tree
        built while it is on the wire (the source cannot send it before this rank posts
        its receive).
        """
        head = guess.head
        desc_end = _PREFIX.size + len(self.description)
        if (
            host[:_HEADER_LEN_AT] != head[:_HEADER_LEN_AT]
            or host[_HEADER_LEN_AT + 4 : desc_end] != head[_HEADER_LEN_AT + 4 : desc_end]
        ):
            return None
        head_end = desc_end + int.from_bytes(host[_HEADER_LEN_AT : _HEADER_LEN_AT + 4], "little")
        if head_end > guess.at:  # the header would run into the payload
            return None
        header = host[desc_end:head_end].tobytes()
        structure = guess.structure
        at = _schema.values_at(structure, header)
        if at is None:
            return None
        built: list[tuple[_schema.Decoded, Any]] = []

        def build() -> None:  # the leaves are in place, or will be: their views are
            decoded = _schema.read_values(structure, header, at)
            built.append((decoded, _codec.rebuild(decoded, guess.buffer, guess.leaves)))

        if guess.pieces is None:
            build()
        else:
            self._receive(guess.pieces, guess.copies, build)
        decoded, tree = built[0]
        self.step += 1
        self._remember(header, decoded, device, guess.flags, guess.direct_min)
        return tree

    def _remember(
        self, header: bytes, decoded: _schema.Decoded, device: Any, flags: int, direct_min: int
    ) -> None:
        """Note a data frame's header and how it travelled, to build the next one's tree
        ahead (see _guess)."""
        last = self._last
        self._dropped.append(last)
        same = (
            last is not None
            and last[1].structure is decoded.structure
            and last[2:] == (flags, direct_min)
        )
        self._repeats = self._repeats + 1 if same else 0
        guessable = (
            (device is None or device == _CPU)
            and self.inline_ok  # a CPU transfer device
            and not flags & ~(_INLINE | _DIRECT | _NEXT | _POSTED)  # no spill, no CRC
        )
        if same and guessable:  # a structure already found guessable
            self._last = (header, decoded, flags, direct_min)
            return
        if guessable:  # bytes and str leaves are copies: they cannot be made ahead
            guessable = all(row[0] == "ndarray" for _, row in _codec.view_spec(decoded).others)
        self._last = (header, decoded, flags, direct_min) if guessable else None

    def _guess(
        self,
        first: torch.Tensor,
        device: Any,
        landing: _Landing | None,
    ) -> _Ahead | None:
        """Build the tree of the next frame before it arrives, assuming it repeats the
        last header (steady state): receivers wait for the source anyway, so the views and
        containers are made while it packs, with the first message's receive posted.
        Used whole if the header repeats; its leaves if the structure does (new small
        values). A frame whose payload follows the first message gets its buffer and
        pieces too, so they are received as soon as the frame is recognised, unless they
        were promised: ``landing`` is then where they are being received. Built only
        once structures have been repeating, so batches of varying shapes waste no work.
        """
        last = self._last
        if last is None or self._repeats < 1 or (device is not None and device != _CPU):
            return None
        header, decoded, flags, direct_min = last
        if bool(flags & _POSTED) != (landing is not None):
            return None  # not a frame like the last one
        segments = _segments_of(decoded, direct_min) if flags & _DIRECT else None
        at = _payload_at(first.numel(), decoded.nbytes, flags, segments)
        if at < _PREFIX.size + len(self.description) + len(header):
            return None
        prefix = self._prefix(
            FRAME_DATA, flags, len(header), decoded.nbytes, self.capacity, 0, direct_min
        )
        pieces: list[torch.Tensor] | None = None
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        if flags & _INLINE and segments is None:
            buffer = first
            leaves = _codec.views(decoded, first[at : at + decoded.nbytes], self.frames)
        else:
            if landing is not None:  # its pieces are on the wire already
                buffer, pieces, copies = landing[0], [], landing[2]
            else:
                try:
                    buffer, pieces, copies = self._landing(
                        decoded.nbytes, flags, segments, first, None
                    )
                except RuntimeError:  # no memory to spare now: the full path will say so
                    return None
            leaves = _codec.views(decoded, buffer, self.pool)
        tree = _codec.rebuild(decoded, buffer, leaves)
        head = prefix + self.description + header
        return _Ahead(
            header,
            at,
            tree,
            head,
            decoded.structure,
            leaves,
            flags,
            direct_min,
            buffer,
            pieces,
            copies,
        )


_channels: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, Channel]] = (
    weakref.WeakKeyDictionary()
)
_channels_lock = threading.Lock()


def channel_for_group(group: dist.ProcessGroup, src: int) -> Channel:
    """The channel ``tc.broadcast`` uses for ``src`` on ``group``, kept while the group lives.

    Keyed by the group object itself (a weak reference), never by ``id()``.
    """
    global _last_channel
    ch = _last_channel()  # one call after another on the same group: no lock, no lookup
    if ch is not None and ch._group() is group and ch.src == src:
        return ch
    with _channels_lock:
        by_src = _channels.setdefault(group, {})
        ch = by_src.get(src)
        if ch is None:
            ch = by_src[src] = Channel(group, src)
        _last_channel = weakref.ref(ch)
        return ch


def _nothing() -> None:
    return None


_last_channel: Callable[[], Channel | None] = _nothing


# Background producers (the loader's prefetch threads) still owed collectives on a group.
# Anyone about to use the group drains them first, at the same point on every rank, so
# their collectives never interleave with new ones.
_producers: weakref.WeakKeyDictionary[dist.ProcessGroup, set[Any]] = weakref.WeakKeyDictionary()
_producers_lock = threading.Lock()
# Every registered producer's id, whatever became of its group: drain() checks this plain
# set without the lock (len() of a WeakKeyDictionary is a Python-level call on each step).
_producer_ids: set[int] = set()


def register_producer(group: dist.ProcessGroup, producer: Any) -> None:
    """Track a producer with a ``close()`` that finishes the collectives it owes."""
    with _producers_lock:
        _producers.setdefault(group, set()).add(producer)
        _producer_ids.add(id(producer))


def unregister_producer(group: dist.ProcessGroup, producer: Any) -> None:
    with _producers_lock:
        _producer_ids.discard(id(producer))
        live = _producers.get(group)
        if live is not None:
            live.discard(producer)
            if not live:
                del _producers[group]


def drain(group: dist.ProcessGroup) -> None:
    """Close every producer still live on ``group``; each finishes what it owes first."""
    if not _producer_ids:  # the usual case, without taking the lock
        return
    with _producers_lock:
        live = list(_producers.get(group, ()))
    for producer in live:
        producer.close()


def raise_for(kind: str, value: Any, src: int) -> Any:
    """Turn a received frame into the tree, or raise what the source reported."""
    if kind == "data":
        return value
    if kind == "error":
        raise SourceError(f"source rank {src} reported: {value}")
    raise SourceError(f"source rank {src} sent end-of-data where a batch was expected")
