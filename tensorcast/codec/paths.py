"""Where a leaf sits in a batch tree, as errors and :class:`~tensorcast.LeafSpec` say it.

A path is a chain of ``(parent, key, style)`` tuples, built as the tree is read and
rendered only when someone asks (an error, ``read_header``): rendering every leaf's path
would cost allocations on every node.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Path", "render_path"]

# style 0: [key]   style 1: .field   style 2: <codec name>
# Chains built while compiling a header carry their depth as a fourth item.
Path = tuple[Any, ...] | None

_MAX_PATH_PARTS = 64
_MAX_PATH_CHARS = 1024  # then no more parts
_LONG_INT_BITS = 1024  # keys past this many bits are shown by their size
_LONG_KEY = 64  # str keys past this many characters are shown by their start


def render_path(path: Path, root: str = "") -> str:
    """Render a path chain as ``root['audio'][2].field``.

    Deep paths keep their last 64 parts (``root…(9,936 levels)…[0][0]``), or as many as
    fill about 1 KiB, and a long key shows its start and its length, so describing a
    header never costs more than a bounded amount per leaf.
    """
    parts: list[str] = []
    chars = 0
    while path is not None and len(parts) < _MAX_PATH_PARTS and chars < _MAX_PATH_CHARS:
        path, key, style = path[0], path[1], path[2]
        part = f"[{_key(key)}]" if style == 0 else f".{key}" if style == 1 else f"<{key}>"
        parts.append(part)
        chars += len(part)
    if path is not None:
        # Chains built while compiling carry their depth; others are counted once.
        if len(path) > 3:
            hidden = path[3]
        else:
            hidden = 0
            while path is not None:
                path, hidden = path[0], hidden + 1
        parts.append(f"…({hidden:,} levels)…")
    return root + "".join(reversed(parts))


def _key(key: Any) -> str:
    """A key as a path shows it: its repr, but an int too long for one (Python refuses
    to write ints of over 4,300 digits) by its size, and a long str by its start."""
    if type(key) is int and key.bit_length() > _LONG_INT_BITS:
        return f"<int of {key.bit_length():,} bits>"
    if type(key) is str and len(key) > _LONG_KEY:
        return f"{key[:_LONG_KEY]!r}…<{len(key):,} chars>"
    return repr(key)
