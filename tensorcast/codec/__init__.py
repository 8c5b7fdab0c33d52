"""The codec: a batch tree <-> a header and ONE packed, aligned buffer. No process group.

Packing runs top to bottom through one module a step::

    tree --flatten--> tokens (structure) + small values + buffer leaves
         --layout--> each leaf at an aligned offset; the structure encoded once
         --plan--> an encoded batch: its header (schema + framing) and a write into any buffer
    header --schema (decode, validate before allocating)--> leaf table
           --views--> the buffer seen as leaves --build (+ values)--> tree

A batch tree is flattened in preorder, without recursion, into JSON-able *tokens* (its
structure), its small *values* (ints, floats, strings, ... in preorder) and the *buffer
leaves* whose bytes go into the buffer. The structure and the values travel apart
because a loader's batches repeat their structure while their values change: the
structure is laid out, encoded, validated and compiled once, the values anew each step.
``docs/format.md`` is the byte specification of the header and of both grammars.

``packed`` holds the public entry points (``pack``, ``unpack``, ``read_header``,
``Packed``); ``collate`` the DataLoader-worker path (``packed_collate``); ``registry`` and
``lhotse_cuts`` the types that travel as containers. Nothing in this package imports the
transport or the loader (``make lint`` checks it).
"""
