"""Running a command in a subprocess under a hard timeout, for tests that launch ranks
(:func:`run_killable`), or ranks of a gloo group themselves, rank 0 hosting the store
(:func:`run_ranks`, for what needs a real TCPStore: its host exiting, its logs).

The command gets a process group of its own, so a launcher (torchrun, a Lightning Trainer)
and every rank it starts are killed together on a hang, and the test fails with the tail
of what they printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: What an outer launcher may have set; the launchers under test pick their own ports.
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


def run_killable(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> tuple[int, str]:
    """Run ``args`` to the end within ``timeout`` seconds; its exit code and output."""
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # one process group: the launcher and every rank it starts
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(args)} did not finish within {timeout}s:\n{out[-6000:]}")
    return proc.returncode, out


#: What each rank of :func:`run_ranks` runs first: rank 0 hosts a TCPStore on a free port
#: (as ``init_process_group`` does under ``env://`` without torchrun's agent), the others
#: read the port from a file; then the default group. ``RANK``, ``WORLD`` and ``TIMEOUT_S``
#: are the script's globals.
RANK_PREAMBLE = """
import datetime, os, sys, time
import torch.distributed as dist
RANK, WORLD, TIMEOUT_S, PORT_FILE = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
if RANK == 0:
    STORE = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    with open(PORT_FILE + ".tmp", "w") as f:
        f.write(str(STORE.port))
    os.replace(PORT_FILE + ".tmp", PORT_FILE)
else:
    while not os.path.exists(PORT_FILE):
        time.sleep(0.02)
    with open(PORT_FILE) as f:
        STORE = dist.TCPStore("127.0.0.1", int(f.read()), WORLD, is_master=False)
dist.init_process_group("gloo", store=STORE, rank=RANK, world_size=WORLD,
                        timeout=datetime.timedelta(seconds=TIMEOUT_S))
"""


def run_ranks(
    script: str, world: int, tmp: Path, *, timeout: float, pg_timeout: float = 60.0
) -> list[tuple[int, str, str]]:
    """Run ``RANK_PREAMBLE + script`` as ``world`` processes, rank 0 hosting the store;
    each rank's exit code, stdout and stderr. A rank still running after ``timeout``
    seconds fails the test, every rank killed, with what each printed."""
    port_file = tmp / "store-port"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    code = RANK_PREAMBLE + script
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), str(world), str(pg_timeout), str(port_file)],
            cwd=tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(world)
    ]
    outs: list[tuple[int, str, str]] = []
    deadline = time.monotonic() + timeout
    hung = False
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        outs.append((p.returncode, out, err))
    if hung:
        report = "\n".join(
            f"--- rank {r} (exit {rc})\n{out[-2000:]}\n{err[-2000:]}"
            for r, (rc, out, err) in enumerate(outs)
        )
        pytest.fail(f"a rank did not finish within {timeout}s:\n{report}")
    return outs
