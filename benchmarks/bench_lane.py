"""What running a job on the caller's thread saves: the lane's one trick, measured.

``tensorcast.broadcast`` and ``prefetch=0`` run their job on the caller's thread when the
lane is idle (``Lane.run``), instead of handing it to the lane's worker thread and
waiting (``Lane.enqueue(job)``, then ``job.result()``). In one run, interleaved (a barrier before each,
the slowest rank, medians over iterations), for one small batch:

- ``worker``: the job on the lane's worker thread;
- ``inline``: the same job on the caller's thread, as ``Lane.run`` does when idle;
- ``floor``: one ``dist.broadcast`` of 64 bytes on the default group.

    python benchmarks/bench_lane.py
    python benchmarks/bench_lane.py --iters 3000 --world-size 4 --json bench-results/lane.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the rank launcher

from rankpool import RankPool

METHODS = ("worker", "inline", "floor")


def _rank(rank: int, world: int, iters: int) -> dict[str, list[float]]:
    import functools

    import tensorcast as tc
    from tensorcast.loader import broadcast as _broadcast
    from tensorcast.transport.lane import Job
    from tensorcast.transport.sender import Sender

    tree = {"x": torch.arange(4.0), "ids": [1, 2, 3], "name": "utt-000001"}
    mine = tree if rank == 0 else None
    tc.broadcast(mine, 0)  # sets this rank's role up
    role = _broadcast._broadcast_role(None, 0)
    lane = role.group.lane
    frames_taken = functools.partial(getattr, role, "step")

    def job() -> Any:
        if isinstance(role, Sender):
            return role.send_batch(mine, None)
        return role.recv(None)

    def on_the_worker() -> Any:
        queued: Job[Any] = Job(job)
        lane.enqueue(queued)
        return queued.result()

    floor = torch.zeros(64, dtype=torch.uint8)
    calls = {
        "worker": on_the_worker,
        "inline": lambda: lane.run(job, frames_taken),
        "floor": lambda: dist.broadcast(floor, 0),
    }
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for i in range(iters + 20):
        for name in METHODS[i % 3 :] + METHODS[: i % 3]:  # the order rotates
            dist.barrier()
            start = time.perf_counter()
            calls[name]()
            if i >= 20:
                times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=1500)
    p.add_argument("--json", metavar="PATH", help="write the medians and raw times here")
    args = p.parse_args(argv)
    pool = RankPool(args.world_size, pg_timeout=60)
    try:
        results = pool.run(_rank, args.iters, timeout=600)
    finally:
        pool.close()
    slowest = {m: [max(r[m][i] for r in results) for i in range(args.iters)] for m in METHODS}
    medians = {m: statistics.median(v) * 1e6 for m, v in slowest.items()}
    print(f"world size {args.world_size}, {args.iters} iterations, slowest rank, medians:")
    for m in METHODS:
        print(f"  {m:<7} {medians[m]:8.1f} us   {medians[m] / medians['floor']:5.2f}x floor")
    print(f"  inline / worker: {medians['inline'] / medians['worker']:.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"medians_us": medians, "seconds": slowest}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
