"""Running a command in a subprocess under a hard timeout, for tests that launch ranks.

The command gets a process group of its own, so a launcher (torchrun, a Lightning Trainer)
and every rank it starts are killed together on a hang, and the test fails with the tail
of what they printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
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
