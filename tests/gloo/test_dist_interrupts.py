"""Interrupts at every point of ``next()`` and ``broadcast()`` where one can land, on gloo.

``tensorcast.testing.interrupt_at`` raises ``KeyboardInterrupt`` at one named point on
one rank, as a signal handler would; the training loop around the loader catches it and
calls ``next()`` again, and a "model" runs its own all_reduce every step on a group of
its own. What must hold at each point (NOTE [ Interrupts ]): every rank gets the same
batches as an uninterrupted pass, or the channel breaks on every rank (``PeerError``)
within the timeout. Never a batch lost on one rank only, never a hang.

A SIGALRM storm on the source (a handler that raises every millisecond) checks the same
law where the handler lands wherever the clock says.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rankpool import RankPool

import tensorcast as tc
from tensorcast.testing import POINTS, interrupt_at

TIMEOUT = 120.0
N = 6
LOADER_POINTS = [p for p in POINTS if p != "broadcast.wait"]
#: where the retry cannot be paired with the peers: the channel breaks instead
BREAKS = {"step.took"}
#: the victims of a point, where not both: a break costs its peer a timeout and its
#: diagnosis (5 to 11 s), so it runs on the receiver only; a source whose inline step is
#: interrupted breaks its channel on every rank in test_dist_lane's signal test
VICTIMS = {"step.took": (1,)}


class Numbers:
    """Batch ``i`` carries ``i`` (a shift would show) and a payload of ``floats``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return ({"i": i, "x": torch.full((64,), float(i))} for i in range(self.n))


def _fresh_group(rank: int, world: int, store_dir: str, k: int) -> None:
    """A new default group (and so a new tensorcast world) after one that broke."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(os.path.join(store_dir, f"store-{k}"), world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=20),
    )


def _model_group() -> Any:
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))


def _model_step(group: Any, rank: int, step: int) -> None:
    """The training step: its own collective, at a moment that differs between ranks."""
    if (rank + step) % 2:
        torch.ones(20_000).sum()  # some work first
    dist.all_reduce(torch.ones(1), group=group)


def _pass(rank: int, loader: tc.BroadcastingDataLoader, model: Any) -> dict[str, Any]:
    got: list[Any] = []
    outcome = "ended"
    it = iter(loader)
    step = 0
    while True:
        try:
            b = next(it)
        except KeyboardInterrupt:
            got.append("interrupted")
            continue
        except tc.PeerError:
            outcome = "PeerError"
            break
        except StopIteration:
            break
        got.append(b["i"] if torch.equal(b["x"], torch.full((64,), float(b["i"]))) else "bad")
        try:
            _model_step(model, rank, step)
        except RuntimeError:  # the peer left: the channel must say so too
            outcome = "model"
            try:
                next(it)
                outcome = "model, then no error"
            except tc.PeerError:
                outcome = "PeerError"
            break
        step += 1
    return {"got": got, "outcome": outcome}


def _rank_points(rank: int, world: int, store_dir: str) -> list[dict[str, Any]]:
    out = []
    k = 0
    model = _model_group()
    try:
        for point in LOADER_POINTS:
            for prefetch in (0, 1):
                for victim in VICTIMS.get(point, (0, 1)):
                    nth = 1 if point in ("next.start", "close.wait") else 3
                    loader = tc.BroadcastingDataLoader(
                        Numbers(N) if rank == 0 else None,
                        group=dist.group.WORLD,
                        src=0,
                        prefetch=prefetch,
                        timeout=3.0,
                    )
                    armed = interrupt_at(point, nth=nth) if rank == victim else None
                    with armed if armed is not None else contextlib.nullcontext() as a:
                        result = _pass(rank, loader, model)
                    result.update(point=point, prefetch=prefetch, victim=victim)
                    result["fired"] = a.fired if a is not None else None
                    out.append(result)
                    if result["outcome"] != "ended":  # a broken group: start again
                        del loader
                        k += 1
                        _fresh_group(rank, world, store_dir, k)
                        model = _model_group()
    finally:
        dist.destroy_process_group()
    return out


def test_an_interrupt_at_every_point_of_next_retries_the_same_batch_or_breaks_loudly(
    pool2: RankPool, tmp_path: Any
) -> None:
    results = pool2.run(_rank_points, str(tmp_path), timeout=TIMEOUT)
    fired = set()
    for mine, theirs in zip(*results):
        where = f"{mine['point']}, prefetch={mine['prefetch']}, victim={mine['victim']}"
        victim, peer = (mine, theirs) if mine["victim"] == 0 else (theirs, mine)
        assert peer["fired"] is None
        if not victim["fired"]:  # this configuration never reaches the point
            assert mine["outcome"] == theirs["outcome"] == "ended", where
            assert mine["got"] == theirs["got"] == list(range(N)), where
            continue
        fired.add(mine["point"])
        if mine["point"] in BREAKS:
            assert victim["outcome"] == peer["outcome"] == "PeerError", (where, victim, peer)
            continue
        assert victim["outcome"] == peer["outcome"] == "ended", (where, victim, peer)
        assert [i for i in victim["got"] if i != "interrupted"] == list(range(N)), where
        assert victim["got"].count("interrupted") == 1, where
        assert peer["got"] == list(range(N)), where
    assert fired == set(LOADER_POINTS), f"never reached: {set(LOADER_POINTS) - fired}"


# -- tensorcast.broadcast ------------------------------------------------------------------------


def _rank_broadcast(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"got": []}
    try:
        armed = interrupt_at("broadcast.wait", nth=2) if rank == 1 else None
        with armed if armed is not None else contextlib.nullcontext() as a:
            for i in range(4):
                try:
                    x = tc.broadcast(
                        torch.full((8,), float(i)) if rank == 0 else None, 0, timeout=5
                    )
                    out["got"].append(int(x[0]))
                except KeyboardInterrupt:
                    out["got"].append("interrupted")
                except tc.PeerError:
                    out["got"].append("PeerError")
                    break
        out["fired"] = a.fired if a is not None else None
    finally:
        dist.destroy_process_group()
    return out


def test_an_interrupt_in_broadcast_breaks_the_channel_on_every_rank(pool2: RankPool) -> None:
    """A broadcast's result cannot be handed out again by a retry (a new call is a new
    frame): one lost to an interrupt breaks the channel, and every rank says so."""
    source, receiver = pool2.run(_rank_broadcast, timeout=TIMEOUT)
    assert receiver["fired"] == 1
    assert receiver["got"] == [0, "interrupted", "PeerError"]
    assert source["got"][:2] == [0, 1] and source["got"][-1] == "PeerError"


# -- a storm of raising signals on the source --------------------------------------------------------


class Storm(Exception):
    pass


def _rank_storm(rank: int, world: int, prefetch: int) -> dict[str, Any]:
    """The source's handler raises every 0.7 ms while ``next()`` runs (outside it the test
    itself, not the library, would lose what the handler interrupts). The group may end
    broken: it is torn down, and the pool makes a new one."""
    live = [False]
    fired = [0]

    def handler(signum: int, frame: Any) -> None:
        if live[0]:
            fired[0] += 1
            raise Storm

    n = 60
    loader = tc.BroadcastingDataLoader(
        Numbers(n) if rank == 0 else None,
        group=dist.group.WORLD,
        src=0,
        prefetch=prefetch,
        timeout=5.0,
    )
    got: list[Any] = []
    outcome = "ended"
    old = signal.signal(signal.SIGALRM, handler)
    if rank == 0:
        signal.setitimer(signal.ITIMER_REAL, 0.001, 0.0007)
    try:
        it = iter(loader)
        while True:
            try:
                live[0] = True
                got.append(next(it)["i"])
                live[0] = False
            except Storm:
                live[0] = False
            except tc.SourceError as e:  # the storm hit the source's own next(source)
                outcome = f"SourceError: {'Storm' in str(e)}"
                break
            except tc.PeerError:
                outcome = "PeerError"
                break
            except StopIteration:
                break
    finally:
        live[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
        dist.destroy_process_group()
    return {"got": got, "outcome": outcome, "fired": fired[0]}


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_sigalrm_storm_on_the_source_never_shifts_or_hangs(
    pool2: RankPool, prefetch: int
) -> None:
    source, receiver = pool2.run(_rank_storm, prefetch, timeout=TIMEOUT)
    assert source["fired"] >= 1, source  # it did storm (an inline frame it hits breaks)
    got, theirs = receiver["got"], source["got"]
    # The receiver got batches 0, 1, 2, ... with no gap. The source's own loop may lose a
    # batch that next() had returned when the handler ran: a subsequence, never a shift.
    assert got == list(range(len(got))), receiver
    # A channel the storm broke may have cut off, in transit, the frame of a batch the
    # source's next() had already handed out: then the receiver raises PeerError at that
    # batch, one behind the source, and every rank has failed loudly.
    reached = set(got) | ({len(got)} if receiver["outcome"] == "PeerError" else set())
    assert theirs == sorted(set(theirs)) and set(theirs) <= reached, (source, receiver)
    if receiver["outcome"] == "ended":
        assert got == list(range(60))
    else:  # loudly
        assert receiver["outcome"] in ("PeerError", "SourceError: True"), (source, receiver)


# -- an interrupt inside the first agreement ----------------------------------------------------------


def _rank_agreement(rank: int, world: int) -> list[str]:
    """Rank 0's handler raises while it waits for rank 1 in the loader's setup; building it
    again must not pair rank 0's next agreement with rank 1's first (their numbers would
    differ from then on): it says what happened, at once, and rank 1 fails in its timeout."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    out = []
    old = signal.signal(signal.SIGALRM, handler)
    try:
        if rank == 0:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
        else:
            time.sleep(1.0)  # rank 0 waits for this one meanwhile
        for _ in range(2):
            try:
                tc.BroadcastingDataLoader(
                    [1] if rank == 0 else None, group=dist.group.WORLD, src=0, timeout=3.0
                )
                out.append("built")
            except KeyboardInterrupt:
                out.append("interrupted")
            except tc.DesyncError as e:
                out.append(f"DesyncError: {e}")
                break
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        dist.destroy_process_group()  # this rank's agreements are spent: a new world
    return out


def test_an_interrupt_in_the_first_agreement_is_told_on_the_retry(pool2: RankPool) -> None:
    start = time.monotonic()
    first, second = pool2.run(_rank_agreement, timeout=TIMEOUT)
    assert time.monotonic() - start < 30
    assert first[0] == "interrupted", first
    assert first[1].startswith(
        "DesyncError: rank 0: an earlier setup among ranks [0, 1] was "
        "interrupted on this rank (KeyboardInterrupt"
    ), first
    assert len(second) == 1 and second[0].startswith("DesyncError: rank 1: "), second
