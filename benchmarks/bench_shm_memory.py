"""Host memory of a 61 MB batch stream over one host's ranks, with the shared-memory lane
and with ``shm=False``: each rank's resident memory, counting shared pages once.

    torchrun --nproc-per-node 4 benchmarks/bench_shm_memory.py [--steps 20]

Each rank iterates a ``BroadcastingDataLoader`` of ``audio_large`` batches (a new batch
each step, kept for one step as a training loop does), then reports its ``Pss`` (resident
memory with every shared page split among the processes that map it, so the arena is
counted once over the host) and its ``Rss``, less what it held before the stream (the
source's batch included). Rank 0 prints the sums.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist

import tensorcast as tc
from tensorcast.bench.workloads import make_workload, next_step


def _memory() -> dict[str, int]:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _stream(shm: bool | None, steps: int) -> dict[str, int]:
    rank = dist.get_rank()
    batch = make_workload("audio_large") if rank == 0 else None
    gc.collect()
    before = _memory()

    def source():  # a new batch's values each step, the same tensors
        for step in range(steps):
            next_step("audio_large", batch, step)
            yield batch

    loader = tc.BroadcastingDataLoader(
        source() if rank == 0 else None, group=dist.group.WORLD, src=0, shm=shm
    )
    for _ in loader:  # the batch is held for one step, then dropped
        pass
    gc.collect()
    dist.barrier()
    mem = {k: v - before[k] for k, v in _memory().items()}
    stats = loader.stats()
    mem["shm_bytes"], mem["wire_bytes"] = stats.shm_bytes, stats.wire_bytes
    return mem


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--shm", choices=["auto", "off"], default="auto")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mem = _stream(None if args.shm == "auto" else False, args.steps)
    got: list[dict[str, int]] = [{}] * dist.get_world_size()
    dist.all_gather_object(got, mem)
    if dist.get_rank() == 0:
        pss = sum(m["Pss"] for m in got) / 1e6
        rss = sum(m["Rss"] for m in got) / 1e6
        print(
            f"shm={args.shm}: {len(got)} ranks, the stream's Pss {pss:.0f} MB in all (Rss "
            f"{rss:.0f} MB), by rank {[round(m['Pss'] / 1e6) for m in got]} MB; "
            f"rank 1 got {got[1]['shm_bytes'] / 1e6:.0f} MB through shared memory, "
            f"{got[1]['wire_bytes'] / 1e6:.0f} MB over the wire (pid {os.getpid()})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
