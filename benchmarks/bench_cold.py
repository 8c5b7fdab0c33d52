"""What one operation costs on a small frame's path: cold, right after a step, and warm.

Between two ``next()`` calls a training step runs the model, and a tiny batch's frame
then runs on a CPU whose caches hold the model's work. This times single operations of
the kind a frame makes (a tensor slice, ``numpy()``, ``detach()``, ``copy_``, entering
``no_grad``, a Python call) in that state: each rank runs a barrier and a broadcast, as a
step would between two batches, then times the operation once (cold) and once more right
after (warm). Medians over iterations, per rank; ranks pinned to cores as ``--pin`` does
in ``bench_broadcast.py``.

    python benchmarks/bench_cold.py
    python benchmarks/bench_cold.py --iters 400 --world-size 2
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


def _operations() -> dict[str, Callable[[], Any]]:
    import numpy as np
    import torch

    buffer = torch.zeros(4096, dtype=torch.uint8)
    host = buffer.numpy()
    leaf = buffer[64:80].view(torch.float32)
    source = torch.zeros(16, dtype=torch.uint8)
    cdata = buffer.untyped_storage()._cdata
    small = np.zeros(16, dtype=np.uint8)

    def no_grad() -> None:
        with torch.no_grad():
            pass

    def inference_mode_off() -> None:
        with torch.inference_mode(False):
            pass

    return {
        "python call": lambda: None,
        "tensor.numel()": buffer.numel,
        "storage use count": lambda: torch._C._storage_Use_Count(cdata),
        "tensor[a:b]": lambda: buffer[:64],
        "tensor.numpy()": buffer.numpy,
        "tensor.detach()": leaf.detach,
        "as_strided": lambda: torch.as_strided(leaf, (4,), (1,), 0),
        "copy_ (16 B)": lambda: buffer[:16].copy_(source),
        "numpy copy (16 B)": lambda: host.__setitem__(slice(64, 80), small),
        "torch.empty (16 B)": lambda: torch.empty(16, dtype=torch.uint8),
        "with no_grad()": no_grad,
        "with inference_mode(False)": inference_mode_off,
        "is_inference_mode_enabled()": torch.is_inference_mode_enabled,
    }


def _rank(rank: int, world: int, store_dir: str, iters: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    step = torch.zeros(16, dtype=torch.uint8)  # what stands for a training step's own work
    ops = _operations()
    cold: dict[str, list[float]] = {name: [] for name in ops}
    warm: dict[str, list[float]] = {name: [] for name in ops}
    for it in range(iters + 10):
        for name, op in ops.items():
            dist.barrier()
            dist.broadcast(step, 0)
            dist.barrier()
            t0 = time.perf_counter()
            op()
            t1 = time.perf_counter()
            op()
            t2 = time.perf_counter()
            if it >= 10:
                cold[name].append(t1 - t0)
                warm[name].append(t2 - t1)
    medians = {n: (statistics.median(cold[n]), statistics.median(warm[n])) for n in ops}
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, medians)
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200, help="timed iterations (default 200)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    args = parser.parse_args(argv)

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="tensorcast-cold-") as tmp:
        procs = [ctx.Process(target=_rank, args=(r, args.world_size, tmp, args.iters, queue))
                 for r in range(args.world_size)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=600)
        for p in procs:
            p.join(60)
    print(f"$ python benchmarks/bench_cold.py --iters {args.iters} --world-size "
          f"{args.world_size}")
    print("median us per call, right after a barrier and a broadcast (cold) and again "
          "right after (warm), per rank")
    header = "".join(f"  rank {r} cold   warm" for r in range(args.world_size))
    print(f"{'operation':<30}{header}")
    for name in rows[0]:
        cells = "".join(f"  {rows[r][name][0] * 1e6:9.1f} {rows[r][name][1] * 1e6:6.1f}"
                        for r in range(args.world_size))
        print(f"{name:<30}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
