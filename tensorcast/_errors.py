"""Exceptions raised by tensorcast.

The hierarchy::

    RuntimeError
    └── TensorcastError          base of the library's own runtime errors
        ├── SourceError          a receiver learns that the source rank failed
        ├── HeaderError          a header (or frame) is malformed or from another version
        ├── PeerError            a peer rank stopped answering (died, timed out)
        └── DesyncError          ranks disagree on step count or setup

    TypeError
    └── UnsupportedLeafError     a batch holds a leaf tensorcast cannot encode

``UnsupportedLeafError`` is a ``TypeError`` because it is raised for a value of the
wrong type, on the encoding side, before any byte goes on the wire.
"""

from __future__ import annotations

__all__ = [
    "DesyncError",
    "HeaderError",
    "PeerError",
    "SourceError",
    "TensorcastError",
    "UnsupportedLeafError",
    "describe",
]


class TensorcastError(RuntimeError):
    """Base class of the runtime errors raised by tensorcast."""


class SourceError(TensorcastError):
    """Raised on a receiver when the source rank failed to produce or encode a batch.

    The message carries the source's description of the failure, e.g.
    ``source iterator failed: ValueError: bad shard``.
    """


class HeaderError(TensorcastError):
    """Raised when a header or frame is not valid for this format version.

    Raised before any buffer is allocated from the header's sizes.
    """


class PeerError(TensorcastError):
    """Raised when a peer rank stops answering: it died, or a message timed out."""


class DesyncError(TensorcastError):
    """Raised when the source and a receiver disagree on the step or on their setup."""


class UnsupportedLeafError(TypeError):
    """Raised on the encoding side for a leaf that cannot travel.

    The message names the leaf's path in the tree and its type, and says how to fix it.
    """


def describe(error: BaseException) -> str:
    """``error`` in words for a message to peers, ``"ValueError: shard 3 is corrupt"``,
    whatever the exception does: one whose ``str()`` raises (a user's exception with a
    broken ``__str__``) is told by its type, as Python's own traceback tells it, so the
    failure that is reported is never replaced by the one made reporting it."""
    try:
        text = str(error)
    except Exception:
        text = "<exception str() failed>"
    return f"{type(error).__name__}: {text}"
