"""The agreement on its own: many ranks as threads, each with its own client of one real
TCPStore (no process group needed), so that worlds of 16-64 ranks run in a second.

What is checked: ranks of a group agree and leave no key; a rank's requests do not grow
with the world (its wait's polls grow with the wait only); a rank with another setup is
caught within seconds by every rank of the mesh; a rank that never comes is reported
while the others wait, and named as gone when its process exited; a rank paused between
the rounds raises when it resumes; waits print nothing of c10d's.
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

from tensorcast._errors import DesyncError, PeerError
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
) -> tuple[list[Any], list[float], list[CountingStore]]:
    """Run ``build(rank, agreement)`` on ``n`` threads at once; per rank: what it
    returned (or raised), seconds it took, the store that counted its requests. The keys
    live under ``prefix`` (a new one by default)."""
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
    return out, took, stores


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
    out, _, stores = _run_world(16, _mesh_build(16, 4))
    for r, (channel_id, extras) in enumerate(out):
        first = r - r % 4
        assert channel_id == out[first][0] and extras[first] == {"length": 10}, r
        assert set(extras) == set(range(first, first + 4))
    assert len({out[g][0] for g in (0, 4, 8, 12)}) == 4  # groups' ids differ
    assert _clients().server.num_keys() == before
    # set (+ first), multi_get, append, add, get, delete its key, add (+ one compare_set,
    # + the last rank's deletes: the scope's 5 keys), and the polls' checks
    requests = [s.requests - s.calls["check"] for s in stores]
    assert max(requests) <= 9 + 1 + 5, requests


def _most_requests(n: int, size: int) -> int:
    """The most requests a rank of ``n`` makes, its polls aside; each rank's polls are
    bounded by how long it waited (about 8 + w checks for a wait of w s, per round)."""
    _, took, stores = _run_world(n, _mesh_build(n, size))
    for r, (store, t) in enumerate(zip(stores, took)):
        assert store.calls["check"] <= 2 * (10 + t), (r, store.calls, t)
    return max(s.requests - s.calls["check"] for s in stores)


@pytest.mark.parametrize("size", [4, 8])
def test_requests_per_rank_do_not_grow_with_the_world(size: int) -> None:
    """The law: the most requests any rank makes (its polls aside, which grow with the
    wait, not the world) is the same in a world of 2 groups and in one of 8 (a constant
    plus the group's size)."""
    small = _most_requests(2 * size, size)
    large = _most_requests(8 * size, size)
    assert large <= small + 2, (small, large)


def test_a_rank_with_other_axes_on_16_ranks_is_caught_within_seconds() -> None:
    """Rank 5 asks for ("tp",) only: it believes its group is [4, 5]. Every rank of the
    mesh raises DesyncError naming both setups, long before the timeout: the ranks whose
    group holds it compare with it, and the other groups read the mesh's outcome."""
    other = {**SETUP, "axes": ["tp"]}
    out, took, _ = _run_world(16, _mesh_build(16, 4, odd={5: ([4, 5], other)}), timeout_s=60.0)
    for r in range(16):
        assert isinstance(out[r], DesyncError), (r, out[r])
        assert "['cp', 'tp']" in str(out[r]) and "['tp']" in str(out[r]), str(out[r])
        assert "rank 5" in str(out[r]), str(out[r])
        assert took[r] < 10.0, (r, took[r])


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
    lines = [m for m in caplog.messages if "still waiting for rank 0 to set up" in m]
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


def test_both_rounds_end_within_about_one_timeout() -> None:
    """Rank 1 comes at 0.7 s of rank 0's 1 s timeout, then stops between the rounds: rank 0
    gives up at about 1 s from its start, not at 1.7 s (each round had the whole timeout)."""
    scope = ranks_name([0, 1])

    def build(r: int, agreement: Agreement) -> Any:
        if r == 1:
            time.sleep(0.7)
        return agreement.agree(scope, [0, 1], "tensorcast.broadcast(src=0)", SETUP)

    out, took, _ = _run_world(2, build, timeout_s=1.0, pause={1: lambda: time.sleep(2.5)})
    assert "did not confirm" in str(out[0]) and took[0] < 1.4, (out[0], took)


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
first = tc.BroadcastingDataLoader([{"n": 1}] if rank == 0 else None, group=dist.group.WORLD,
                                  src=0, timeout=4)  # tensorcast has a lane to stop at exit
assert [b["n"] for b in first] == [1]
if rank == 0:
    raise RuntimeError("this rank failed before building its second loader")
try:
    tc.BroadcastingDataLoader(None, group=dist.group.WORLD, src=0, timeout=4)
except tc.DesyncError as e:
    print("DESYNC", e)
"""


def test_a_rank_whose_process_exited_is_named_as_gone() -> None:
    """Two real processes build a loader; then rank 0 raises before it builds a second,
    rank 1 builds it. Rank 1 says every second who it waits for, and then that rank 0's
    process exited (its exit hook, registered with its first loader, left the mark),
    within the loader's timeout."""
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
    assert "still waiting for rank 0 to set up BroadcastingDataLoader: 1 s" in log, log


def test_a_slot_that_disagrees_fails_every_slot_even_when_it_comes_late() -> None:
    """Groups [0, 1] and [2, 3] of one mesh; [2, 3] asks for prefetch=2 and comes 1 s
    late: [0, 1] have agreed among themselves by then, but wait for the mesh's outcome,
    and raise with the others, naming the ranks that disagree."""
    other = {**SETUP, "prefetch": 2}
    build = _mesh_build(4, 2, odd={2: ([2, 3], other), 3: ([2, 3], other)})

    def late(r: int, agreement: Agreement) -> Any:
        if r >= 2:
            time.sleep(1.0)
        return build(r, agreement)

    out, took, _ = _run_world(4, late, timeout_s=30.0)
    for r in range(4):
        assert isinstance(out[r], DesyncError), (r, out[r])
        said = str(out[r])
        assert "disagree" in said and "prefetch=" in said and "rank 0" in said, said
        assert "did not set up" not in said, said
        assert took[r] < 10.0, (r, took[r])


def test_a_rank_that_came_is_never_said_not_to_have_set_up() -> None:
    """Ranks 0 and 1 believe the groups are [0, 1] and [2, 3]; ranks 2 and 3 (late)
    believe [0, 2] and [1, 3]. Rank 0 came and wrote its setup: the late ranks find it
    (nobody deletes a key before the whole mesh confirmed) and every rank is told of the
    disagreement at once; no message names a rank twice or says rank 0 did not set up."""
    other = {**SETUP, "layout": "other"}
    mine = {**SETUP, "layout": "first"}
    odd = {0: ([0, 1], mine), 1: ([0, 1], mine), 2: ([0, 2], other), 3: ([1, 3], other)}
    build = _mesh_build(4, 2, odd=odd)

    def late(r: int, agreement: Agreement) -> Any:
        if r >= 2:
            time.sleep(1.0)
        return build(r, agreement)

    out, took, _ = _run_world(4, late, timeout_s=20.0)
    for r in range(4):
        assert isinstance(out[r], DesyncError), (r, out[r])
        said = str(out[r])
        assert "layout=" in said and "did not set up" not in said, said
        assert took[r] < 10.0, (r, took[r])


def test_a_whole_slot_that_never_comes_fails_the_others_within_the_timeout() -> None:
    """Group [2, 3] never builds: nobody of its own group is there to name it, so [0, 1]
    wait for the mesh's outcome and give up at the timeout, saying how many confirmed."""
    build = _mesh_build(4, 2)
    out, took, _ = _run_world(4, lambda r, a: build(r, a) if r < 2 else None, timeout_s=2.0)
    for r in (0, 1):
        assert isinstance(out[r], DesyncError), (r, out[r])
        assert "2 of the mesh's 4 ranks" in str(out[r]), out[r]
        assert "[0, 1]" in str(out[r]), out[r]
        assert took[r] < 2.0 + 3.0, took


def test_a_wait_for_a_missing_rank_prints_nothing_of_c10d(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """TCPStore's client logs two warnings (`waitForInput ... timed out after 3000ms`) for
    every store wait that times out; the agreement's waits are polls, so while a rank
    waits for a missing one only tensorcast's own lines are written."""
    build = _mesh_build(2, 2)
    out, _, _ = _run_world(2, lambda r, a: build(r, a) if r == 0 else None, timeout_s=3.0)
    assert isinstance(out[0], DesyncError) and "rank(s) [1] did not set up" in str(out[0])
    err = capfd.readouterr().err
    assert "waitForInput" not in err and "timed out after" not in err, err


def test_a_store_whose_host_exited_is_a_peer_error_naming_it() -> None:
    """The store's host process exits in the middle of an agreement (as rank 0's does
    when it raises on its own): the rank still in it gets PeerError naming the store's
    address and its host, never torch's DistNetworkError."""
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch.distributed as dist\n"
            "s = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
            "print(s.port, flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None and host.stdin is not None
        port = int(host.stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        agreement = Agreement(
            dist.PrefixStore("tensorcast/1/", store), 1, datetime.timedelta(seconds=20)
        )

        def exit_host() -> None:
            time.sleep(0.5)
            host.stdin.close()  # type: ignore[union-attr]

        threading.Thread(target=exit_host, daemon=True).start()
        with pytest.raises(PeerError) as raised:
            agreement.agree(ranks_name([0, 1]), [0, 1], "BroadcastingDataLoader", SETUP)
    finally:
        host.kill()
        host.wait(10)
        host.stdout.close()  # type: ignore[union-attr]
    said = str(raised.value)
    assert f"TCPStore at 127.0.0.1:{port}" in said and "rank 0's process hosts it" in said, said
    assert not isinstance(raised.value, dist.DistNetworkError)
    assert "setting up BroadcastingDataLoader" in said, said


def test_a_host_is_its_boot_its_name_and_its_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two containers of one machine with ``--net=host`` share the boot id and the host
    name, each with a ``/dev/shm`` of its own: they are two hosts to the lane."""
    from types import SimpleNamespace

    from tensorcast.transport import agreement

    monkeypatch.delenv("TENSORCAST_HOST_ID", raising=False)
    real = os.stat
    seen = []
    for device in (41, 42):
        monkeypatch.setattr(
            agreement.os,
            "stat",
            lambda path, d=device: SimpleNamespace(st_dev=d) if path == "/dev/shm" else real(path),
        )
        seen.append(agreement.host_id())
    assert seen[0] != seen[1] and seen[0].rsplit("/", 1)[0] == seen[1].rsplit("/", 1)[0]
    monkeypatch.setenv("TENSORCAST_HOST_ID", "rack-3")
    assert agreement.host_id() == "rack-3"
