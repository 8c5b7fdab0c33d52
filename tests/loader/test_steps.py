"""The steps of a pass (``loader.steps``), each one job on the lane: a source's failure
sent as an ERROR frame and raised as ``SourceError`` on the receivers, and the early
close (NOTE [ An early close ]): a CLOSE frame both sides agree on, or a desync."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from pass_pairs import Counter, passes

from tensorcast import DesyncError, SourceError


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_failing_source_is_raised_there_and_a_source_error_elsewhere(prefetch: int) -> None:
    source = Counter(5, fail_at=2)
    source_pass, receiver_pass, _ = passes(source, prefetch)
    assert [b["i"] for b in (next(source_pass), next(source_pass))] == [0, 1]
    with pytest.raises(ValueError) as raised:
        next(source_pass)
    assert raised.value is source.error, "the very exception object"
    assert [b["i"] for b in (next(receiver_pass), next(receiver_pass))] == [0, 1]
    with pytest.raises(SourceError, match="source iterator failed: ValueError: shard 3"):
        next(receiver_pass)
    with pytest.raises(StopIteration):
        next(receiver_pass)


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise TypeError("a broken __str__")


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_source_error_that_cannot_be_printed_still_reaches_every_rank(prefetch: int) -> None:
    # its str() raising inside the report used to replace it on the source and send
    # nothing: the receivers' pass ended early (prefetch >= 1) or desynced (prefetch 0)
    source = Counter(5, fail_at=1)
    source.error = _Unprintable()
    source_pass, receiver_pass, _ = passes(source, prefetch)
    assert next(source_pass)["i"] == 0
    with pytest.raises(_Unprintable) as raised:
        next(source_pass)
    assert raised.value is source.error, "the very exception object"
    assert next(receiver_pass)["i"] == 0
    with pytest.raises(SourceError, match=r"failed: _Unprintable: <exception str\(\) failed>"):
        next(receiver_pass)


class _CannotStart:
    def __iter__(self) -> Iterator[dict[str, int]]:
        raise ValueError("shard 3 is corrupt")


@pytest.mark.parametrize(("prefetch", "at"), [(0, "start"), (1, "start"), (0, 1), (1, 1)])
def test_a_failed_pass_is_freed_at_once_not_by_the_garbage_collector(
    prefetch: int, at: object
) -> None:
    # Its failure, raised from the frames of its own traceback, made a cycle: the pass (its
    # groups, a mesh, their process groups) lived until a collection, which a DataLoader
    # worker forked meanwhile ran itself, freeing a process group in the child: a segfault.
    def failing() -> Iterator[dict[str, int]]:
        yield {"i": 0}
        raise ValueError("shard 3 is corrupt")

    source_pass, receiver_pass, _ = passes(_CannotStart() if at == "start" else failing(), prefetch)
    gc.disable()
    try:
        if at != "start":
            assert next(source_pass)["i"] == next(receiver_pass)["i"] == 0
        with pytest.raises(ValueError, match="shard 3"):
            next(source_pass)
        with pytest.raises(SourceError, match="shard 3"):
            next(receiver_pass)
        left = [weakref.ref(source_pass), weakref.ref(receiver_pass)]
        del source_pass, receiver_pass, _
        assert [p() for p in left] == [None, None]
    finally:
        gc.enable()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_pass_left_after_the_same_batch_closes_on_both_sides(prefetch: int) -> None:
    source_pass, receiver_pass, _ = passes(Counter(8), prefetch)
    assert next(source_pass)["i"] == 0
    source_pass.close()
    assert next(receiver_pass)["i"] == 0
    receiver_pass.close()  # expects the CLOSE frame after the steps it owes
    assert receiver_pass._lane.broken is None and source_pass._lane.broken is None


def test_a_receiver_that_goes_on_past_the_source_s_close_is_a_desync() -> None:
    source_pass, receiver_pass, _ = passes(Counter(8), prefetch=0)
    assert next(source_pass)["i"] == 0
    source_pass.close()
    assert next(receiver_pass)["i"] == 0
    with pytest.raises(DesyncError, match="closed the pass at step 1"):
        next(receiver_pass)
    assert receiver_pass._lane.broken is not None, "the lane breaks on a desync"
