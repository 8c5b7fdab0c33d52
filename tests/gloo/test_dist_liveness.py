"""What receivers say when the source does not send, on real gloo ranks.

A source that holds the GIL inside ``next(source)``, one busy in its own training step,
and a frozen source that hosts the store: every receiver raises ``PeerError`` within the
timeout and a bounded watch, and the receivers of one frame give the same reason. Each
rank function puts a "model" around the loader (an ``all_reduce`` on the world, at
rank-dependent moments).
"""

from __future__ import annotations

import datetime
import os
import queue
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rankpool import start_context
from stalls import hold_gil

import tensorcast as tc

CALL_TIMEOUT = 120.0  # pool.run's hard limit
TIMEOUT = 3.0  # the loaders' timeout
MARGIN = 20.0  # slack for a loaded 2-core machine, past the timeout and the watch
FROZEN_TIMEOUT = 6.0  # the frozen store host's loader: no rank may stall that long before


class Source:
    """Batches 0, 1, 2, ...; ``stall(i)`` runs inside ``next(source)`` before batch ``i``."""

    def __init__(self, n: int, stall: Any = None) -> None:
        self.n, self.stall = n, stall

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(self.n):
            if self.stall is not None:
                self.stall(i)
            yield {"i": torch.tensor([i])}


def _gil_at_2(i: int) -> None:
    if i == 2:
        hold_gil(TIMEOUT + 2.0)


def _reason(message: str) -> str:
    """The diagnosis part of a receiver's PeerError."""
    found = re.search(
        r"(?:timed out|failed) after [\d.]+ s[^:]*: (.*?\(seen by rank \d+\))", message
    )
    assert found, message
    return found.group(1)


def _rank_silent_source(rank: int, world: int, case: str) -> str:
    """Iterate a loader with a model around it; the source stalls at batch 2 (``gil``:
    inside next(source), holding the GIL; ``step``: in its own step, outside tensorcast).
    Returns each rank's error."""
    source = None
    if rank == 0:
        source = Source(5, _gil_at_2 if case == "gil" else None)
    loader = tc.BroadcastingDataLoader(
        source, group=dist.group.WORLD, src=0, prefetch=0, timeout=TIMEOUT
    )
    model = torch.ones(1)
    last = time.monotonic()
    try:
        for i, batch in enumerate(loader):
            assert int(batch["i"]) == i
            time.sleep(0.01 * rank)  # the model's collective, at rank-dependent moments
            dist.all_reduce(model)
            if case == "step" and rank == 0 and i == 1:
                time.sleep(TIMEOUT + 2.0)  # the source's own training step, long
            last = time.monotonic()
        raise AssertionError("the pass ended without an error")
    except tc.PeerError as e:
        if rank and time.monotonic() - last > TIMEOUT + MARGIN:
            raise AssertionError(f"the PeerError took {time.monotonic() - last:.1f} s") from e
        return str(e)
    finally:
        dist.destroy_process_group()  # the broken channel goes with it; the pool makes anew


def test_a_source_holding_the_gil_is_alive_and_every_receiver_says_so(pool4: Any) -> None:
    results = pool4.run(_rank_silent_source, "gil", timeout=CALL_TIMEOUT)
    reasons = {_reason(m) for m in results[1:]}
    assert len(reasons) == 1, reasons  # the same words on every receiver
    reason = reasons.pop()
    assert "is alive, but its process kept its heartbeat from running" in reason, reason
    assert "inside next(source)" in reason and "held the GIL" in reason, reason
    assert "gone" not in reason, reason


def test_a_source_in_its_own_step_is_alive_outside_tensorcast(pool4: Any) -> None:
    results = pool4.run(_rank_silent_source, "step", timeout=CALL_TIMEOUT)
    reasons = {_reason(m) for m in results[1:]}
    assert len(reasons) == 1, reasons
    reason = reasons.pop()
    assert "is alive and has been outside next(source) for" in reason, reason
    assert "its training step" in reason and "same loaders" in reason, reason
    seconds = float(re.search(r"outside next\(source\) for ([\d.]+) s", reason).group(1))  # type: ignore[union-attr]
    assert TIMEOUT - 1.0 <= seconds <= TIMEOUT + MARGIN, reason


# -- a frozen source that hosts the store ----------------------------------------------


def _freeze_at_2(i: int) -> None:
    if i == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, with the store it hosts


def _store_host_rank(rank: int, world: int, ports: Any, out: Any) -> None:
    """A rank of a job whose TCPStore lives in rank 0's process, as under ``mp.spawn`` or
    ``env://``; rank 0, the source, freezes itself inside ``next(source)``."""
    os.environ.update({"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    patience = datetime.timedelta(seconds=90)  # the store's and the group's own timeout
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, patience, wait_for_workers=False)
        for _ in range(world - 1):
            ports.put(store.port)
    else:
        port = ports.get(timeout=CALL_TIMEOUT)
        store = dist.TCPStore("127.0.0.1", port, world, False, patience, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=patience)
    loader = tc.BroadcastingDataLoader(
        Source(5, _freeze_at_2) if rank == 0 else None,
        group=dist.group.WORLD,
        src=0,
        prefetch=0,
        timeout=FROZEN_TIMEOUT,
    )
    last = time.monotonic()
    try:
        for _ in loader:
            last = time.monotonic()
        out.put((rank, "no error", 0.0))
    except tc.PeerError as e:
        out.put((rank, str(e), time.monotonic() - last))
    out.close()
    out.join_thread()  # the report is sent before the process goes
    os._exit(0)  # no teardown through a store that does not answer


@pytest.mark.dist
def test_a_frozen_source_that_hosts_the_store_is_told_within_the_timeout() -> None:
    ctx = start_context()
    world = 3
    ports, out = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_store_host_rank, args=(r, world, ports, out), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, float]] = {}
    try:
        deadline = time.monotonic() + CALL_TIMEOUT
        while len(got) < world - 1 and time.monotonic() < deadline:
            try:
                rank, message, waited = out.get(timeout=1.0)
            except queue.Empty:
                continue
            got[rank] = (message, waited)
    finally:
        if procs[0].pid is not None:
            os.kill(procs[0].pid, signal.SIGCONT)
        for p in procs:
            p.kill()
            p.join(10)
    assert sorted(got) == [1, 2], got  # the receivers, and not the frozen source
    for message, waited in got.values():
        assert "the store (a TCPStore at 127.0.0.1:" in message, message
        assert "did not answer within" in message and "frozen or gone" in message, message
        assert "rank 0, here the source itself" in message, message
        assert waited < FROZEN_TIMEOUT + 12.0, (waited, message)  # 0.2.0: the store's 90 s
