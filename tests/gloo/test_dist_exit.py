"""Nothing at exit waits on the network (NOTE [ Interpreter exit ] in tensorcast.transport.exits).

- The source rank that also hosts the c10d store freezes (SIGSTOP, a hung node), as under
  ``env://``, ``mp.spawn`` or Lightning's launcher: its peer raises ``PeerError`` within its
  timeout and its process then exits, code 1, at once (it used to sit in an exit hook's
  store write queued behind the diagnosis's request, for good).
- A process that imports tensorcast and builds nothing makes no store request at exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist
from subprocs import LAUNCHER_ENV, RANK_PREAMBLE

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 3.0  # the loader's; the diagnosis of a store that does not answer adds seconds
EXITED_WITHIN_S = 10.0

_FROZEN = """
import signal
import tensorcast as tc

def batches():
    for i in range(1000):
        if i == 2:
            os.kill(os.getpid(), signal.SIGSTOP)  # the whole process, the store with it
        yield {"x": i}

loader = tc.BroadcastingDataLoader(
    source=batches() if RANK == 0 else None, group=dist.group.WORLD, src=0, timeout=TIMEOUT_S
)
print(f"STARTED {time.monotonic():.3f}", flush=True)
try:
    for batch in loader:
        print(f"rank {RANK}: batch {batch['x']}", flush=True)
except tc.PeerError:
    print(f"PEER_ERROR {time.monotonic():.3f}", flush=True)
    raise
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def test_a_rank_whose_store_host_froze_exits_with_code_1(tmp_path: Path) -> None:
    code = RANK_PREAMBLE + _FROZEN
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), "2", str(TIMEOUT_S), str(tmp_path / "port")],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for r in range(2)
    ]
    try:
        # the peer: PeerError within its timeout and the diagnosis's bounds, then its exit
        out, _ = procs[1].communicate(timeout=90)
        exited = time.monotonic()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
            p.communicate()
    raised = [float(line.split()[1]) for line in out.splitlines() if line.startswith("PEER_ERROR")]
    assert raised, out[-4000:]
    started = [float(x.split()[1]) for x in out.splitlines() if x.startswith("STARTED")]
    # within its timeout, and the diagnosis's bounds on a store that does not answer
    assert raised[0] - started[0] < TIMEOUT_S + 3 * 2.0 + 5.0, out[-4000:]
    assert "PeerError" in out and "heartbeat cannot be read" in out, out[-4000:]
    assert procs[1].returncode == 1, out[-4000:]
    assert exited - raised[0] < EXITED_WITHIN_S, out[-4000:]


def test_an_exit_with_no_loader_built_makes_no_store_request(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    code = (
        "import torch.distributed as dist\n"
        f"store = dist.TCPStore('127.0.0.1', {store.port}, 1, is_master=False)\n"
        "dist.init_process_group('gloo', store=store, rank=0, world_size=1)\n"
        "import tensorcast\n"
        "print(store.num_keys(), flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert int(done.stdout.split()[-1]) == store.num_keys()  # nothing was set at exit
