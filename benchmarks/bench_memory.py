"""Memory a rank keeps when every batch has another shape, trimmed and not.

Bucketed speech batches change shape every step. For ``trim`` on and then off, this script
starts ``--world`` gloo ranks (fresh processes, so neither run inherits the other's heap)
that run ``BroadcastingDataLoader`` over ``--steps`` padded audio batches, each of a shape
of its own (``--rows`` rows of a length drawn from ``--min-samples``..``--max-samples``,
each row padded with zeros after a random share), and report every rank's RSS after the
warm-up, at the end, and its peak (``VmHWM``). The contract: trimmed, RSS stays within the
reuse bound (NOTE [ Memory handed out ], ``transport/pool.py``) of the same run untrimmed.
Each batch is checked against the source's after it arrives.

    python benchmarks/bench_memory.py
    python benchmarks/bench_memory.py --steps 200 --world 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tensorcast as tc

WARMUP = 20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _batch(step: int, args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    span = args.max_samples - args.min_samples
    samples = args.min_samples + int(torch.randint(0, span + 1, (1,), generator=g))
    audio = torch.randn(args.rows, samples, generator=g)
    lens = (torch.rand(args.rows, generator=g) * samples).long().clamp(min=1)
    lens[0] = samples
    audio[torch.arange(samples) >= lens[:, None]] = 0.0
    return {"audio": audio, "audio_lens": lens, "step": step}


def _rank(
    rank: int, world: int, store: str, trim: bool, args: argparse.Namespace, out: Any
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    source = (_batch(s, args) for s in range(args.steps)) if rank == 0 else None
    loader = tc.BroadcastingDataLoader(source, group=dist.group.WORLD, src=0, trim=trim)
    start = 0
    for step, got in enumerate(loader):
        want = _batch(step, args)
        if not torch.equal(got["audio"], want["audio"]):
            raise AssertionError(f"rank {rank}: batch {step} differs")
        del got, want
        if step == WARMUP:
            start = _status("VmRSS")
    end = _status("VmRSS")
    out.put((trim, rank, start, end, _status("VmHWM")))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--min-samples", type=int, default=60_000)
    parser.add_argument("--max-samples", type=int, default=140_000)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    results: list[dict[str, Any]] = []
    for trim in (True, False):
        out = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            store = os.path.join(tmp, "store")
            procs = [
                ctx.Process(target=_rank, args=(r, args.world, store, trim, args, out))
                for r in range(args.world)
            ]
            for p in procs:
                p.start()
            for _ in procs:
                t, rank, start, end, peak = out.get(timeout=600)
                results.append(dict(trim=t, rank=rank, rss_warm=start, rss_end=end, peak=peak))
            for p in procs:
                p.join(60)
            if any(p.exitcode for p in procs):
                print(f"a rank failed (trim={trim})", file=sys.stderr)
                return 1
    largest = 4 * args.rows * args.max_samples
    print(
        f"{args.steps} batches of {args.rows} rows x {args.min_samples}-{args.max_samples} "
        f"float32 samples (largest {largest / 2**20:.1f} MiB), {args.world} gloo ranks"
    )
    print(f"{'trim':>5} {'rank':>4} {'RSS warm MiB':>12} {'RSS end MiB':>11} {'peak MiB':>8}")
    for r in sorted(results, key=lambda r: (not r["trim"], r["rank"])):
        print(f"{r['trim']!s:>5} {r['rank']:>4} {r['rss_warm'] / 2**20:>12.1f} "
              f"{r['rss_end'] / 2**20:>11.1f} {r['peak'] / 2**20:>8.1f}")  # fmt: skip
    for rank in range(args.world):
        on, off = (
            next(r for r in results if r["trim"] is t and r["rank"] == rank) for t in (True, False)
        )
        print(f"rank {rank}: trimmed - untrimmed at the end {(on['rss_end'] - off['rss_end']) / 2**20:+.1f} MiB "
              f"({(on['rss_end'] - off['rss_end']) / largest:+.2f} largest batches)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
