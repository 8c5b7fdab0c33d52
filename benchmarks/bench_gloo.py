"""Two costs of raw gloo that tensorcast's frames are built around, without tensorcast.

In one run with interleaved iterations (order rotated, a barrier before each, the slowest
rank, medians):

1. *A small message as a broadcast or as sends.* ProcessGroupGloo queues a broadcast for a
   worker thread on every rank, but posts a send or a receive on the calling thread.
   tensorcast's first message of each frame (4 KiB in steady state) is therefore one send
   from the source to each receiver on groups of up to four ranks (see
   ``tensorcast/transport/wire.py``):

   - ``header_broadcast``: one broadcast of 4 KiB;
   - ``header_sends``: the same bytes as a send to each receiver, received with ``recv``.

2. *A payload whose receive is posted late.* gloo sends a message once the receiver has
   posted its receive. A frame whose payload follows its first message therefore waits
   for receivers to read that message, unless receivers know its size before the first
   message arrives and post both receives at once: tensorcast's promised payloads (NOTE
   [ Promised payloads ] in ``tensorcast/transport/``), for payloads whose size repeats. This measures what that
   saves:

   - ``one``: one broadcast of the payload's bytes (the floor);
   - ``read_first``: a 4 KiB first message, then the payload; receivers post the payload's
     receive once the first message has arrived;
   - ``posted_together``: the same two broadcasts, both posted at once on every rank.

3. *The source's copy before a payload, whole or in chunks.* A tree's payload is copied
   into one buffer before it travels (its own tree views that buffer). Copying in chunks,
   each posted as soon as it is copied, would overlap the copy with the transfer, if the
   machine had a core to spare for it:

   - ``copy_then_send``: the source copies the payload, then broadcasts it (receivers
     wait in the broadcast meanwhile, as for a promised payload);
   - ``copy_in_chunks``: the source copies and posts four chunks one after another;
     receivers post all four at once.

    python benchmarks/bench_gloo.py
    python benchmarks/bench_gloo.py --mib 58.6 --iters 60 --world-size 4
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

_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
FIRST_BYTES = 4096
HEADER = ("header_broadcast", "header_sends")
PAYLOAD = ("one", "read_first", "posted_together")
COPY = ("copy_then_send", "copy_in_chunks")
METHODS = HEADER + PAYLOAD + COPY
CHUNKS = 4
_TAG = 7


def _rank(rank: int, world: int, store_dir: str, nbytes: int, iters: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    first = torch.zeros(FIRST_BYTES, dtype=torch.uint8)
    payload = torch.zeros(nbytes, dtype=torch.uint8)
    batch = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)  # the source's tree, packed
    step = -(-nbytes // CHUNKS)
    chunks = [slice(start, min(start + step, nbytes)) for start in range(0, nbytes, step)]

    group = dist.group.WORLD
    assert group is not None

    def header_broadcast() -> None:
        dist.broadcast(first, 0)

    def header_sends() -> None:  # the process group's own calls, as tensorcast makes them
        if rank == 0:
            works = [group.send([first], peer, _TAG) for peer in range(1, world)]
            for work in works:
                work.wait()
        else:
            group.recv([first], 0, _TAG).wait()

    def one() -> None:
        dist.broadcast(payload, 0)

    def read_first() -> None:
        head = dist.broadcast(first, 0, async_op=True)
        if rank == 0:
            body = dist.broadcast(payload, 0, async_op=True)
            head.wait()
            body.wait()
        else:
            head.wait()  # a receiver reads the first message, then posts the payload's
            dist.broadcast(payload, 0)

    def posted_together() -> None:
        head = dist.broadcast(first, 0, async_op=True)
        body = dist.broadcast(payload, 0, async_op=True)
        head.wait()
        body.wait()

    def copy_then_send() -> None:
        if rank == 0:
            payload.copy_(batch)
        dist.broadcast(payload, 0)

    def copy_in_chunks() -> None:
        works = []
        for chunk in chunks:
            if rank == 0:
                payload[chunk].copy_(batch[chunk])
            works.append(dist.broadcast(payload[chunk], 0, async_op=True))
        for work in works:
            work.wait()

    calls = {
        "copy_then_send": copy_then_send,
        "copy_in_chunks": copy_in_chunks,
        "header_broadcast": header_broadcast,
        "header_sends": header_sends,
        "one": one,
        "read_first": read_first,
        "posted_together": posted_together,
    }
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    warmup = 3
    for it in range(warmup + iters):
        k = it % len(METHODS)
        order = METHODS[k:] + METHODS[:k]
        elapsed = torch.zeros(len(METHODS), dtype=torch.float64)
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            calls[name]()
            elapsed[METHODS.index(name)] = time.perf_counter() - t0
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if it >= warmup:
            for i, name in enumerate(METHODS):
                times[name].append(float(elapsed[i]))
    if rank == 0:
        out.put({name: statistics.median(t) for name, t in times.items()})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=9.77, help="payload size (default 9.77 MiB)")
    p.add_argument("--iters", type=int, default=200, help="timed iterations (default 200)")
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args(argv)
    os.environ.update(_ENV)
    import torch.multiprocessing as mp

    nbytes = int(args.mib * (1 << 20))
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as store_dir:
        procs = [ctx.Process(target=_rank, args=(r, args.world_size, store_dir, nbytes,
                                                 args.iters, out))
                 for r in range(args.world_size)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(600)
        if any(proc.exitcode != 0 for proc in procs):
            print("a rank failed", file=sys.stderr)
            return 1
        medians = out.get()
    print(f"world size {args.world_size}, {args.iters} iterations (medians of the slowest rank)")
    print(f"\na {FIRST_BYTES}-byte message")
    for name in HEADER:
        ratio = medians[name] / medians["header_broadcast"]
        print(f"{name:16s} {medians[name] * 1e3:9.3f} ms  {ratio:5.2f}x header_broadcast")
    print(f"\na {nbytes:,}-byte payload after a {FIRST_BYTES}-byte first message")
    for name in PAYLOAD:
        ratio = medians[name] / medians["one"]
        print(f"{name:16s} {medians[name] * 1e3:9.3f} ms  {ratio:5.2f}x one")
    print(f"\nthe same payload, copied on the source first ({CHUNKS} chunks: posted as copied)")
    for name in COPY:
        ratio = medians[name] / medians["one"]
        print(f"{name:16s} {medians[name] * 1e3:9.3f} ms  {ratio:5.2f}x one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
