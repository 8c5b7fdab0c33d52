"""Tree <-> token list: the structural half of the codec.

A batch tree is flattened (``_flatten``), in preorder and without recursion (any nesting
depth works), into a flat list of JSON-able *tokens* (its structure), the list of its
small *values*, and the list of *buffer leaves* whose bytes go into the packed buffer.
The rebuild (``_build``) compiles the same tokens into a program and runs it; the values
are decoded by ``_values``.

The structure and the values are apart because batches of one loader repeat their
structure while their values change (step numbers, ids): the structure is then laid
out, encoded, validated and compiled once, and only the values travel anew.

Tokens::

    7                    buffer leaf number 7 (a bare int; never a bool)
    null                 the next small value
    ["l", n] ["t", n]    list / tuple of the next n subtrees
    ["d", n, keys]       dict; keys are str, int, bool, null or ["I", hex]
    ["o", n, keys]       collections.OrderedDict
    ["r", name, fields]  a registered NamedTuple / dataclass; one subtree per field
    ["x", name]          a registered codec type; the next subtree is its to_tree()

Values, in preorder::

    null / true / false  None / True / False
    "text"               a str leaf (short ones; long ones are buffer leaves)
    ["i", 5]             int that fits in 64 bits     ["I", "-0x1f..."] any other int
    ["f", bits]          float, its IEEE-754 bits     ["c", re_bits, im_bits] complex
    ["y", "00ff"]        short bytes, hex
    ["s", "F32", "hex"]  numpy scalar                 ["S", "U", text] / ["S", "S", hex]

Nothing here knows about byte layouts or process groups. This module gathers the names
of both directions, for the modules that use the token format as a whole.
"""

from __future__ import annotations

from tensorcast._build import Program, compile_tokens, run
from tensorcast._flatten import INLINE_LIMIT, BufferLeaf, flatten
from tensorcast._paths import Path, render_path
from tensorcast._values import decode_values

__all__ = [
    "INLINE_LIMIT",
    "BufferLeaf",
    "Path",
    "Program",
    "compile_tokens",
    "decode_values",
    "flatten",
    "render_path",
    "run",
]
