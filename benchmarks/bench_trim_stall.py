"""Where trimming's work runs in training: the data stall of a loader with and without prefetch.

Under a launcher, every rank runs a ``BroadcastingDataLoader`` of one built-in workload (the
source yields the same batch each step) around a "model" whose step is a sleep of ``C`` ms
(sleeping frees the GIL and the cores, as a step of GPU work does), for ``trim`` on and off
and ``prefetch`` 0 and 1, and reports each one's median step and data stall (``loader.stats()``:
the time the caller waited inside ``next()``), the slowest rank's. ``C`` defaults to the
floor's median, one broadcast of a preallocated buffer of the batch's bytes, measured first.

With ``prefetch=0`` the stall is the whole transfer, the source's scan and compact copy
included; with ``prefetch=1`` they run on the lane's worker under the model's step, so the
stall is what the step did not hide.

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_trim_stall.py
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_trim_stall.py --workload fbank_padded --step-ms 60
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import tensorcast as tc
from tensorcast.bench import baselines, workloads


def _floor_ms(nbytes: int, iters: int) -> float:
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters + 3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(buffer, 0)
        if i >= 3:
            times[i - 3] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.tolist()) * 1e3


def _run(batch: Any, trim: bool, prefetch: int, step_s: float, steps: int) -> dict[str, float]:
    """Median step and stall in ms, and the stall's share of the steps, slowest rank's."""
    source = iter(lambda: batch, None) if batch is not None else None  # the same batch, forever
    world = dist.group.WORLD
    loader = tc.BroadcastingDataLoader(source, group=world, src=0, prefetch=prefetch, trim=trim)
    it = iter(loader)
    for _ in range(5):  # warm: the channel, the pools, the kept outputs
        next(it)
    dist.barrier()
    for _ in range(steps):
        out = next(it)
        time.sleep(step_s)  # the model's step
        del out
    stats = loader.stats(last=steps)
    it.close()  # type: ignore[attr-defined]
    recent = stats.recent or stats
    mine = torch.tensor(
        [recent.step.median * 1e3, recent.stall.median * 1e3, recent.stall_share],
        dtype=torch.float64,
    )
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return {"step_ms": float(mine[0]), "stall_ms": float(mine[1]), "stall_share": float(mine[2])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="audio_padded", choices=workloads.WORKLOADS)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--step-ms", type=float, default=None, help="the model's step (default: the floor)"
    )
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batch = workloads.make_workload(args.workload) if rank == 0 else None
    sizes = torch.tensor([baselines.batch_nbytes(batch) if batch is not None else 0])
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    nbytes = int(sizes[0])
    floor = _floor_ms(nbytes, 15)
    step_ms = floor if args.step_ms is None else args.step_ms
    rows = []
    for trim in (True, False):
        for prefetch in (0, 1):
            rows.append((trim, prefetch, _run(batch, trim, prefetch, step_ms / 1e3, args.steps)))
    if rank == 0:
        print(
            f"{args.workload}: {nbytes / 1e6:.1f} MB, {dist.get_world_size()} gloo ranks, the "
            f"floor {floor:.1f} ms, a model step of {step_ms:.1f} ms, {args.steps} steps; "
            f"medians, the slowest rank's"
        )
        print(f"  {'trim':<6} {'prefetch':>8} {'step ms':>9} {'stall ms':>9} {'stall share':>12}")
        for trim, prefetch, r in rows:
            print(
                f"  {trim!s:<6} {prefetch:>8} {r['step_ms']:>9.1f} {r['stall_ms']:>9.2f} "
                f"{r['stall_share']:>12.1%}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
