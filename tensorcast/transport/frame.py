"""A frame: what one step puts on the wire, and how it is cut into messages.

Each step (one batch, the end of a pass, its early close, or a source's failure) is one
*frame*: a first message of a *capacity* every rank knows before it arrives (a 44-byte
:class:`Prefix`, the header unless it spills, and an inline payload at its end when it
fits), then a spilled header and a separate payload only where :func:`cut_frame` says so.
Both sides cut a frame with that one pure function of the prefix's numbers, through one
:class:`Cutter` per side that also keeps the promise rule (NOTE [ Promised payloads ]),
so they cannot drift apart. The prefix names the channel, the pass and the step, so a
receiver out of step raises ``DesyncError`` instead of taking another loader's batch.
Nothing here communicates. ``docs/format.md`` is the byte specification (the golden
tests hold both to it).

# NOTE [ Promised payloads ]
gloo sends a message once its receiver has posted the receive, so a separate payload
waits for receivers to read the first message first. When the channel's last ``need``
frames each carried a separate payload of ``n`` bytes, the next frame *promises* ``n``
bytes: every rank posts an ``n``-byte payload message with the first message. The
source's is the payload when that is separate and ``n`` bytes long, else ``n`` zero bytes
that receivers drop. ``need`` starts at 2 and doubles, up to 16, each time a promise is
not kept. Source and receivers apply the rule to the same frames in the same order, and
the prefix's ``Flags.PROMISED`` makes a rank whose rule disagrees fail loudly. Host
payloads only; ``TENSORCAST_PROMISES=0`` turns it off (the setup agreement checks that
every rank agrees). Why and what it costs: ``docs/design.md``, "Promised payloads".
"""

from __future__ import annotations

import datetime
import functools
import os
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import Any

import torch

from tensorcast import codec
from tensorcast._errors import HeaderError

__all__ = [
    "DEFAULT_TIMEOUT",
    "FRAMES_VERSION",
    "INITIAL_CAPACITY",
    "MAX_CAPACITY",
    "MAX_ERROR_BYTES",
    "PREFIX_FIELDS",
    "PREFIX_SIZE",
    "SHM_REF_BYTES",
    "Cut",
    "Cutter",
    "Flags",
    "Kind",
    "Prefix",
    "Promises",
    "Stamp",
    "crc32",
    "cut_frame",
    "promises_enabled",
]

#: How frames are laid out and follow one another; part of every setup agreement.
FRAMES_VERSION = 9  # 8: the CRC covers the header too; 9: payloads in shared memory (SHM)
INITIAL_CAPACITY = 4096
#: The largest first message: larger payloads always follow in a message of their own.
MAX_CAPACITY = 256 << 10
MAX_ERROR_BYTES = 64 << 10
#: A header larger than this is refused before anything is allocated for it: the
#: header format's own limit on its body, with the header's framing.
MAX_HEADER_BYTES = codec.PREFIX_BYTES + codec.MAX_HEADER_BYTES
PAYLOAD_ALIGN = 64
#: How long either role waits on its peers for a frame when not told: torch's default
#: process group timeout.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
#: the bytes of a shared-memory slot's Ref at the end of a first message (``transport.shm``)
SHM_REF_BYTES = 16
_MAGIC = b"TCFR"
#: The prefix's fields, in the order ``_STRUCT`` packs them (see docs/format.md).
PREFIX_FIELDS = (
    "magic",
    "version",
    "kind",
    "flags",
    "channel",
    "pass_index",
    "step",
    "header_len",
    "payload_len",
    "next_capacity",
    "crc",
)
_STRUCT = struct.Struct("<4sBBHIIQIQII")
PREFIX_SIZE = _STRUCT.size


class Kind(IntEnum):
    """What a frame carries."""

    DATA = 1
    END = 2
    ERROR = 3
    CLOSE = 4  # the source's loop left the pass early, at this step


class Flags(IntFlag):
    """How a frame is cut; receivers check them against their own :func:`cut_frame`."""

    NONE = 0
    INLINE = 1  # the payload ends the first message
    SPILL = 2  # the header did not fit: it follows the first message alone
    CRC = 4  # ``crc`` is the CRC32 of the payload
    PROMISED = 8  # a promised payload came with the first message (NOTE [ Promised payloads ])
    SHM = 16  # the payload is in a shared-memory slot; its Ref ends the first message


# Every valid kind and flag combination, by value: a prefix is read without calling enum.
_KINDS = {int(k): k for k in Kind}
_FLAGS = {f: Flags(f) for f in range(int(max(Flags)) * 2)}


@dataclass(frozen=True, slots=True)
class Prefix:
    """The fixed-size start of every first message."""

    kind: Kind
    flags: Flags
    channel: int  # which channel on these ranks (agreed when it was set up)
    pass_index: int
    step: int
    header_len: int
    payload_len: int
    next_capacity: int
    crc: int = 0

    @staticmethod
    def write(
        buffer: memoryview | bytearray,
        kind: int,
        flags: int,
        channel: int,
        pass_index: int,
        step: int,
        header_len: int,
        payload_len: int,
        next_capacity: int,
        crc: int = 0,
    ) -> None:
        """Pack a prefix of these fields into ``buffer``, with no object made (the source
        writes one per frame); :meth:`unpack` reads it back."""
        _STRUCT.pack_into(
            buffer,
            0,
            _MAGIC,
            FRAMES_VERSION,
            kind,
            flags,
            channel,
            pass_index,
            step,
            header_len,
            payload_len,
            next_capacity,
            crc,
        )

    @classmethod
    def unpack(cls, data: memoryview | bytes, capacity: int) -> Prefix:
        """Read and validate a prefix received in a first message of ``capacity`` bytes.

        Raises:
            HeaderError: not a frame of this version, or sizes no sender would write.
        """
        if len(data) < PREFIX_SIZE:
            raise HeaderError(f"a first message of {len(data)} bytes has no frame prefix")
        magic, version, kind, flags, channel, pass_index, step, hlen, plen, nxt, crc = (
            _STRUCT.unpack_from(data, 0)
        )
        if magic != _MAGIC:
            raise HeaderError(f"not a tensorcast frame (magic {magic!r}, expected {_MAGIC!r})")
        if version != FRAMES_VERSION:
            raise HeaderError(
                f"frame version {version} from the source, but this rank speaks frames "
                f"v{FRAMES_VERSION}: install the same tensorcast version on every rank"
            )
        if kind not in _KINDS:
            raise HeaderError(f"unknown frame kind {kind}; known kinds: {[k.value for k in Kind]}")
        if flags not in _FLAGS:
            raise HeaderError(f"unknown frame flags {flags:#x}")
        if hlen > MAX_HEADER_BYTES:
            raise HeaderError(f"a {hlen}-byte header is over the {MAX_HEADER_BYTES}-byte limit")
        if not capacity <= nxt <= MAX_CAPACITY or nxt & (nxt - 1):
            raise HeaderError(f"invalid next capacity {nxt} (this one is {capacity})")
        if kind != Kind.DATA and (plen or (kind in (Kind.END, Kind.CLOSE) and hlen)):
            raise HeaderError(f"a {Kind(kind).name} frame with a header or payload")
        if kind == Kind.ERROR and hlen > MAX_ERROR_BYTES:
            raise HeaderError(f"an error message of {hlen} bytes is over the limit")
        return cls(_KINDS[kind], _FLAGS[flags], channel, pass_index, step, hlen, plen, nxt, crc)


class Stamp:
    """The pass and the next step that a channel's frames carry besides its id: one per
    loader pass (a channel's passes interleave, each numbered alone: NOTE [ Where a pass
    ends ] in ``loader.passes``), and a role's own for frames outside a pass
    (``tensorcast.broadcast``). Only the lane's jobs move it, so it is the same on every
    rank frame after frame."""

    __slots__ = ("pass_index", "step")

    def __init__(self, pass_index: int = 0) -> None:
        self.pass_index = pass_index
        self.step = 0  # the next frame's


def _align_up(n: int, a: int = PAYLOAD_ALIGN) -> int:
    return (n + a - 1) // a * a


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


@dataclass(frozen=True, slots=True)
class Cut:
    """How one frame is cut into messages; a pure function of five numbers.

    Attributes:
        inline: the payload ends the first message, at ``payload_at``.
        shm: the payload is in a shared-memory slot, whose Ref ends the first message at
            ``payload_at`` (``transport.shm``).
        spill: the header follows the first message alone.
        promised: the bytes of the promised message posted with the first one (0: none).
        in_promise: the payload is that promised message.
        flags: INLINE, SPILL and PROMISED, as the prefix carries them.
        next_capacity: the next first message's size.
    """

    capacity: int
    header_len: int
    payload_len: int
    inline: bool
    spill: bool
    next_capacity: int
    flags: Flags
    payload_at: int  # where an inline payload starts
    separate_payload: bool  # the payload follows the first message as a message of its own
    promised: int = 0
    in_promise: bool = False
    shm: bool = False


@functools.lru_cache(maxsize=256)  # pure, and a repeating batch asks the same thing
def cut_frame(
    capacity: int,
    header_len: int,
    payload_len: int,
    *,
    host_payloads: bool,
    promised: int = 0,
    shm: bool = False,
) -> Cut:
    """Cut a frame: the header inline unless it does not fit, the payload inline when it
    fits after the header (and the transfer device is the host), else in the promised
    message when the frame promised its size, else on its own.

    ``host_payloads`` is False where payloads live on a GPU: a first message travels on a
    host group there, so the payload always follows on the device group. ``promised``
    is what :class:`Promises` says of this frame. ``shm``: the payload is in a shared-memory
    slot, and only its Ref travels, at the end of the first message.
    """
    if shm:
        return _cut_shm(capacity, header_len, payload_len, promised)
    head = PREFIX_SIZE + header_len
    spill = head > capacity
    inline = not spill and host_payloads and _align_up(head) + _align_up(payload_len) <= capacity
    # Grow the next first message so a frame like this one fits in it, within the cap.
    want = _align_up(head) + (_align_up(payload_len) if host_payloads else 0)
    if want > MAX_CAPACITY:
        want = head if head <= MAX_CAPACITY else 0
    next_capacity = max(capacity, _pow2_at_least(want)) if want else capacity
    in_promise = promised > 0 and not inline and payload_len == promised
    flags = (
        (Flags.INLINE if inline else Flags.NONE)
        | (Flags.SPILL if spill else Flags.NONE)
        | (Flags.PROMISED if promised else Flags.NONE)
    )
    return Cut(
        capacity,
        header_len,
        payload_len,
        inline,
        spill,
        next_capacity,
        flags,
        payload_at=capacity - _align_up(payload_len),
        separate_payload=payload_len > 0 and not inline and not in_promise,
        promised=promised,
        in_promise=in_promise,
    )


@functools.lru_cache(maxsize=64)
def _cut_shm(capacity: int, header_len: int, payload_len: int, promised: int) -> Cut:
    """A frame whose payload is in a shared-memory slot: the header inline unless it and the
    Ref do not both fit, the Ref in the first message's last bytes."""
    head = PREFIX_SIZE + header_len
    spill = head + SHM_REF_BYTES > capacity
    want = _align_up(head) + SHM_REF_BYTES
    if want > MAX_CAPACITY:
        want = 0
    next_capacity = max(capacity, _pow2_at_least(want)) if want else capacity
    flags = Flags.SHM | (Flags.SPILL if spill else Flags.NONE)
    flags |= Flags.PROMISED if promised else Flags.NONE
    return Cut(
        capacity,
        header_len,
        payload_len,
        False,
        spill,
        next_capacity,
        flags,
        payload_at=capacity - SHM_REF_BYTES,
        separate_payload=False,
        promised=promised,
        shm=True,
    )


def crc32(buffer: torch.Tensor, header: bytes = b"") -> int:
    """The CRC32 of a frame's header then its payload's bytes (``Flags.CRC``): the header
    carries what the payload alone does not (a trimmed leaf's run lengths and pads)."""
    crc = zlib.crc32(header)
    return zlib.crc32(buffer.cpu().numpy().data, crc) if buffer.numel() else crc


# -- the cut of one side's frames, one after another -------------------------------------

_FIRST_NEED = 2  # same-size separate payloads in a row before a frame promises
_MAX_NEED = 16
_SHM = int(Flags.SHM)
_CUT_FLAGS = int(Flags.INLINE | Flags.SPILL | Flags.PROMISED | Flags.SHM)


def promises_enabled() -> bool:
    """Whether channels set up now promise payloads (``TENSORCAST_PROMISES``, default on)."""
    return os.environ.get("TENSORCAST_PROMISES", "1") != "0"


class Promises:
    """The rule of NOTE [ Promised payloads ] for one channel, on one rank.

    Args:
        on: whether this channel promises at all (the switch, and a host wire).
    """

    __slots__ = ("_last", "_need", "_on", "_run")

    def __init__(self, on: bool) -> None:
        self._on = on
        self._last = 0  # the size of the last frame's separate payload (0: none)
        self._run = 0  # how many frames in a row carried one of that size
        self._need = _FIRST_NEED

    def next(self) -> int:
        """The bytes the next frame promises (0: none)."""
        return self._last if self._on and self._run >= self._need else 0

    def record(self, cut: Cut) -> int:
        """A frame cut as ``cut`` went on (or came off) the wire; returns :meth:`next`."""
        n = 0 if cut.inline or cut.shm else cut.payload_len  # a separate message, or none
        if cut.promised and not cut.in_promise:
            self._need = min(2 * self._need, _MAX_NEED)
        if n and n == self._last:
            self._run += 1
        else:
            self._last, self._run = n, 1 if n else 0
        return self._last if self._on and self._run >= self._need else 0


class Cutter:
    """How one side of a channel cuts its frames, one after another: at the group's
    first-message capacity, with this channel's promises. The source and every receiver
    make the same calls for the same frames in the same order, so they cut each alike:
    the source :meth:`cut` s a frame and :meth:`commit` s it as it goes out, a receiver
    :meth:`read` s the cut of each prefix it takes.

    Args:
        group: the group whose ``capacity`` (the next first message's size, the same for
            every channel on it) this cutter reads and advances.
        promises: whether this channel promises payloads (host payloads only).
    """

    __slots__ = ("_group", "_promises", "host_payloads", "promised")

    def __init__(self, group: Any, *, promises: bool) -> None:
        self._group = group
        #: payloads live on the host, so they may travel inside the first message
        self.host_payloads = group.wire.streams is None
        self._promises = Promises(promises and self.host_payloads)
        #: the bytes the next frame promises (0: none), posted with its first message
        self.promised = 0

    def cut(self, header_len: int, payload_len: int, *, shm: bool = False) -> Cut:
        """Cut the source's next frame (see :func:`cut_frame`); it counts once committed."""
        return cut_frame(
            self._group.capacity,
            header_len,
            payload_len,
            host_payloads=self.host_payloads,
            promised=self.promised,
            shm=shm,
        )

    def commit(
        self,
        buffer: memoryview,
        kind: int,
        cut: Cut,
        header_len: int,
        crc: int | None,
        channel: int,
        pass_index: int,
        step: int,
    ) -> None:
        """The source's frame cut as ``cut`` goes out now: its prefix is written at the
        start of ``buffer`` (its first message; ``crc`` None: none carried), and the next
        frame is cut after it. Whatever fails from here breaks the lane (NOTE [ A frame is
        atomic ]), so the record stands or no frame follows."""
        flags = cut.flags if crc is None else cut.flags | Flags.CRC
        Prefix.write(
            buffer,
            kind,
            flags,
            channel,
            pass_index,
            step,
            header_len,
            cut.payload_len,
            cut.next_capacity,
            crc or 0,
        )
        self.promised = self._promises.record(cut)
        self._group.capacity = cut.next_capacity

    def read(self, prefix: Prefix) -> Cut:
        """A receiver's cut of the frame ``prefix`` announces, checked against the
        prefix's flags; the next frame is cut after it (a frame not read whole breaks the
        lane, so none follows).

        Raises:
            HeaderError: the prefix's flags are not the cut its sizes make.
        """
        cut = cut_frame(
            self._group.capacity,
            prefix.header_len,
            prefix.payload_len,
            host_payloads=self.host_payloads,
            promised=self.promised,
            shm=bool(int(prefix.flags) & _SHM),
        )
        if int(prefix.flags) & _CUT_FLAGS != cut.flags:  # int: IntFlag's operators run Python
            raise HeaderError(
                f"the frame is cut as {Flags(int(prefix.flags) & _CUT_FLAGS)!r} but its "
                f"sizes say {cut.flags!r}"
            )
        self.promised = self._promises.record(cut)
        self._group.capacity = prefix.next_capacity
        return cut
