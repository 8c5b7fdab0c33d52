"""Unit tests of the buffer pool: reuse is safe without any promise from the caller."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Callable

import torch

from tensorcast.codec import Encoder, KeptViews
from tensorcast.transport.pool import BufferPool, FramePool, Keeper

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


def test_a_storage_object_kept_alone_keeps_its_buffer() -> None:
    """``t.untyped_storage()`` is the very object the pool keeps (torch hands out one
    while it lives): kept after ``t``, it adds no use count, yet it sees the bytes."""
    pool = BufferPool()
    first = pool.take(100_000, CPU).fill_(7)
    kept = first.untyped_storage()
    address = first.data_ptr()
    del first
    second = pool.take(90_000, CPU).fill_(1)
    assert second.data_ptr() != address
    assert set(torch.empty(0, dtype=torch.uint8).set_(kept)[:100_000].tolist()) == {7}
    del kept
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
    capacities = sorted(e.capacity for e in pool._buffers[CPU])
    assert max(capacities) < 10 << 20  # the rare 10 MiB buffer is gone
    assert any(c >= 5 << 20 for c in capacities)  # the held one is still tracked
    del held


def test_slices_are_exactly_the_requested_size() -> None:
    pool = BufferPool()
    for n in (0, 1, 4095, 4096, 4097, 123_456):
        t = pool.take(n, CPU)
        assert t.dtype == torch.uint8 and t.dim() == 1 and t.numel() == n


def _viewed(
    kept: Keeper | KeptViews,
    buffer: torch.Tensor,
    key: str,
    make: Callable[[torch.Tensor], list[torch.Tensor]],
) -> list[torch.Tensor]:
    """The views a rebuild hands out for ``buffer``, asked as the codec asks (a role's
    ``Keeper``, or the memory's own ``KeptViews``)."""
    if isinstance(kept, Keeper):
        found, _ = kept.memory(buffer, [])
        if found is None:
            return make(buffer)
        kept = found
    views = kept.views(key)
    return kept.keep(key, make(buffer)) if views is None else views


def _output(kept: Keeper, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The memory ``kept`` hands out to re-pad one trimmed leaf into."""
    _, (out,) = kept.memory(torch.empty(0, dtype=torch.uint8), [(shape, dtype)])
    return out


def _as_floats(buffer: torch.Tensor) -> list[torch.Tensor]:
    return [buffer[i * 64 : i * 64 + 16].view(torch.float32) for i in range(3)]


def test_views_kept_for_a_buffer_are_handed_out_fresh_and_do_not_pin_it() -> None:
    """Kept views come back as new tensors on the same bytes; while the caller holds any,
    the buffer stays out of the pool; once it drops them, the buffer is reused, views
    and all."""
    pool = BufferPool()
    buffer = pool.take(100_000, CPU)
    address = buffer.data_ptr()
    first = _viewed(pool.keeper, buffer, "layout", _as_floats)
    first[1].fill_(2.0)
    again = _viewed(pool.keeper, buffer, "layout", _as_floats)
    assert all(a is not b and a.data_ptr() == b.data_ptr() for a, b in zip(first, again))
    assert again[1].tolist() == [2.0] * 4
    again[1].resize_(1)  # a caller's own metadata change stays with its tensor
    assert _viewed(pool.keeper, buffer, "layout", _as_floats)[1].shape == (4,)
    del buffer, again
    assert pool.take(100_000, CPU).data_ptr() != address  # `first` still views it
    del first
    both = [pool.take(100_000, CPU) for _ in range(2)]
    (reused,) = [b for b in both if b.data_ptr() == address]
    del both
    made: list[int] = []

    def count(buffer: torch.Tensor) -> list[torch.Tensor]:
        made.append(1)
        return _as_floats(buffer)

    _viewed(pool.keeper, reused, "layout", count)
    _viewed(pool.keeper, reused, "other layout", count)
    _viewed(pool.keeper, reused, "other layout", count)
    assert len(made) == 1  # kept across takes; made again only for a new key
    del reused
    assert address in [pool.take(100_000, CPU).data_ptr() for _ in range(2)]


def test_views_of_a_buffer_from_elsewhere_are_made_each_time() -> None:
    pool = BufferPool()
    outside = torch.zeros(4096, dtype=torch.uint8)
    one, two = (
        _viewed(pool.keeper, outside, "k", _as_floats),
        _viewed(pool.keeper, outside, "k", _as_floats),
    )
    assert one[0] is not two[0] and one[0].data_ptr() == two[0].data_ptr()


# -- first messages ------------------------------------------------------------------------


def test_a_first_message_is_reused_only_once_nothing_made_from_it_is_alive() -> None:
    frames = FramePool()
    message = frames.take(4096)
    assert message.buffer.numel() == 4096 and message.host.shape == (4096,)
    leaf = _viewed(message.kept, message.buffer[4032:4048], "layout", _as_floats)[0]
    assert frames.take(4096) is not message  # the leaf views its bytes
    del leaf
    assert frames.take(4096) is message  # kept views do not count


def test_a_first_message_hands_out_fresh_tensors_on_its_kept_views() -> None:
    message = FramePool().take(4096)
    payload = message.buffer[0:4096]
    first = _viewed(message.kept, payload, "layout", _as_floats)
    again = _viewed(message.kept, payload, "layout", _as_floats)
    assert all(a is not b and a.data_ptr() == b.data_ptr() for a, b in zip(first, again))
    other = _viewed(message.kept, payload, "another layout", lambda b: [b[:8]])
    assert len(other) == 1
    del first, again, other, payload  # a slice of the buffer holds it too, while alive
    assert message.is_idle()


def test_views_detached_ahead_are_the_next_views_of_that_key_and_else_dropped() -> None:
    """What a rank makes while a head is on the wire: handed out by the next ``views`` of
    the kept key (fresh tensors, made once), dropped for another key or by ``drop_ahead``;
    held by the message, they do not make it look busy."""
    message = FramePool().take(4096)

    def payload() -> torch.Tensor:  # the slice a frame views, alive only while it is read
        return message.buffer[0:4096]

    message.kept.detach_ahead()  # nothing kept yet: nothing to make
    assert message.kept.ahead is None
    first = _viewed(message.kept, payload(), "layout", _as_floats)
    del first
    message.kept.detach_ahead()
    assert message.kept.ahead and message.is_idle()
    made = [id(t) for t in message.kept.ahead]
    again = _viewed(message.kept, payload(), "layout", _as_floats)
    assert [id(t) for t in again] == made and message.kept.ahead is None
    assert again[0].data_ptr() == message.buffer.data_ptr()
    assert not message.is_idle()  # handed out: the caller holds them
    message.kept.detach_ahead()
    other = _viewed(message.kept, payload(), "another layout", lambda b: [b[:8]])
    assert len(other) == 1 and message.kept.ahead is None  # the layout changed: made anew
    message.kept.detach_ahead()
    message.kept.drop_ahead()
    del again, other
    assert message.is_idle()


def test_a_first_message_a_tree_was_built_on_is_idle_once_the_tree_is_dropped() -> None:
    """The codec's views of a payload slice (strided views of typed views of it) are kept
    detached: nothing kept holds the slice itself, so the message is taken again, and so
    is the memory a trimmed leaf was re-padded into."""
    keeper = Keeper()
    frames = FramePool(keeper=keeper)
    audio = torch.zeros(8, 64_000)
    audio[:, :1000] = 1.0  # rows that end in zeros: trimmed
    coded = Encoder().encode({"x": torch.arange(16.0), "n": torch.ones(3).long(), "a": audio})
    assert coded.trims  # the audio leaf travels trimmed
    taken = set()
    for _ in range(3):
        message = frames.take(coded.nbytes + 4096)
        tree, repads = coded.write_tree(message.buffer[64 : 64 + coded.nbytes], keeper)
        for run in repads:
            run()
        del run
        assert torch.equal(tree["a"], audio) and torch.equal(tree["x"], torch.arange(16.0))
        taken.add((id(message), tree["a"].data_ptr()))
        assert not message.is_idle()  # the tree views it: never handed out under it
        assert frames.take(coded.nbytes + 4096) is not message
        del tree, repads
        assert message.is_idle()
    assert len(taken) == 1


def test_first_messages_of_an_outgrown_capacity_are_dropped_once_idle() -> None:
    frames = FramePool()
    small = frames.take(4096)
    held = _viewed(small.kept, small.buffer[0:64], "layout", lambda b: [b[:8]])
    big = frames.take(8192)
    assert big.capacity == 8192
    assert small in frames._messages  # still viewed: kept until its user lets go
    del held
    frames.take(16384)
    assert small not in frames._messages


def test_the_frame_pool_forgets_its_oldest_buffer_beyond_its_bound() -> None:
    frames = FramePool(max_buffers=2)
    held = []
    for _ in range(4):
        message = frames.take(4096)
        held.append(_viewed(message.kept, message.buffer[0:64], "layout", lambda b: [b[:8]]))
    assert len(frames._messages) == 2


def test_a_first_message_keeps_its_inline_payloads_slice_without_looking_busy() -> None:
    frames = FramePool()
    message = frames.take(4096)
    first = message.inline_payload(64, 100)
    assert message.inline_payload(64, 100) is first  # the same cut: no slice made
    leaf = first[:8].view(torch.float32)  # what a tree made from it holds
    assert not message.is_idle()
    del first, leaf
    assert message.is_idle() and frames.take(4096) is message  # the kept slice is its own
    other = message.inline_payload(128, 50)
    assert other.data_ptr() == message.buffer.data_ptr() + 128 and other.numel() == 50
    del other
    assert message.is_idle()


def test_a_buffer_shared_with_another_process_is_never_written_again() -> None:
    """``share_memory_()`` (what a torch.multiprocessing queue does to what it sends) moves
    a storage's bytes and leaves it mapped by the consumer, whose references the use count
    never sees: the buffer is forgotten, not reused (NOTE [ Memory handed out ])."""
    pool = BufferPool()
    leaf = pool.take(100_000, CPU)[64:128]
    storage = leaf.untyped_storage()
    leaf.share_memory_()
    moved = storage.data_ptr()
    del leaf, storage
    again = pool.take(100_000, CPU)
    assert again.data_ptr() != moved
    del again
    for _ in range(70):
        pool.take(100_000, CPU)
    assert len(pool._buffers[CPU]) == 1, "the shared buffer is forgotten once stale"


def test_a_first_message_keeps_no_pointer_its_bytes_moved_from() -> None:
    pool = FramePool()
    message = pool.take(4096)
    payload = message.inline_payload(1024, 64)
    old = message.host.ctypes.data
    payload.share_memory_()  # the caller shares a leaf of an inline payload
    assert message.buffer.data_ptr() != old  # the message's views point at freed bytes:
    assert message.is_gone() and not message.is_idle()  # it is never taken again
    del payload
    assert pool.take(4096) is not message


def test_reusable_is_the_rule_other_pools_call() -> None:
    from tensorcast.transport.pool import reusable

    buffer = torch.empty(4096, dtype=torch.uint8)
    storage = buffer.untyped_storage()
    held = int(torch._C._storage_Use_Count(storage._cdata))
    refs = sys.getrefcount(storage)
    pointer = storage.data_ptr()

    def idle() -> bool:  # each count read in a statement of its own, in frames alike
        counted = sys.getrefcount(storage)
        return reusable(storage, pointer, held, refs, counted)

    assert idle()
    view = buffer[10:20]
    assert not idle()
    del view
    also = storage  # the storage object kept elsewhere
    assert not idle()
    del also
    seen = weakref.ref(storage)  # a weak reference sees it too, while it lives
    assert not idle()
    del seen
    assert idle()
    storage.share_memory_()
    assert not idle()  # moved
    pointer = storage.data_ptr()
    assert not idle()  # shared


def test_a_weak_reference_to_a_storage_keeps_its_buffer_busy() -> None:
    pool = BufferPool()
    first = pool.take(100_000, CPU)
    first.fill_(7)
    seen = weakref.ref(first.untyped_storage())
    del first
    pool.take(100_000, CPU).fill_(9)  # not into the buffer the weak reference still sees
    storage = seen()
    assert storage is not None
    assert torch.empty(0, dtype=torch.uint8).set_(storage)[:100_000].eq(7).all()
    del storage, seen
    gc.collect()


def test_kept_outputs_reuse_memory_the_caller_let_go_of() -> None:
    kept = Keeper(max_outputs=2)
    a = _output(kept, (4, 5), torch.float32)
    b = _output(kept, (4, 5), torch.float32)
    assert a.data_ptr() != b.data_ptr()
    ptr = a.data_ptr()
    del a
    c = _output(kept, (4, 5), torch.float32)
    assert c.data_ptr() == ptr  # reused: the caller dropped it
    d = _output(kept, (4, 5), torch.float32)
    assert d.data_ptr() not in (ptr, b.data_ptr())  # both held: fresh memory


def test_kept_outputs_are_reused_by_size_whatever_the_shape() -> None:
    """Batches whose shapes change every step reuse the memory of their rebuilt leaves:
    it is taken by size, and one piece serves a leaf of another shape and dtype."""
    kept = Keeper(max_outputs=2)
    a = _output(kept, (64, 1000), torch.float32)
    ptr = a.data_ptr()
    del a
    b = _output(kept, (60, 1050), torch.int32)  # 252_000 bytes: the same size class
    assert b.data_ptr() == ptr and b.shape == (60, 1050) and b.is_contiguous()
