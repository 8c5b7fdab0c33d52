"""The agreement on its own: many ranks as threads, each with its own client of one real
TCPStore (no process group needed), so that worlds of 16-64 ranks run in a second.

What is checked: ranks of a group agree and leave no key; a rank's requests do not grow
with the world; a rank with another setup is caught within seconds by every rank whose
group holds it; a rank that never comes is reported while the others wait, and named as
gone when its process exited; a rank paused between the rounds raises when it resumes.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch.distributed as dist

from tensorcast._errors import DesyncError
from tensorcast.transport.agreement import EXITED, Agreement, ranks_name
from tensorcast.transport.testing import CountingStore

SETUP = {"prefetch": 1, "axes": ["cp", "tp"], "mesh": [["dp", "cp", "tp"], [4, 2, 2]]}


def _server() -> Any:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


class _Clients:
    """One TCPStore server and 64 clients of it, made once (in parallel: a client's
    connection now and then takes seconds), each test on a prefix of its own."""

    def __init__(self) -> None:
        self.server = _server()
        with ThreadPoolExecutor(16) as pool:
            self.clients = list(
                pool.map(
                    lambda _: dist.TCPStore("127.0.0.1", self.server.port, is_master=False),
                    range(64),
                )
            )


_CLIENTS: list[_Clients] = []


def _clients() -> _Clients:
    if not _CLIENTS:
        _CLIENTS.append(_Clients())
    return _CLIENTS[0]


def _run_world(
    n: int,
    build: Callable[[int, Agreement], Any],
    *,
    timeout_s: float = 30.0,
    pause: dict[int, Callable[[], None]] | None = None,
    prefix: str = "",
) -> tuple[list[Any], list[float], list[int]]:
    """Run ``build(rank, agreement)`` on ``n`` threads at once; per rank: what it
    returned (or raised), seconds it took, store requests it made. The keys live under
    ``prefix`` (a new one by default)."""
    shared = _clients()
    prefix = prefix or uuid.uuid4().hex
    server = dist.PrefixStore(prefix, shared.server)
    stores = [
        CountingStore(dist.PrefixStore(f"{prefix}/tensorcast/1", shared.clients[r]))
        for r in range(n)
    ]
    agreements = [
        Agreement(
            stores[r],
            r,
            datetime.timedelta(seconds=timeout_s),
            exits=server,
            pause=(pause or {}).get(r),
        )
        for r in range(n)
    ]
    out: list[Any] = [None] * n
    took = [0.0] * n
    start = threading.Barrier(n)

    def rank(r: int) -> None:
        start.wait()
        began = time.monotonic()
        try:
            out[r] = build(r, agreements[r])
        except Exception as e:
            out[r] = e
        took[r] = time.monotonic() - began

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 3 + 30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out, took, [s.requests for s in stores]


def _groups(n: int, size: int) -> list[list[int]]:
    return [list(range(k, k + size)) for k in range(0, n, size)]


def _mesh_build(n: int, size: int, *, odd: dict[int, tuple[list[int], dict[str, Any]]] = {}):  # noqa: B006
    """A mesh loader's agreement: scope the mesh, read set the rank's group; ``odd``
    gives some ranks another group and setup (what they believe)."""
    scope = ranks_name(range(n))

    def build(r: int, agreement: Agreement) -> Any:
        group, setup = odd.get(r, (_groups(n, size)[r // size], SETUP))
        extra = {"length": 10} if r == group[0] else {}
        return agreement.agree(scope, group, "BroadcastingDataLoader", setup, extra, first=(0, n))

    return build


def test_groups_agree_on_an_id_learn_the_length_and_leave_no_key() -> None:
    before = _clients().server.num_keys()
    out, _, requests = _run_world(16, _mesh_build(16, 4))
    for r, (channel_id, extras) in enumerate(out):
        first = r - r % 4
        assert channel_id == out[first][0] and extras[first] == {"length": 10}, r
        assert set(extras) == set(range(first, first + 4))
    assert len({out[g][0] for g in (0, 4, 8, 12)}) == 4  # groups' ids differ
    assert _clients().server.num_keys() == before
    # set, wait, multi_get, append, add, wait, get, add, add (+ one compare_set, + the
    # last rank's deletes: the group's keys)
    assert max(requests) <= 10 + 4 + 4 + 2, requests


@pytest.mark.parametrize("size", [4, 8])
def test_requests_per_rank_do_not_grow_with_the_world(size: int) -> None:
    """The law: the most requests any rank makes is the same in a world of 2 groups and
    in one of 8 (a constant plus the group's size)."""
    small = max(_run_world(2 * size, _mesh_build(2 * size, size))[2])
    large = max(_run_world(8 * size, _mesh_build(8 * size, size))[2])
    assert large <= small + 2, (small, large)


def test_a_rank_with_other_axes_on_16_ranks_is_caught_within_seconds() -> None:
    """Rank 5 asks for ("tp",) only: it believes its group is [4, 5]. Every rank whose
    group holds it raises DesyncError naming both setups, long before the timeout; the
    other groups (which do not meet it) agree."""
    other = {**SETUP, "axes": ["tp"]}
    out, took, _ = _run_world(16, _mesh_build(16, 4, odd={5: ([4, 5], other)}), timeout_s=60.0)
    for r in range(16):
        if r in (4, 5, 6, 7):
            assert isinstance(out[r], DesyncError), (r, out[r])
            assert "['cp', 'tp']" in str(out[r]) and "['tp']" in str(out[r]), str(out[r])
            assert took[r] < 10.0, (r, took[r])
        else:
            assert not isinstance(out[r], Exception), (r, out[r])


def test_a_rank_that_never_comes_is_reported_then_named(caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0 never builds it: the others log who they wait for, then raise within the
    timeout; once rank 0's process has marked its exit, they say it is gone."""
    prefix = uuid.uuid4().hex
    build = _mesh_build(4, 2)

    def all_but_0(r: int, agreement: Agreement) -> Any:
        if r == 0:
            return None
        return build(r, agreement)

    with caplog.at_level(logging.WARNING, logger="tensorcast"):
        out, took, _ = _run_world(4, all_but_0, timeout_s=3.0, prefix=prefix)
    for r in (1, 2, 3):
        assert isinstance(out[r], DesyncError) and "rank(s) [0] did not set up" in str(out[r])
        assert took[r] < 3.0 + 2.0, took
    lines = [m for m in caplog.messages if "still waiting for rank 0 to build" in m]
    assert len(lines) >= 3, caplog.messages  # every second, on each of three ranks
    # what rank 0's process leaves when it exits
    dist.PrefixStore(prefix, _clients().server).set(f"{EXITED}0", "exited")
    out, _, _ = _run_world(4, all_but_0, timeout_s=1.0, prefix=prefix)
    assert "rank 0 exited: its process is gone" in str(out[1]), out[1]


def test_a_rank_paused_between_the_rounds_raises_when_it_resumes() -> None:
    """Rank 1 stops after round one for longer than rank 0's timeout (a GC pause,
    SIGSTOP): rank 0 gives up and leaves the outcome; rank 1 reads it on resuming and
    raises at once instead of going on to make a group alone."""
    resumed: list[float] = []

    def pause() -> None:
        time.sleep(2.5)
        resumed.append(time.monotonic())

    scope = ranks_name([0, 1])
    out, took, _ = _run_world(
        2,
        lambda r, a: a.agree(scope, [0, 1], "BroadcastingDataLoader", SETUP),
        timeout_s=1.0,
        pause={1: pause},
    )
    assert isinstance(out[0], DesyncError) and "[1] agreed" in str(out[0]), out[0]
    assert "did not confirm" in str(out[0]) and took[0] < 2.5, (out[0], took)
    assert isinstance(out[1], DesyncError) and "rank 0 gave up waiting" in str(out[1]), out[1]


def test_a_late_rank_is_told_at_once_that_the_others_gave_up() -> None:
    scope = ranks_name([0, 1])

    def build(r: int, agreement: Agreement) -> Any:
        if r == 1:
            time.sleep(1.5)
        return agreement.agree(scope, [0, 1], "tensorcast.broadcast(src=0)", SETUP)

    out, took, _ = _run_world(2, build, timeout_s=1.0)
    assert "rank(s) [1] did not set up" in str(out[0]), out[0]
    assert "rank 0 gave up waiting" in str(out[1]) and took[1] < 1.5 + 0.5, (out[1], took)


_RANK = """
import sys, datetime, torch.distributed as dist, tensorcast as tc
rank = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), is_master=False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
if rank == 0:
    raise RuntimeError("this rank failed before building its loader")
try:
    tc.BroadcastingDataLoader(None, group=dist.group.WORLD, src=0, timeout=4)
except tc.DesyncError as e:
    print("DESYNC", e)
"""


def test_a_rank_whose_process_exited_is_named_as_gone() -> None:
    """Two real processes: rank 0 raises before it builds the loader, rank 1 builds it.
    Rank 1 says every second who it waits for, and then that rank 0's process exited
    (its process left the mark on its way out), within the loader's timeout."""
    server = _server()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), str(server.port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in (0, 1)
    ]
    out = [p.communicate(timeout=120) for p in ranks]
    assert ranks[0].returncode == 1 and b"failed before building" in out[0][1], out[0][1]
    said, log = out[1][0].decode(), out[1][1].decode()
    assert "DESYNC rank 1: rank(s) [0] did not set up BroadcastingDataLoader" in said, said
    assert "rank 0 exited: its process is gone" in said, said
    assert "still waiting for rank 0 to build BroadcastingDataLoader: 1 s" in log, log
