"""Interpreter exit (NOTE [ Interpreter exit ] in ``tensorcast.transport.exits``): what a
lane does when the exit hook runs, and a whole process whose lanes are busy as its script
ends."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from tensorcast.transport import exits as _exits
from tensorcast.transport.lane import Job, Lane

T = TypeVar("T")


def _lane() -> Lane:
    return Lane("0-1", lambda: None)


def _queued(lane: Lane, fn: Callable[[], T]) -> Job[T]:
    job: Job[T] = Job(fn)
    lane.enqueue(job)
    return job


def test_at_exit_a_lane_drops_its_queue_and_its_worker_ends_after_the_running_job() -> None:
    lane = _lane()
    gate, ran = threading.Event(), []
    running = _queued(lane, lambda: gate.wait(5) and ran.append("running"))
    queued = [_queued(lane, lambda k=k: ran.append(k)) for k in range(3)]
    deadline = time.monotonic() + 5
    while len(lane._jobs) == 4:  # until the worker has taken the first job
        assert time.monotonic() < deadline
        time.sleep(0.01)
    waiter = lane.stop_at_exit()
    assert waiter.thread is not None and waiter.thread.is_alive()
    for job in queued:  # withdrawn, locally: whoever waits is told, nothing ran
        with pytest.raises(RuntimeError, match="interpreter exited before this job ran"):
            job.result()
    gate.set()
    waiter.thread.join(5)
    assert not waiter.thread.is_alive(), "the worker leaves once its running job ends"
    assert running.result() is None and ran == ["running"]


def test_once_the_exit_hook_ran_no_job_is_queued_or_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the exit hook (or once the interpreter is finalizing) a lane refuses every
    job, inline or queued, and starts no thread: a finaliser or an atexit hook that called
    tensorcast then fails loudly instead of waiting on exiting peers."""
    lane = _lane()
    first: Job[int] = Job(lambda: 1)
    lane.start(first, lambda: 0)
    first.result()
    submitted = lane.submitted
    threads = threading.active_count()
    monkeypatch.setitem(_exits.state, "ran", True)
    for call in (
        lambda: lane.enqueue(Job(lambda: 1)),
        lambda: lane.start(Job(lambda: 1), lambda: 0),
        lambda: lane.run(lambda: 1, lambda: 0),
        lambda: lane.settle([Job(lambda: 1)]),
    ):
        with pytest.raises(RuntimeError, match="the interpreter is exiting"):
            call()
    assert lane.submitted == submitted and threading.active_count() == threads


#: A process whose lanes are busy when its script ends: one job running (3 s), more queued.
#: An atexit hook registered before tensorcast's runs after it and tries to queue a job.
EXIT_SCRIPT = r"""
import atexit, sys, threading, time

def late():
    try:
        lane.enqueue(Job(lambda: print("RAN AT EXIT", flush=True)))
    except RuntimeError as e:
        print("REFUSED", e, flush=True)
    print("THREADS", sorted(t.name for t in threading.enumerate()), flush=True)

atexit.register(late)  # before the first lane: runs after tensorcast's hook
from tensorcast.transport.lane import Job, Lane

lane = Lane("0-1", lambda: None)
started = threading.Event()
def running():
    started.set()
    time.sleep(3.0)
    print("RUNNING JOB DONE", flush=True)
lane.enqueue(Job(running))
queued = [Job(lambda k=k: print("QUEUED JOB RAN", k, flush=True)) for k in range(3)]
for job in queued:
    lane.enqueue(job)
def prefetch():  # the program's own daemon thread, waiting for a job when the program ends
    try:
        queued[-1].result()
    finally:
        print("PREFETCH THREAD LEFT", flush=True)
threading.Thread(target=prefetch, daemon=True).start()
started.wait(5)
print("END", time.monotonic(), flush=True)
"""


def test_at_exit_the_running_job_ends_the_queued_ones_never_run_and_nothing_is_queued(
    tmp_path: Path,
) -> None:
    script = tmp_path / "script.py"
    script.write_text(EXIT_SCRIPT)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "RUNNING JOB DONE" in out and "QUEUED JOB RAN" not in out, out
    assert "RAN AT EXIT" not in out and "REFUSED" in out, out
    # the daemon thread inside a wait is ended quietly: no traceback, one line in all
    assert "PREFETCH THREAD LEFT" in out and "Traceback" not in out, out
    said = [line for line in out.splitlines() if line.startswith("tensorcast: at exit")]
    assert len(said) == 1 and "at most 1800 s" in said[0], out  # once, after WARN_AFTER_S
    assert "tensorcast-lane" not in out.split("THREADS", 1)[1], out  # the worker was joined
    assert took < 30, out
