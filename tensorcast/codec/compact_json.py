"""JSON as headers use it: compact and ASCII, with no whitespace.

Reading is the C scanner's work alone; the small values, encoded anew on every step, get
a C encoder made once.
"""

from __future__ import annotations

import json
import json.scanner
from collections.abc import Callable
from typing import Any

__all__ = ["dumps", "scan", "values_encoder"]

dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, check_circular=False).encode

# One JSON value from the start of a string, and where it ends: what json.loads does
# without its whitespace skipping (headers hold none) and its Python-level wrappers.
scan: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(
    json.JSONDecoder()  # type: ignore[arg-type]  # typeshed types it as its own class
)


def values_encoder() -> Callable[[list[Any]], str]:
    """:data:`dumps` for the small values, which are encoded on every step: the C encoder
    made once instead of per call (``JSONEncoder.encode`` builds one each time, a cost a
    small batch's step feels; see ``docs/design.md``, "A small frame's path runs cold"). Checked against ``dumps`` here; any
    Python without it, or with another signature, gets ``dumps`` itself."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return dumps

    def unsupported(obj: Any) -> Any:
        raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")

    try:
        chunks = make(
            None,  # markers: the values hold no cycles
            unsupported,  # default
            json.encoder.encode_basestring_ascii,
            None,  # indent
            ":",  # key separator
            ",",  # item separator
            False,  # sort_keys
            False,  # skipkeys
            True,  # allow_nan
        )
        sample: list[Any] = [
            ["i", -(1 << 63)],
            ["f", 1 << 64],
            'a\u00e9\\"',
            None,
            True,
            False,
            [[]],
        ]
        if "".join(chunks(sample, 0)) != dumps(sample):
            return dumps
    except (TypeError, ValueError):
        return dumps

    def encode(values: list[Any]) -> str:
        return "".join(chunks(values, 0))

    return encode
