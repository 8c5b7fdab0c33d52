"""Unit tests of the lane: one FIFO of jobs per group, inline when idle, on its worker
otherwise (see NOTE [ One ordered lane ] in ``tensorcast.transport.lane``). No process
group: the jobs are plain functions."""

from __future__ import annotations

import threading
import time

import pytest

from tensorcast import PeerError
from tensorcast.transport.job import Job
from tensorcast.transport.lane import Lane


def _lane(**kw: float) -> tuple[Lane, list[str]]:
    aborted: list[str] = []
    return Lane("0-1", lambda: aborted.append("abort"), **kw), aborted


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

    job = lane.submit(first)  # on the worker; holds the lane until the gate opens
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
    jobs = [lane.submit(lambda i=i: seen.append(i) or i) for i in range(50)]
    assert [j.result() for j in jobs] == list(range(50))
    assert seen == list(range(50))


def test_the_worker_leaves_when_idle_and_comes_back_with_the_next_job() -> None:
    # A name of its own: the workers of the other tests' lanes stay for their 5 idle seconds.
    lane = Lane("idle-exit", lambda: None, idle_exit_s=0.05)
    assert lane.submit(lambda: 1).result() == 1
    deadline = time.monotonic() + 5
    while any(t.name == "tensorcast-lane-idle-exit" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the idle worker did not leave"
        time.sleep(0.01)
    assert lane.submit(lambda: 2).result() == 2


def test_submitting_from_a_job_of_the_same_lane_is_refused() -> None:
    lane, _ = _lane()
    job = lane.submit(lambda: lane.submit(lambda: None))
    with pytest.raises(RuntimeError, match="inside a loader's source iterator"):
        job.result()
    with pytest.raises(RuntimeError, match="inside a loader's source iterator"):
        lane.run(lambda: lane.run(lambda: None, lambda: 0), lambda: 0)


def test_a_jobs_exception_reaches_whoever_waits_for_it() -> None:
    lane, _ = _lane()
    job = lane.submit(lambda: 1 / 0)
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
