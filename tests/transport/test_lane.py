"""Unit tests of the lane: one FIFO of jobs per group, inline when idle, on its worker
otherwise (see NOTE [ One ordered lane ] in ``tensorcast.transport.lane``). No process
group: the jobs are plain functions."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

from tensorcast import PeerError
from tensorcast.transport.lane import Job, Lane

T = TypeVar("T")


def _lane(**kw: float) -> tuple[Lane, list[str]]:
    aborted: list[str] = []
    return Lane("0-1", lambda: aborted.append("abort"), **kw), aborted


def _queued(lane: Lane, fn: Callable[[], T]) -> Job[T]:
    """``fn`` queued behind every job queued before it: it runs on the worker."""
    job: Job[T] = Job(fn)
    lane.enqueue(job)
    return job


def _started(lane: Lane, fn: Callable[[], T]) -> Job[T]:
    """``fn`` started as a loader's step is: inline when the lane is idle."""
    job: Job[T] = Job(fn)
    lane.start(job, lambda: 0)
    return job


def test_an_idle_lane_runs_a_job_inline_on_the_callers_thread() -> None:
    lane, _ = _lane()
    me = threading.get_ident()
    assert lane.run(threading.get_ident, lambda: 0) == me
    assert lane.idle()


def test_a_busy_lane_runs_the_next_job_on_its_worker_after_the_running_one() -> None:
    lane, _ = _lane()
    order: list[tuple[str, int]] = []
    gate = threading.Event()

    def first() -> None:
        gate.wait(5)
        order.append(("first", threading.get_ident()))

    job = _queued(lane, first)  # on the worker; holds the lane until the gate opens
    assert not lane.idle()
    later = threading.Timer(0.1, gate.set)
    later.start()
    got = lane.run(lambda: order.append(("second", threading.get_ident())) or 7, lambda: 0)
    job.result()
    assert got == 7
    assert [name for name, _ in order] == ["first", "second"]
    assert order[1][1] != threading.get_ident(), "queued behind a job, it runs on the worker"


def test_jobs_run_in_submission_order() -> None:
    lane, _ = _lane()
    seen: list[int] = []
    gate = threading.Event()
    first = _queued(lane, lambda: gate.wait(5) and -1)  # holds the worker: the rest queue
    jobs = [_started(lane, lambda i=i: seen.append(i) or i) for i in range(50)]
    assert not any(j.done for j in jobs), "started behind a running job, they are queued"
    gate.set()
    assert first.result() == -1
    assert [j.result() for j in jobs] == list(range(50))
    assert seen == list(range(50))


def test_a_job_started_on_an_idle_lane_runs_inline_and_counts_its_frames() -> None:
    lane, _ = _lane()
    taken = [3]
    job = Job(lambda: taken.append(taken.pop() + 1) or threading.get_ident())
    lane.start(job, lambda: taken[0])
    assert job.done and job.result() == threading.get_ident()
    assert taken == [4]
    assert job.frames_at_start == 3, "the role's count, read before the job ran"
    assert lane.idle()


def test_the_worker_leaves_when_idle_and_comes_back_with_the_next_job() -> None:
    # A name of its own: the workers of the other tests' lanes stay for their 5 idle seconds.
    lane = Lane("idle-exit", lambda: None, idle_exit_s=0.05)
    assert _queued(lane, lambda: 1).result() == 1
    deadline = time.monotonic() + 5
    while any(t.name == "tensorcast-lane-idle-exit" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the idle worker did not leave"
        time.sleep(0.01)
    assert _queued(lane, lambda: 2).result() == 2


def test_submitting_from_a_job_of_the_same_lane_is_refused() -> None:
    lane, _ = _lane()
    job = _queued(lane, lambda: _queued(lane, lambda: None))
    with pytest.raises(RuntimeError, match="inside a loader's source iterator"):
        job.result()
    with pytest.raises(RuntimeError, match="inside a loader's source iterator"):
        lane.run(lambda: lane.run(lambda: None, lambda: 0), lambda: 0)


def test_a_jobs_exception_reaches_whoever_waits_for_it() -> None:
    lane, _ = _lane()
    job = _queued(lane, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        job.result()
    assert lane.broken is None, "a job's own failure does not break the lane"


def test_a_broken_lane_aborts_once_and_refuses_every_later_check() -> None:
    lane, aborted = _lane()
    lane.break_(RuntimeError("peer gone"))
    lane.break_(RuntimeError("second cause"))
    assert aborted == ["abort"]
    with pytest.raises(PeerError, match="peer gone"):
        lane.check()


def test_an_abort_lost_to_an_interrupted_thread_start_runs_at_the_next_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handler that raises inside ``Thread.start()`` just after the new thread was made
    leaves a thread that dies before its target (``del _limbo[self]`` fails in it): the
    group was never aborted, and peers blocked on it would wait out their timeout. The
    next check of the broken lane aborts it, once."""
    lane, aborted = _lane()
    real_start = threading.Thread.start

    def lost(self: threading.Thread) -> None:
        monkeypatch.setattr(threading.Thread, "start", real_start)
        raise KeyboardInterrupt  # as a signal handler would, with no thread left running

    monkeypatch.setattr(threading.Thread, "start", lost)
    with pytest.raises(KeyboardInterrupt):
        lane.break_(RuntimeError("peer gone"))
    assert aborted == [] and lane.broken is not None
    with pytest.raises(PeerError, match="peer gone"):
        lane.check()
    assert aborted == ["abort"]
    with pytest.raises(PeerError, match="peer gone"):
        lane.check()
    lane.break_(RuntimeError("second cause"))
    assert aborted == ["abort"]


def test_a_job_left_queued_by_an_interrupted_thread_start_runs_once_settled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A signal handler that raises inside ``Thread.start()`` (the caller's thread waits
    there for the new thread) leaves the job queued and no worker: settling the pass's
    jobs, as its retry does, must start one, or the job's waiter hangs."""

    class Interrupted(Exception):
        pass

    real_start = threading.Thread.start
    calls = []

    def start_interrupted_once(thread: threading.Thread) -> None:
        calls.append(thread.name)
        if len(calls) == 1:
            raise Interrupted  # before the thread runs: as if its start had been cut short
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_interrupted_once)
    lane, _ = _lane()
    queued = Job(lambda: 42)
    with pytest.raises(Interrupted):
        lane.enqueue(queued)
    assert not queued.done
    lane.settle([queued])
    deadline = time.monotonic() + 5
    while not queued.done:  # bounded: without a worker it would never run
        assert time.monotonic() < deadline, "the settled job never ran: no worker started"
        time.sleep(0.01)
    assert queued.result() == 42
    assert calls == ["tensorcast-lane-0-1", "tensorcast-lane-0-1"]


def test_breaking_a_lane_whose_abort_blocks_returns_and_raises_peer_error() -> None:
    """An NCCL abort can block (NVIDIA/nccl #829, #549). Breaking the lane marks it first,
    runs the abort on a thread of its own and waits for it a bounded time, so the thread
    that broke it goes on, and the jobs queued behind fail with ``PeerError``."""
    release = threading.Event()
    aborted_on: list[str] = []

    def abort() -> None:
        aborted_on.append(threading.current_thread().name)
        release.wait(30)

    lane = Lane("0-1", abort, idle_exit_s=0.2, abort_wait_s=0.2)
    started = time.monotonic()
    lane.break_(RuntimeError("a payload failed"))
    assert time.monotonic() - started < 5, "break_ waited for the abort"
    assert aborted_on == ["tensorcast-abort-0-1"]
    with pytest.raises(PeerError, match="a payload failed"):
        lane.check()
    lane.break_(RuntimeError("again"))  # the first cause wins; one abort
    assert len(aborted_on) == 1
    release.set()


def test_a_deadline_break_on_the_worker_goes_on_to_the_queued_jobs() -> None:
    """The worker breaks a lane whose device work is past its deadline; with an abort
    that blocks, it still runs the jobs queued behind, which raise ``PeerError``."""
    from tensorcast.transport.testing import FakeStreams

    release = threading.Event()
    lane = Lane("0-1", lambda: release.wait(30), idle_exit_s=0.2, abort_wait_s=0.2)
    streams = FakeStreams()
    streams.hold = True  # never done: a dead peer
    lane.inflight.add(streams, streams.record(), None, 0.1)
    started = time.monotonic()
    while lane.broken is None:
        assert time.monotonic() - started < 5, "the deadline did not break the lane"
        time.sleep(0.01)
    job = _queued(lane, lane.check)
    with pytest.raises(PeerError, match="deadline"):
        job.result()
    assert time.monotonic() - started < 5
    release.set()


def test_a_device_lane_s_worker_ignores_other_threads_captures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker of a lane on a GPU takes the thread-local capture mode before any job:
    its CUDA calls (a deadline's event query, pinned staging) come at moments of its own,
    and a global-mode graph capture on the caller's thread must not count them."""
    import torch

    from tensorcast.transport import lane as _lane_module

    taken: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(
        _lane_module, "apart_from_captures", lambda: taken.append(threading.current_thread().name)
    )
    lane = Lane("cap", lambda: None, 0, idle_exit_s=0.1)
    job = _queued(lane, lambda: taken.append("job"))
    job.result()
    assert taken == ["tensorcast-lane-cap", "job"]


def test_a_guarded_job_never_runs_on_a_broken_lane_inline_or_on_the_worker() -> None:
    """A pass's step is guarded: on a broken lane it fails with the lane's PeerError
    before it runs (a source pulls no batch it could not send); an unguarded job (a
    pass's close) still runs."""
    lane, aborted = _lane()
    lane.break_(RuntimeError("peer gone"))
    ran: list[str] = []
    inline: Job[None] = Job(lambda: ran.append("inline"), guarded=True)
    lane.start(inline, lambda: 0)
    with pytest.raises(PeerError, match="failed earlier"):
        inline.result()
    gate = threading.Event()
    busy = _queued(lane, lambda: gate.wait(5))
    queued: Job[None] = Job(lambda: ran.append("worker"), guarded=True)
    lane.enqueue(queued)
    plain = _queued(lane, lambda: ran.append("plain"))
    gate.set()
    busy.result()
    with pytest.raises(PeerError, match="failed earlier"):
        queued.result()
    plain.result()
    assert ran == ["plain"] and aborted == ["abort"]


def test_a_suspect_lane_breaks_at_its_next_job_unless_the_peers_came() -> None:
    """NOTE [ A call that does not take its part ]: after a setup that failed here for want
    of peers, the lane's next job asks whether they came to it since; where they did not
    (or the store cannot say), the lane breaks before the job takes a frame."""
    for came, broken in ((lambda: True, False), (lambda: False, True), (lambda: 1 / 0, True)):
        lane, aborted = _lane()
        cause = RuntimeError("rank 2: rank(s) [0, 1] did not set up ...")
        lane.suspects.append((RuntimeError("came"), lambda: True))  # an earlier one, cleared
        lane.suspects.append((cause, came))  # type: ignore[arg-type]
        ran: list[int] = []

        def step(ran: list[int] = ran, lane: Lane = lane) -> int:
            lane.check()  # what a role does first
            ran.append(1)
            return 1

        if broken:
            with pytest.raises(PeerError, match="did not set up"):
                lane.run(step, lambda: 0)
            assert lane.broken is cause and aborted == ["abort"] and not ran
        else:
            assert lane.run(step, lambda: 0) == 1 and lane.broken is None
        assert lane.suspects == []  # asked once
    # a queued job (a loader's prefetched step) settles them too, before it is queued
    lane, _ = _lane()
    cause = RuntimeError("rank 1: rank(s) [0] did not set up ...")
    lane.suspects.append((cause, lambda: False))
    job: Job[int] = Job(lambda: 1, guarded=True)
    lane.enqueue(job)
    assert lane.broken is cause
    with pytest.raises(PeerError):
        job.result()
