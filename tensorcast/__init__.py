"""tensorcast: hand a training batch from one rank to its TP/CP peers, tensor-natively.

The source flattens each batch tree into a small header (structure, dtypes, shapes,
small values) and ONE packed, aligned buffer, broadcasts both on the flattened
``(cp, tp)`` group, and every other rank rebuilds the tree as views into the buffer.
Nothing is pickled: receivers never execute bytes from the wire.
"""

from __future__ import annotations

from tensorcast._errors import (
    DesyncError,
    HeaderError,
    PeerError,
    SourceError,
    TensorcastError,
    UnsupportedLeafError,
)
from tensorcast.codec.collate import packed_collate
from tensorcast.codec.packed import Packed, pack, read_header, unpack
from tensorcast.codec.registry import register_type
from tensorcast.codec.schema import FORMAT_VERSION, LeafSpec, Schema
from tensorcast.loader.broadcast import broadcast, broadcast_batch
from tensorcast.loader.dataloader import BroadcastingDataLoader
from tensorcast.loader.mesh import dp_rank_and_size, is_dp_source_rank
from tensorcast.loader.stats import LoaderStats, Timings

__version__ = "0.2.0"

__all__ = [
    "FORMAT_VERSION",
    "BroadcastingDataLoader",
    "DesyncError",
    "HeaderError",
    "LeafSpec",
    "LoaderStats",
    "Packed",
    "PeerError",
    "Schema",
    "SourceError",
    "TensorcastError",
    "Timings",
    "UnsupportedLeafError",
    "broadcast",
    "broadcast_batch",
    "dp_rank_and_size",
    "is_dp_source_rank",
    "pack",
    "packed_collate",
    "read_header",
    "register_type",
    "unpack",
]
