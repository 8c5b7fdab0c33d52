"""Unit tests of the buffer pool: reuse is safe without any promise from the caller."""

from __future__ import annotations

import torch

from tensorcast._pool import BufferPool

CPU = torch.device("cpu")


def test_a_buffer_is_not_handed_out_while_a_view_of_it_is_alive() -> None:
    pool = BufferPool()
    first = pool.take(100_000, CPU)
    leaf = first[64:128].view(torch.float32)  # what a rebuilt tree would hold
    array = first[256:512].numpy()
    del first
    second = pool.take(100_000, CPU)
    assert second.data_ptr() != leaf.data_ptr() - 64
    del leaf, second
    third = pool.take(100_000, CPU)  # the numpy view still pins the first buffer
    assert not (third.data_ptr() <= array.ctypes.data < third.data_ptr() + 100_000)


def test_a_buffer_is_reused_once_nothing_views_it() -> None:
    pool = BufferPool()
    first = pool.take(100_000, CPU)
    address = first.data_ptr()
    del first
    assert pool.take(90_000, CPU).data_ptr() == address


def test_a_small_request_does_not_take_a_much_larger_buffer() -> None:
    pool = BufferPool()
    big = pool.take(1 << 20, CPU)
    address = big.data_ptr()
    del big
    assert pool.take(1000, CPU).data_ptr() != address


def test_idle_buffers_not_reused_lately_are_dropped_but_busy_ones_stay() -> None:
    pool = BufferPool()
    rare = pool.take(10 << 20, CPU)
    del rare
    held = pool.take(5 << 20, CPU)
    for _ in range(100):
        pool.take(5000, CPU)
    capacities = sorted(e.capacity for e in pool._buffers[(CPU, False)])
    assert max(capacities) < 10 << 20  # the rare 10 MiB buffer is gone
    assert any(c >= 5 << 20 for c in capacities)  # the held one is still tracked
    del held


def test_slices_are_exactly_the_requested_size() -> None:
    pool = BufferPool()
    for n in (0, 1, 4095, 4096, 4097, 123_456):
        t = pool.take(n, CPU)
        assert t.dtype == torch.uint8 and t.dim() == 1 and t.numel() == n
