"""A header's small values and dict keys, decoded from their tokens and validated.

The tokens are those ``codec.flatten`` writes (``_tree`` lists them); a peer may send
anything, so each one is checked and an invalid one is a :class:`HeaderError`.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from tensorcast._errors import HeaderError
from tensorcast.codec.dtypes import NUMPY_CODES

__all__ = ["decode_key", "decode_values"]

_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")


def decode_values(values: Any) -> list[Any]:
    """The small values of a header, decoded and validated.

    Raises:
        HeaderError: ``values`` is not a list of value tokens.
    """
    if type(values) is not list:
        raise HeaderError("the header's small values are not a list")
    out = values[:]
    for i, tok in enumerate(values):
        t = type(tok)
        if t is list:
            out[i] = _decode_small(tok)
        elif not (t is str or tok is None or t is bool):
            raise HeaderError(f"invalid value token {tok!r:.80} at position {i}")
    return out


def decode_key(key: Any) -> Any:
    """A dict key from its token.

    Raises:
        HeaderError: ``key`` is not a key token.
    """
    t = type(key)
    if t is str or t is int or t is bool or key is None:
        return key
    if t is list and len(key) == 2 and key[0] == "I" and type(key[1]) is str:
        return _parse_big_int(key[1])
    raise HeaderError(f"invalid dict key token {key!r:.80}")


def _decode_small(tok: list[Any]) -> Any:
    """Decode a small-value token that is a list."""
    if not tok:
        raise HeaderError("invalid value token []")
    tag = tok[0]
    n = len(tok)
    if tag == "i" and n == 2 and type(tok[1]) is int:
        return tok[1]
    if tag == "f" and n == 2:
        return _bits_to_float(tok[1])
    if tag == "I" and n == 2 and type(tok[1]) is str:
        return _parse_big_int(tok[1])
    if tag == "c" and n == 3:
        return complex(_bits_to_float(tok[1]), _bits_to_float(tok[2]))
    if tag == "y" and n == 2:
        return _fromhex(tok[1])
    if tag == "s" and n == 3 and type(tok[1]) is str:
        dtype = NUMPY_CODES.get(tok[1])
        data = _fromhex(tok[2])
        if dtype is None or len(data) != dtype.itemsize:
            raise HeaderError(f"invalid numpy scalar token {tok!r:.80}")
        return np.frombuffer(data, dtype=dtype)[0]
    if tag == "S" and n == 3:
        if tok[1] == "U" and type(tok[2]) is str:
            return np.str_(tok[2])
        if tok[1] == "S":
            return np.bytes_(_fromhex(tok[2]))
    raise HeaderError(f"invalid token {tok!r:.80}")


def _parse_big_int(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        raise HeaderError(f"invalid big-int token {text!r:.80}") from None


def _bits_to_float(bits: Any) -> float:
    if type(bits) is not int or not 0 <= bits <= 0xFFFF_FFFF_FFFF_FFFF:
        raise HeaderError(f"invalid float bits {bits!r:.80}")
    return float(_F64.unpack(_U64.pack(bits))[0])


def _fromhex(text: Any) -> bytes:
    if type(text) is not str:
        raise HeaderError(f"expected a hex string, found {type(text).__name__}")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise HeaderError(f"invalid hex string {text!r:.80}") from None
