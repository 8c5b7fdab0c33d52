"""A frame: what one step puts on the wire, and how it is cut into messages.

Each step (one batch, the end of a pass, its early close, or a source's failure) is one
*frame*: a first message of a *capacity* every rank knows before it arrives (a 44-byte
:class:`Prefix`, the header unless it spills, and an inline payload at its end when it
fits), then a spilled header and a separate payload only where :func:`plan_frame` says so. Both sides
cut a frame with that one pure function of the prefix's numbers, so they cannot drift
apart. The prefix names the channel, the pass and the step, so a receiver out of step
raises ``DesyncError`` instead of taking another loader's batch. Nothing here
communicates. ``docs/format.md`` is the byte specification (the golden tests hold both
to it).
"""

from __future__ import annotations

import functools
import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum, IntFlag

import torch

from tensorcast._errors import HeaderError
from tensorcast.codec import framing as _framing

__all__ = [
    "FRAMES_VERSION",
    "INITIAL_CAPACITY",
    "MAX_CAPACITY",
    "MAX_ERROR_BYTES",
    "PREFIX_FIELDS",
    "PREFIX_SIZE",
    "Flags",
    "FramePlan",
    "Kind",
    "Prefix",
    "Stamp",
    "crc32",
    "plan_frame",
]

#: How frames are laid out and follow one another; part of every setup agreement.
FRAMES_VERSION = 7
INITIAL_CAPACITY = 4096
#: The largest first message: larger payloads always follow in a message of their own.
MAX_CAPACITY = 256 << 10
MAX_ERROR_BYTES = 64 << 10
#: A header larger than this is refused before anything is allocated for it: the
#: header format's own limit on its body, with the header's framing.
MAX_HEADER_BYTES = _framing.PREFIX_BYTES + _framing.MAX_HEADER_BYTES
PAYLOAD_ALIGN = 64
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
    """How a frame is cut; receivers check them against their own :func:`plan_frame`."""

    NONE = 0
    INLINE = 1  # the payload ends the first message
    SPILL = 2  # the header did not fit: it follows the first message alone
    CRC = 4  # ``crc`` is the CRC32 of the payload
    PROMISED = 8  # a promised payload message came with the first message (see _promise)


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

    def pack_into(self, buffer: memoryview | bytearray) -> None:
        _STRUCT.pack_into(
            buffer,
            0,
            _MAGIC,
            FRAMES_VERSION,
            self.kind,
            self.flags,
            self.channel,
            self.pass_index,
            self.step,
            self.header_len,
            self.payload_len,
            self.next_capacity,
            self.crc,
        )

    @staticmethod
    def write(
        buffer: memoryview | bytearray,
        kind: int,
        flags: int,
        stamp: Stamp,
        header_len: int,
        payload_len: int,
        next_capacity: int,
        crc: int,
    ) -> None:
        """Pack a prefix of these fields into ``buffer`` (what :meth:`pack_into` writes,
        with no object made: the source writes one per frame)."""
        _STRUCT.pack_into(
            buffer,
            0,
            _MAGIC,
            FRAMES_VERSION,
            kind,
            flags,
            stamp.channel,
            stamp.pass_index,
            stamp.step,
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


def _align_up(n: int, a: int = PAYLOAD_ALIGN) -> int:
    return (n + a - 1) // a * a


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


@dataclass(frozen=True, slots=True)
class FramePlan:
    """How one frame is cut into messages; a pure function of five numbers.

    Attributes:
        inline: the payload ends the first message, at ``payload_at``.
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


@functools.lru_cache(maxsize=256)  # pure, and a repeating batch asks the same thing
def plan_frame(
    capacity: int, header_len: int, payload_len: int, *, inline_ok: bool, promised: int = 0
) -> FramePlan:
    """Cut a frame: the header inline unless it does not fit, the payload inline when it
    fits after the header (and the transfer device is the host), else in the promised
    message when the frame promised its size, else on its own.

    ``inline_ok`` is False where payloads live on a GPU: a first message travels on a
    host group there, so the payload always follows on the device group. ``promised``
    is what :class:`tensorcast.transport.promise.Promises` says of this frame.
    """
    head = PREFIX_SIZE + header_len
    spill = head > capacity
    inline = not spill and inline_ok and _align_up(head) + _align_up(payload_len) <= capacity
    # Grow the next first message so a frame like this one fits in it, within the cap.
    want = _align_up(head) + (_align_up(payload_len) if inline_ok else 0)
    if want > MAX_CAPACITY:
        want = head if head <= MAX_CAPACITY else 0
    next_capacity = max(capacity, _pow2_at_least(want)) if want else capacity
    in_promise = promised > 0 and not inline and payload_len == promised
    flags = (
        (Flags.INLINE if inline else Flags.NONE)
        | (Flags.SPILL if spill else Flags.NONE)
        | (Flags.PROMISED if promised else Flags.NONE)
    )
    return FramePlan(
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


@dataclass(frozen=True, slots=True)
class Stamp:
    """Which frame this is (checked by receivers against the prefix): the channel, the loader's pass, the step within it."""

    channel: int
    pass_index: int
    step: int


def crc32(buffer: torch.Tensor) -> int:
    """The CRC32 of a payload's bytes (``Flags.CRC``), 0 for an empty one."""
    return zlib.crc32(buffer.cpu().numpy().data) if buffer.numel() else 0
