"""A header's framing: magic bytes, the format version, flags and the body's length.

Layout (all integers little-endian)::

    offset  size  field
    0       4     magic  b"TCST"
    4       2     format version (u16), currently 2
    6       2     flags (u16), must be 0 in version 2
    8       4     body length in bytes (u32), at most MAX_HEADER_BYTES
    12      n     body (see ``codec.schema``)
"""

from __future__ import annotations

import struct

from tensorcast._errors import HeaderError

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "PREFIX",
    "PREFIX_BYTES",
    "SUPPORTED_VERSIONS",
    "invalid",
    "unframe",
]

MAGIC = b"TCST"
FORMAT_VERSION = 2
SUPPORTED_VERSIONS = (2,)
PREFIX = struct.Struct("<4sHHI")
PREFIX_BYTES = PREFIX.size
MAX_HEADER_BYTES = 64 << 20  # 64 MiB of JSON; long strings and bytes go to the buffer


def invalid(what: str) -> HeaderError:
    """The error for a header that breaks the format, ``what`` saying how."""
    return HeaderError(f"invalid tensorcast header: {what}")


def unframe(header: bytes | bytearray | memoryview) -> bytes:
    """The body of ``header``, once its framing is checked.

    Raises:
        HeaderError: bad magic, an unknown version or flags, or a length that is over
            the limit or disagrees with the header's size.
    """
    if len(header) < PREFIX_BYTES:
        raise invalid(f"{len(header)} bytes is shorter than the {PREFIX_BYTES}-byte prefix")
    magic, version, flags, length = PREFIX.unpack_from(header)
    if magic != MAGIC:
        raise invalid(
            f"bad magic {bytes(magic)!r}, expected {MAGIC!r}; this is not a tensorcast header"
        )
    if version not in SUPPORTED_VERSIONS:
        raise HeaderError(
            f"unknown tensorcast format version {version}. Available versions: "
            f"{list(SUPPORTED_VERSIONS)}; upgrade tensorcast on the ranks that cannot read it"
        )
    if flags != 0:
        raise invalid(f"unknown flags 0x{flags:04x} for version {version}")
    if length > MAX_HEADER_BYTES:
        raise invalid(f"body length {length} is over the {MAX_HEADER_BYTES}-byte limit")
    if len(header) != PREFIX_BYTES + length:
        raise invalid(
            f"the prefix says the body has {length} bytes but {len(header) - PREFIX_BYTES} follow "
            f"(truncated or padded header)"
        )
    return bytes(header[PREFIX_BYTES:])
