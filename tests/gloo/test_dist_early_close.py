"""Ranks that leave a loader's pass after different batches fail loudly, in bounded time,
on every rank (NOTE [ Where a pass ends ] in ``tensorcast/loader/passes.py``, NOTE [ An
early close ] in ``tensorcast/loader/steps.py``).

Two gloo ranks: rank 0 is the source, rank 1 its receiver. A "model" runs its own
all_reduce on the default group every step both ranks take. Each rank leaves the pass
after its own number of batches, by a ``break`` (the pass is dropped: its queued steps
run, and nothing else is sent) or by ``close()`` on its iterator (a CLOSE frame, sent or
expected); what each rank sees is recorded: an error inside its loop, in its ``close()``,
and at its next uses of the loader. Nothing is ever warned of.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tensorcast as tc

TIMEOUT_S = 2.0  # the loader's: a rank that waited for a frame would show in `took`
N = 8


def _rank_leaves_at(
    rank: int, world: int, prefetch: int, leaves: tuple[int, int], how: str
) -> dict[str, Any]:
    mine, both = leaves[rank], min(leaves)
    source = [{"i": torch.tensor([i])} for i in range(N)] if rank == 0 else None
    loader = tc.BroadcastingDataLoader(
        source, group=dist.group.WORLD, src=0, prefetch=prefetch, timeout=TIMEOUT_S
    )
    out: dict[str, Any] = {"loop": None, "close": None, "next": None}
    got: list[int] = []
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = iter(loader)
        try:
            for b in it:
                got.append(int(b["i"]))
                started = time.monotonic()  # `took` counts from the last batch handed out
                if len(got) <= both:  # the model's step; a rank that goes on alone has none
                    dist.all_reduce(torch.ones(1))
                if len(got) == mine:
                    break
        except tc.TensorcastError as e:
            out["loop"] = type(e).__name__
        if how == "close":
            try:
                it.close()
            except tc.TensorcastError as e:
                out["close"] = type(e).__name__
        del it
        # The next uses: whole passes, until one fails (the peer aborted its channel).
        deadline = time.monotonic() + TIMEOUT_S + 3
        while out["next"] is None and time.monotonic() < deadline:
            try:
                list(loader)
            except tc.TensorcastError as e:
                out["next"] = type(e).__name__
                out["message"] = str(e)
            time.sleep(0.05)
        out["warned"] = [str(w.message) for w in caught]
    out["took"] = time.monotonic() - started
    out["got"] = got
    dist.destroy_process_group()  # tensorcast's group was aborted: the next call starts anew
    return out


def _desync_seen(rank: dict[str, Any]) -> bool:
    """Whether the rank was told that the ranks left the pass after different batches."""
    return "DesyncError" in (rank["loop"], rank["close"], rank["next"]) or (
        rank["next"] == "PeerError" and "DesyncError" in rank.get("message", "")
    )


@pytest.mark.parametrize("how", ["break", "close"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_receiver_leaving_later_fails_loudly(pool2: Any, prefetch: int, how: str) -> None:
    """The source leaves after 2 batches, its receiver after 3."""
    source, receiver = pool2.run(_rank_leaves_at, prefetch, (2, 3), how, timeout=60)
    assert source["got"] == [0, 1] and receiver["got"][:2] == [0, 1]
    # The receiver asked for a step the source never sent: the next frame it gets is
    # another one (the source's CLOSE, or its next pass's first), a DesyncError at once.
    assert _desync_seen(receiver), receiver
    assert receiver["took"] < TIMEOUT_S, receiver  # it waited for no frame that never comes
    # The source left normally; a later use fails within its timeout (its receiver is gone).
    assert source["next"] in ("PeerError", "DesyncError"), source
    assert source["took"] < TIMEOUT_S + 3, source
    assert source["warned"] == receiver["warned"] == [], "nothing is warned of"


@pytest.mark.parametrize("how", ["break", "close"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_receiver_leaving_earlier_fails_loudly(pool2: Any, prefetch: int, how: str) -> None:
    """The source leaves after 3 batches, its receiver after 2."""
    source, receiver = pool2.run(_rank_leaves_at, prefetch, (3, 2), how, timeout=60)
    assert source["got"] == [0, 1, 2] and receiver["got"] == [0, 1]
    # The receiver is handed a frame of the source's old pass where its close or its next
    # pass was due.
    assert _desync_seen(receiver), receiver
    if how == "close":
        assert receiver["close"] == "DesyncError", receiver
    # The source, sending to a receiver that aborted, fails at a later use.
    assert source["next"] in ("PeerError", "DesyncError"), source
    for rank in (source, receiver):
        assert rank["took"] < TIMEOUT_S + 3, rank
    assert source["warned"] == receiver["warned"] == [], "nothing is warned of"


def _rank_same_leave(rank: int, world: int, prefetch: int, how: str) -> tuple[list[int], list[str]]:
    source = [{"i": torch.tensor([i])} for i in range(N)] if rank == 0 else None
    loader = tc.BroadcastingDataLoader(
        source, group=dist.group.WORLD, src=0, prefetch=prefetch, timeout=TIMEOUT_S
    )
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for stop in range(3):  # three passes, each left after batch `stop` on every rank
            last = -1
            it = iter(loader)
            for n, b in enumerate(it):
                dist.all_reduce(torch.ones(1))
                last = int(b["i"])
                if n == stop:
                    break
            if how == "close":
                it.close()
            del it
            out.append(last)
        out.append(len(list(loader)))  # and a whole pass after them
    return out, [str(w.message) for w in caught]


@pytest.mark.parametrize("how", ["break", "close"])
def test_the_same_leave_on_every_rank_is_quiet(pool2: Any, how: str) -> None:
    for prefetch in (0, 2):
        for got, caught in pool2.run(_rank_same_leave, prefetch, how, timeout=60):
            assert got == [0, 1, 2, N] and not caught
