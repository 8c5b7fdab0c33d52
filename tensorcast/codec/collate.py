"""``packed_collate``: pack batches inside DataLoader worker processes.

Packing copies every leaf once. Done in a worker, that copy runs in parallel with the
main process, and the packed buffer reaches the main process through shared memory, so
the source broadcasts it without copying it again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import default_collate, default_convert

from tensorcast.codec.encode import check_align, check_trim
from tensorcast.codec.packed import DEFAULT_ALIGN, Packed, pack

__all__ = ["PackedCollate", "packed_collate"]


class PackedCollate:
    """A picklable collate function: ``pack(collate_fn(samples))``.

    Without a ``collate_fn`` it does what a DataLoader does by default: ``default_collate``
    on a list of samples, and ``default_convert`` on anything else, which is a batch the
    dataset already collated (a DataLoader with ``batch_size=None``, as lhotse's samplers
    use, hands the collate function the dataset's item itself).
    """

    def __init__(
        self,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        *,
        align: int = DEFAULT_ALIGN,
        trim: bool = True,
    ) -> None:
        self._default = collate_fn is None
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.align = check_align(align)  # at construction, not in a worker
        self.trim = check_trim(trim)

    def __call__(self, samples: list[Any]) -> Packed:
        if self._default and not isinstance(samples, list):
            return pack(default_convert(samples), align=self.align, trim=self.trim)
        return pack(self.collate_fn(samples), align=self.align, trim=self.trim)

    def __repr__(self) -> str:
        return f"packed_collate({self.collate_fn!r})"


def packed_collate(
    collate_fn: Callable[[list[Any]], Any] | None = None,
    *,
    align: int = DEFAULT_ALIGN,
    trim: bool = True,
) -> PackedCollate:
    """Wrap a collate function so DataLoader workers hand out pre-packed batches.

    Use it on the source rank's DataLoader; ``BroadcastingDataLoader`` (and
    ``broadcast``) accept both pre-packed and plain batches and yield rebuilt trees::

        loader = DataLoader(ds, batch_size=32, num_workers=4,
                            collate_fn=tc.packed_collate(my_collate))

    Under ``batch_size=None`` (lhotse's samplers, whose datasets return whole batches),
    ``tc.packed_collate()`` packs each batch as it comes; a dataset whose batch is a
    ``list`` of tensors there needs ``tc.packed_collate(torch.utils.data.default_convert)``,
    else the list is collated (stacked) as if it were samples.

    Args:
        collate_fn: the collate function to wrap; default ``torch``'s ``default_collate``
            (``default_convert`` for a batch that is not a list).
        align: leaf alignment in the packed buffer.
        trim: store padded leaves without their padding, as ``tc.pack(trim=True)``; the
            workers cannot know where the batch is rebuilt, so they decide as for a host
            (the stricter rule). False stores every leaf whole.
    """
    return PackedCollate(collate_fn, align=align, trim=trim)
