"""The codec: a batch tree <-> a header and ONE packed, aligned buffer. No process group.

Packing runs top to bottom through one module a step::

    tree --flatten--> tokens (structure) + small values + buffer leaves
         --layout--> each leaf at an aligned offset; the structure encoded once
         --encode--> an encoded batch: its header (schema) and a write into any buffer
    header --decode (schema: validated before allocating)--> a decoded header
           --decode.leaf_views--> the buffer seen as leaves --build--> tree

A batch tree is flattened in preorder, without recursion, into JSON-able *tokens* (its
structure), its small *values* (ints, floats, strings, ... in preorder) and the *buffer
leaves* whose bytes go into the buffer. The structure and the values travel apart
because a loader's batches repeat their structure while their values change: the
structure is laid out, encoded, validated and compiled once, the values anew each step.
``docs/format.md`` is the byte specification of the header; NOTE [ The token and value
grammar ] below is the grammar of its tokens and values.

``packed`` holds the public entry points (``pack``, ``unpack``, ``read_header``,
``Packed``); ``collate`` the DataLoader-worker path (``packed_collate``); ``registry`` and
``lhotse_cuts`` the types that travel as containers. Nothing in this package imports the
transport or the loader, and they import this face alone, never an inner module (``make
lint`` checks both): an :class:`Encoder` and the :class:`Encoded` batches it makes on the
source, :func:`decode` and the :class:`Decoded` header it returns on the receivers
(and a :class:`Repad`, a trimmed leaf's re-pad the transport runs where it pays); the
:class:`Reuses` the transport's pools are to the codec, and the :class:`KeptViews` they
keep for each piece of memory; and,
for the bench, :func:`padding_bytes`, what trimming a leaf would drop.
"""

# NOTE [ The token and value grammar ]
# A header's body (``codec.schema``) carries the tree as two flat JSON lists: its structure,
# ``tokens``, one token per node in preorder, and its small values, ``values``, one per
# ``null`` token, in the same order. ``codec.flatten`` writes them; ``codec.build`` reads
# them and validates every one (anything else is a HeaderError).
#
# Tokens:
#   7                     buffer leaf 7, row 7 of the leaf table (a bare int, never a
#                         bool); every row is referenced exactly once
#   null                  the next small value
#   ["l", n]  ["t", n]    a list / tuple of the next n subtrees
#   ["d", n, keys]        a dict of the next n subtrees; keys: n key tokens, distinct once
#                         decoded, each a str, an int in the signed 64-bit range, a bool,
#                         null, or ["I", hex] for any other int; at most 16 of one hash
#                         (NOTE [ Keys that share a hash ] in ``codec.build``)
#   ["o", n, keys]        a collections.OrderedDict, its keys as for "d"
#   ["r", name, fields]   a registered NamedTuple / dataclass: one subtree per field, the
#                         fields as both sides registered them
#   ["x", name]           a type with a registered codec (lhotse cuts): the next subtree is
#                         its to_tree()
#
# Values:
#   null  true  false     None, True, False
#   "text"                a str of at most INLINE_LIMIT (``codec.flatten``, 1024)
#                         characters; a longer one is a "str" buffer leaf (UTF-8)
#   ["i", 5]              an int in the signed 64-bit range
#   ["I", "-0x1f"]        any other int, as Python's hex() writes it
#   ["f", bits]           a float: its IEEE-754 binary64 bits, as an unsigned int
#   ["c", re, im]         a complex: the bits of both parts, as for "f"
#   ["y", "00ff"]         bytes of at most INLINE_LIMIT, hex; longer ones are a "bytes"
#                         buffer leaf
#   ["s", "F32", "00ff"]  a numpy scalar: its dtype code and its bytes, hex (a bool's: 00
#                         or 01)
#   ["S", "U", text]      a numpy.str_;   ["S", "S", "00ff"]: a numpy.bytes_, hex

from __future__ import annotations

from tensorcast.codec.decode import Decoded, decode
from tensorcast.codec.encode import Encoded, Encoder, check_trim
from tensorcast.codec.packed import Packed, resolve_device, unpack
from tensorcast.codec.repad import Repad
from tensorcast.codec.schema import FORMAT_VERSION, MAX_HEADER_BYTES, PREFIX_BYTES
from tensorcast.codec.trim import padding_bytes
from tensorcast.codec.views import KeptViews, Reuses

__all__ = [
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "PREFIX_BYTES",
    "Decoded",
    "Encoded",
    "Encoder",
    "KeptViews",
    "Packed",
    "Repad",
    "Reuses",
    "check_trim",
    "decode",
    "padding_bytes",
    "resolve_device",
    "unpack",
]
