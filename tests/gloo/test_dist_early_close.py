"""Ranks that break out of a loader's loop after different batches fail loudly, in bounded
time, on every rank (NOTE [ An early close ] in ``tensorcast/loader/steps.py``).

Two gloo ranks: rank 0 is the source, rank 1 its receiver. A "model" runs its own
all_reduce on the default group every step both ranks take. Each rank breaks after its
own number of batches; what each rank sees is recorded: an error inside its loop, a
warning when the loop's pass is closed, and what the loader's next use raises.
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


def _rank_breaks_at(rank: int, world: int, prefetch: int, breaks: tuple[int, int]) -> dict:
    mine, both = breaks[rank], min(breaks)
    source = ({"i": torch.tensor([i])} for i in range(N)) if rank == 0 else None
    loader = tc.BroadcastingDataLoader(
        source, group=dist.group.WORLD, src=0, prefetch=prefetch, timeout=TIMEOUT_S
    )
    out: dict[str, Any] = {"loop": None, "warned": [], "next": None}
    got: list[int] = []
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for b in loader:
                got.append(int(b["i"]))
                started = time.monotonic()  # `took` counts from the last batch handed out
                if len(got) <= both:  # the model's step; a rank that goes on alone has none
                    dist.all_reduce(torch.ones(1))
                if len(got) == mine:
                    break
        except tc.TensorcastError as e:
            out["loop"] = type(e).__name__
        out["warned"] = [str(w.message) for w in caught if "left pass" in str(w.message)]
    try:
        next(iter(loader))
        out["next"] = "ok"
    except tc.TensorcastError as e:
        out["next"] = type(e).__name__
        out["message"] = str(e)
    out["took"] = time.monotonic() - started
    out["got"] = got
    dist.destroy_process_group()  # tensorcast's group was aborted: the next call starts anew
    return out


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_receiver_breaking_later_fails_loudly(pool2: Any, prefetch: int) -> None:
    """The source breaks after 2 batches, its receiver after 3."""
    source, receiver = pool2.run(_rank_breaks_at, prefetch, (2, 3), timeout=60)
    assert source["got"] == [0, 1] and receiver["got"][:2] == [0, 1]
    # The receiver asks for a step the source closed the pass at: DesyncError at once,
    # inside its loop (prefetch 0) or when its pass is closed, warned of and raised again.
    if receiver["loop"] is None:
        assert receiver["warned"] and "after different batches" in receiver["warned"][0]
        assert receiver["next"] == "DesyncError"
    else:
        assert receiver["loop"] == "DesyncError"
    assert receiver["took"] < TIMEOUT_S, receiver  # it waited for no frame that never comes
    # The source left normally; its next use fails within its timeout (its receiver is gone).
    assert source["next"] in ("PeerError", "DesyncError")
    assert source["took"] < TIMEOUT_S + 2, source


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_receiver_breaking_earlier_fails_loudly(pool2: Any, prefetch: int) -> None:
    """The source breaks after 3 batches, its receiver after 2."""
    source, receiver = pool2.run(_rank_breaks_at, prefetch, (3, 2), timeout=60)
    assert source["got"] == [0, 1, 2] and receiver["got"] == [0, 1]
    # The receiver is handed a batch where the source's close was due.
    assert receiver["warned"] and "after different batches" in receiver["warned"][0]
    assert receiver["next"] == "DesyncError"
    # The source, sending to a receiver that aborted, fails in its close or its loop.
    assert source["loop"] == "PeerError" or source["warned"], source
    assert source["next"] in ("PeerError", "DesyncError")
    for rank in (source, receiver):
        assert rank["took"] < TIMEOUT_S + 2, rank


def _rank_same_break(rank: int, world: int, prefetch: int) -> tuple[list[int], list[str]]:
    source = [{"i": torch.tensor([i])} for i in range(N)] if rank == 0 else None
    loader = tc.BroadcastingDataLoader(
        source, group=dist.group.WORLD, src=0, prefetch=prefetch, timeout=TIMEOUT_S
    )
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for stop in range(3):  # three passes, each left after batch `stop` on every rank
            last = -1
            for n, b in enumerate(loader):
                dist.all_reduce(torch.ones(1))
                last = int(b["i"])
                if n == stop:
                    break
            out.append(last)
        out.append(len(list(loader)))  # and a whole pass after them
    return out, [str(w.message) for w in caught]


def test_the_same_break_on_every_rank_is_quiet(pool2: Any) -> None:
    for prefetch in (0, 2):
        for got, caught in pool2.run(_rank_same_break, prefetch, timeout=60):
            assert got == [0, 1, 2, N] and not caught
