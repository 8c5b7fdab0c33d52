"""What ``loader.stats()`` costs when nobody reads it: its hooks against a tiny step.

Every ``next()`` of a BroadcastingDataLoader records a few numbers (see NOTE [ Where a
step's time goes ] in ``tensorcast/loader/stats.py``). This measures, in one run on 2 local
gloo ranks:

- ``step``: the median time of one ``next()`` of a ``prefetch=0`` loader on the tiny
  workload (16 bytes), the one where a fixed cost per step shows most;
- ``hooks``: the median time of exactly what the hooks add to one step on the source
  (four clock reads, the ``__next__`` wrapper's extra call, ``Recorder.job`` and
  ``Recorder.handed_out``), timed in a loop on the same rank in the same run;

and prints ``hooks / step``. ``--step-only`` runs the first part alone, which also works
on a tree without stats (``PYTHONPATH=<older checkout>``), for alternating A/B runs.

    python benchmarks/bench_stats.py
    python benchmarks/bench_stats.py --steps 3000 --step-only
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tensorcast as tc

REPEATS = 2000  # hook loops per sample


def _tiny() -> Any:
    """The tiny workload's batch, forever (tensorcast.bench's, built here so that this
    script also runs on an older tree)."""
    batch = {"step": 7, "x": torch.randn(4, generator=torch.Generator().manual_seed(1234))}
    while True:
        yield batch


def step_times(steps: int) -> list[float]:
    """Seconds per next() of a prefetch=0 loader on the tiny workload, slowest rank."""
    source = _tiny() if dist.get_rank() == 0 else None
    loader = tc.BroadcastingDataLoader(source, group=dist.group.WORLD, src=0, prefetch=0)
    it = iter(loader)
    for _ in range(50):
        next(it)
    times = torch.zeros(steps, dtype=torch.float64)
    dist.barrier()
    for i in range(steps):
        t0 = time.perf_counter()
        next(it)
        times[i] = time.perf_counter() - t0
    it.close()  # type: ignore[attr-defined]
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def hook_times(samples: int) -> list[float]:
    """Seconds per step of the hooks alone, as the source runs them (median of loops)."""
    from tensorcast.loader.stats import Recorder

    recorder = Recorder()
    clock = time.perf_counter

    def wrapped() -> None:  # what Pass.__next__ adds around Pass._next
        return None

    out = []
    for _ in range(samples):
        t0 = clock()
        for _ in range(REPEATS):
            called = clock()
            wrapped()
            started = clock()
            pulled = clock() - started
            started = clock()
            recorder.job(pulled, clock() - started, 16)
            recorder.handed_out(called)
        loop = clock() - t0
        t0 = clock()
        for _ in range(REPEATS):  # the loop's own cost, taken off
            pass
        out.append((loop - (clock() - t0)) / REPEATS)
        recorder = Recorder()  # a fresh pass: its bins fold as a long pass's do
    return out


def _rank(rank: int, world: int, store_dir: str, args: argparse.Namespace, q: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        steps = step_times(args.steps)
        hooks = hook_times(args.samples) if rank == 0 and not args.step_only else []
        if rank == 0:
            q.put((steps, hooks))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000, help="timed next() calls (default 3000)")
    p.add_argument("--samples", type=int, default=30, help="hook loops of 2000 (default 30)")
    p.add_argument("--step-only", action="store_true", help="time the loader's step alone")
    args = p.parse_args()
    os.environ.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="tensorcast-bench-stats-") as tmp:
        mp.spawn(_rank, args=(2, tmp, args, q), nprocs=2)
        steps, hooks = q.get(timeout=10)
    step = statistics.median(steps)
    print(f"tensorcast {tc.__version__} from {os.path.dirname(tc.__file__)}")
    print(f"tiny, prefetch=0, 2 gloo ranks: next() {step * 1e6:.1f} us median over {len(steps)} "
          f"steps (p90 {sorted(steps)[int(0.9 * len(steps))] * 1e6:.1f} us)")  # fmt: skip
    if hooks:
        hook = statistics.median(hooks)
        print(f"stats hooks per step: {hook * 1e6:.2f} us median over {len(hooks)} loops of "
              f"{REPEATS}; hooks / step = {100 * hook / step:.2f}%")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
