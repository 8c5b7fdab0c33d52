"""Unit tests of ``codec.views``: a buffer seen as a layout's leaves, and the views kept
for a piece of memory (NOTE [ Views made ahead ])."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tensorcast import HeaderError
from tensorcast.codec import KeptViews
from tensorcast.codec.views import ViewSpec

_TABLE = [["tensor", "F32", [4], 0, 16], ["tensor", "I64", [2], 16, 16]]


def _uses(buffer: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(buffer.untyped_storage()._cdata))


def test_kept_views_follow_their_state_table() -> None:
    """The law of the table: ``held`` is the references the kept views and the copies
    made ahead hold, no more; ``views`` of the kept key hands out the copies made ahead
    (once), else fresh tensors; another key is None until it is kept."""
    buffer = torch.zeros(64, dtype=torch.uint8)
    spec = ViewSpec(_TABLE)
    kept = KeptViews()
    base = _uses(buffer)
    assert kept.views("a") is None and kept.held == 0
    handed = kept.keep("a", spec.tensor_views(buffer))
    assert kept.held == 2 and _uses(buffer) == base + 2 + len(handed)
    del handed
    assert _uses(buffer) == base + kept.held
    kept.detach_ahead()
    ahead = list(kept.ahead or ())
    assert kept.held == 4 and _uses(buffer) == base + 4
    again = kept.views("a")
    assert again is not None and [id(t) for t in again] == [id(t) for t in ahead]
    assert kept.ahead is None and kept.held == 2
    del again, ahead
    assert kept.views("b") is None and kept.held == 2  # asked only: nothing dropped
    kept.detach_ahead()
    kept.keep("b", spec.tensor_views(buffer)[:1])
    assert kept.ahead is None and kept.held == 1 and _uses(buffer) == base + 1
    kept.detach_ahead()
    kept.drop_ahead()
    assert kept.held == 1 and _uses(buffer) == base + 1


class _Reuses:
    """A ``Reuses`` that keeps views for one buffer and hands out memory it counts."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.kept, self.asked = buffer, KeptViews(), 0
        self.wanted: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.fail: BaseException | None = None

    def memory(
        self, buffer: torch.Tensor, outputs: Sequence[tuple[tuple[int, ...], torch.dtype]]
    ) -> tuple[KeptViews | None, list[torch.Tensor]]:
        self.asked += 1
        self.wanted = list(outputs)
        if self.fail is not None and outputs:
            raise self.fail
        mine = buffer.untyped_storage()._cdata == self.buffer.untyped_storage()._cdata
        return (self.kept if mine else None), [torch.full(s, 7, dtype=d) for s, d in outputs]


def test_a_tree_asks_its_reuses_once_and_gets_its_views_again() -> None:
    """One ``memory`` call per tree, kept views or not, with the trimmed tensor leaves'
    memory by leaf index; the views of a kept buffer are made once per key."""
    buffer = torch.arange(64, dtype=torch.uint8)
    table = [*_TABLE, ["tensor", "F32", [2, 3], 32, 8]]
    spec = ViewSpec(table, trimmed={2})
    assert spec.outputs == [(2, (2, 3), torch.float32)]
    reuse = _Reuses(buffer)
    first, memory = spec.leaves(buffer, reuse)
    assert reuse.asked == 1 and list(memory) == [2] and memory[2].shape == (2, 3)
    assert first[2] is None and first[0].data_ptr() == buffer.data_ptr()
    kept = list(reuse.kept.kept)
    again, _ = spec.leaves(buffer, reuse)
    assert reuse.asked == 2 and all(a is b for a, b in zip(reuse.kept.kept, kept, strict=True))
    assert all(a is not b and a.data_ptr() == b.data_ptr() for a, b in zip(first[:2], again))
    other = torch.zeros(64, dtype=torch.uint8)
    views, _ = spec.kept_views(other, reuse)
    assert all(a is b for a, b in zip(reuse.kept.kept, kept, strict=True))
    assert views[0].data_ptr() == other.data_ptr()
    _, none = spec.kept_views(torch.empty(64, dtype=torch.uint8, device="meta"), reuse)
    assert reuse.wanted == [] and dict(none) == {}  # no host memory for a device's leaves
    plain, none = ViewSpec(_TABLE).leaves(buffer, None)
    assert dict(none) == {} and [t.tolist() for t in plain] == [t.tolist() for t in first[:2]]


def test_trimmed_leaves_whose_memory_cannot_be_had_are_a_header_error() -> None:
    """As a re-pad's own allocation: out of memory is a HeaderError naming the leaves."""
    buffer = torch.zeros(64, dtype=torch.uint8)
    reuse = _Reuses(buffer)
    reuse.fail = MemoryError("no room")
    spec = ViewSpec([*_TABLE, ["tensor", "F32", [2, 3], 32, 8]], trimmed={2})
    with pytest.raises(
        HeaderError, match=r"trimmed leaves 2 \(torch.float32 of shape \[2, 3\]\).*no room"
    ):
        spec.leaves(buffer, reuse)
