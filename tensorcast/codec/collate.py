"""``packed_collate``: pack batches inside DataLoader worker processes.

Packing copies every leaf once. Done in a worker, that copy runs in parallel with the
main process, and the packed buffer reaches the main process through shared memory, so
the source broadcasts it without copying it again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import default_collate

from tensorcast.codec.packed import DEFAULT_ALIGN, Packed, pack

__all__ = ["PackedCollate", "packed_collate"]


class PackedCollate:
    """A picklable collate function: ``pack(collate_fn(samples))``."""

    def __init__(
        self, collate_fn: Callable[[list[Any]], Any] | None = None, *, align: int = DEFAULT_ALIGN
    ) -> None:
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.align = align

    def __call__(self, samples: list[Any]) -> Packed:
        return pack(self.collate_fn(samples), align=self.align)

    def __repr__(self) -> str:
        return f"packed_collate({self.collate_fn!r})"


def packed_collate(
    collate_fn: Callable[[list[Any]], Any] | None = None, *, align: int = DEFAULT_ALIGN
) -> PackedCollate:
    """Wrap a collate function so DataLoader workers hand out pre-packed batches.

    Use it on the source rank's DataLoader; ``BroadcastingDataLoader`` (and
    ``broadcast``) accept both pre-packed and plain batches and yield rebuilt trees::

        loader = DataLoader(ds, batch_size=32, num_workers=4,
                            collate_fn=tc.packed_collate(my_collate))

    Args:
        collate_fn: the collate function to wrap; default ``torch``'s ``default_collate``.
        align: leaf alignment in the packed buffer.
    """
    return PackedCollate(collate_fn, align=align)
