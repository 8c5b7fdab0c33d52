"""Soak: many steps of randomly shaped mixed batches through BroadcastingDataLoader.

Spawns ``world`` gloo ranks on this machine for each requested world size; rank 0 is the
source of a loader over the whole group. Batch ``i`` is a pure function of ``(seed, i)``
(with ``--repeat N``, each random tree is sent for N steps with a new step number),
so every rank regenerates it independently and compares what the loader yielded bit for
bit (the source compares its own rebuilt batch too). Reports steps, batches compared,
mismatches (must be 0), receiver RSS after warm-up and at the end (must stay flat), and
the median and p99 time of one loader step.

    python benchmarks/soak.py --steps 10000 --world-sizes 2,4
    python benchmarks/soak.py --steps 10000 --repeat 4 --rss-slack-mib 128  # repeated trees
    python benchmarks/soak.py --steps 500 --json -        # JSON on stdout

This is a soak, not a benchmark: timings are reported, never asserted. Exits non-zero on
any mismatch, failed rank or timeout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import struct
import sys
import tempfile
import time
from typing import Any

import numpy as np

_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# -- random batches ------------------------------------------------------------------

_TORCH_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                 "float32", "float64", "complex64")
_NUMPY_DTYPES = ("bool", "uint8", "int16", "int32", "int64", "float32", "float64", "complex128")
_TEXT = "abcXYZ 0123 äöü ✓ 𝄞 "


def _shape(rng: np.random.Generator) -> tuple[int, ...]:
    ndim = int(rng.integers(0, 4))
    # Zero-size dimensions now and then, to keep empty tensors in the mix.
    return tuple(int(rng.integers(0, 9)) if rng.random() < 0.05 else int(rng.integers(1, 17))
                 for _ in range(ndim))


def _tensor(rng: np.random.Generator, large: bool) -> Any:
    import torch

    dtype = getattr(torch, _TORCH_DTYPES[int(rng.integers(len(_TORCH_DTYPES)))])
    if large:  # 1 to 8 MiB, one dimension
        itemsize = torch.empty((), dtype=dtype).element_size()
        shape: tuple[int, ...] = (int(rng.integers(1 << 20, 8 << 20)) // itemsize,)
    else:
        shape = _shape(rng)
    n = math.prod(shape)
    if dtype is torch.bool:
        return torch.from_numpy(rng.integers(0, 2, n).astype(np.bool_)).reshape(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.frombuffer(bytearray(rng.bytes(n * itemsize)), dtype=torch.uint8) if n else \
        torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)  # random bits: NaN payloads and -0.0 included


def _leaf(rng: np.random.Generator) -> Any:
    kind = int(rng.integers(0, 10))
    if kind <= 2:
        return _tensor(rng, large=rng.random() < 0.01)
    if kind == 3:
        dt = np.dtype(_NUMPY_DTYPES[int(rng.integers(len(_NUMPY_DTYPES)))])
        shape = _shape(rng)
        if dt == np.bool_:
            return rng.integers(0, 2, shape).astype(np.bool_)
        return np.frombuffer(rng.bytes(math.prod(shape) * dt.itemsize), dtype=dt).reshape(shape)
    if kind == 4:
        return int(rng.integers(-(1 << 62), 1 << 62)) * (1 << int(rng.integers(0, 80)))
    if kind == 5:
        return struct.unpack("<d", rng.bytes(8))[0]  # any float, NaNs included
    if kind == 6:
        n = int(rng.integers(0, 3000)) if rng.random() < 0.2 else int(rng.integers(0, 40))
        return "".join(_TEXT[int(i)] for i in rng.integers(0, len(_TEXT), n))
    if kind == 7:
        return rng.bytes(int(rng.integers(0, 2500)))
    return (None, True, False, 7)[int(rng.integers(0, 4))]


def _node(rng: np.random.Generator, depth: int) -> Any:
    if depth >= 3 or rng.random() < 0.55:
        return _leaf(rng)
    n = int(rng.integers(0, 6))
    kind = int(rng.integers(0, 3))
    children = [_node(rng, depth + 1) for _ in range(n)]
    if kind == 0:
        return {f"k{i}": c for i, c in enumerate(children)}
    return children if kind == 1 else tuple(children)


def make_batch(seed: int, step: int, repeat: int = 1) -> Any:
    """Batch ``step`` of the soak: a pure function of ``(seed, step, repeat)``; now and then
    None. Runs of ``repeat`` steps share one random tree and differ in their step number,
    as a real loader's batches of one structure do: receivers then take their fast paths
    (the tree built ahead, the payload posted before the values are read)."""
    rng = np.random.default_rng([seed, step // repeat])
    if rng.random() < 0.02:
        return None
    keys = int(rng.integers(1, 7))
    batch = {f"f{i}": _node(rng, 1) for i in range(keys)}
    batch["step"] = step
    return batch


class RandomBatches:
    """The source loader: ``steps`` random batches."""

    def __init__(self, steps: int, seed: int, repeat: int):
        self.steps = steps
        self.seed = seed
        self.repeat = repeat

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Any:
        for step in range(self.steps):
            yield make_batch(self.seed, step, self.repeat)


# -- comparing -----------------------------------------------------------------------


def same(got: Any, want: Any) -> bool:
    """Same types, structure and order; tensors, arrays and floats bit for bit."""
    import torch

    if type(got) is not type(want):
        return False
    if isinstance(want, dict):
        return list(got) == list(want) and all(same(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(want, torch.Tensor):
        if got.dtype != want.dtype or got.shape != want.shape:
            return False
        a, b = got.contiguous().reshape(-1), want.contiguous().reshape(-1)
        return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8))) if a.numel() else True
    if isinstance(want, np.ndarray):
        return got.dtype == want.dtype and got.shape == want.shape and \
            got.tobytes() == want.tobytes()
    if isinstance(want, float):
        return struct.pack("<d", got) == struct.pack("<d", want)
    return bool(got == want)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# -- ranks -----------------------------------------------------------------------------


def _rank_main(rank: int, world: int, cfg: dict[str, Any], outdir: str) -> None:
    for k, v in _ENV.items():
        os.environ[k] = v
    import torch
    import torch.distributed as dist

    import tensorcast as tc

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(outdir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg["pg_timeout"]))
    source = RandomBatches(cfg["steps"], cfg["seed"], cfg["repeat"]) if rank == 0 else None
    loader = tc.BroadcastingDataLoader(source, group=dist.group.WORLD, src=0,
                                       prefetch=cfg["prefetch"], timeout=cfg["pg_timeout"])
    times: list[float] = []
    mismatches: list[int] = []
    rss_start = rss_end = float("nan")
    it = iter(loader)
    step = 0
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        times.append(time.perf_counter() - t0)
        if not same(batch, make_batch(cfg["seed"], step, cfg["repeat"])):
            mismatches.append(step)
        del batch
        step += 1
        if step == cfg["warmup"]:
            rss_start = _rss_mib()
    rss_end = _rss_mib()
    dist.barrier()
    dist.destroy_process_group()
    result = {"rank": rank, "steps": step, "compared": step, "mismatches": mismatches[:20],
              "n_mismatches": len(mismatches), "rss_start_mib": rss_start,
              "rss_end_mib": rss_end, "times": times[cfg["warmup"]:] or times}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_world(world: int, cfg: dict[str, Any], deadline: float) -> dict[str, Any]:
    """Spawn ``world`` ranks, wait for them (killing them at ``deadline``), summarise."""
    import torch.multiprocessing as mp

    os.environ.update(_ENV)
    with tempfile.TemporaryDirectory(prefix="tensorcast-soak-") as outdir:
        start = time.monotonic()
        ctx = mp.start_processes(_rank_main, args=(world, cfg, outdir), nprocs=world,
                                 join=False, start_method="spawn")
        error = None
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    error = "timed out"
                    break
        except Exception as e:  # a rank failed: its traceback is in e
            error = f"{type(e).__name__}: {e}"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(5)
        wall = time.monotonic() - start
        ranks = []
        for r in range(world):
            path = os.path.join(outdir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
    receivers = [r for r in ranks if r["rank"] != 0]
    recv_times = [t for r in receivers for t in r["times"]]
    src_times = [t for r in ranks if r["rank"] == 0 for t in r["times"]]
    rss = [(r["rss_start_mib"], r["rss_end_mib"]) for r in receivers]
    growth = max((end - start for start, end in rss), default=float("nan"))
    return {
        "world_size": world,
        "ok": error is None and len(ranks) == world,
        "error": error,
        "wall_s": round(wall, 1),
        "steps": ranks[0]["steps"] if ranks else 0,
        "batches_compared": sum(r["compared"] for r in ranks),
        "mismatches": sum(r["n_mismatches"] for r in ranks),
        "first_mismatches": sorted({s for r in ranks for s in r["mismatches"]})[:10],
        "receiver_rss_start_mib": [round(a, 1) for a, _ in rss],
        "receiver_rss_end_mib": [round(b, 1) for _, b in rss],
        "receiver_rss_growth_mib": round(growth, 1),
        "rss_flat": growth <= cfg["rss_slack_mib"],
        "receiver_step_ms_median": round(statistics.median(recv_times) * 1e3, 3)
        if recv_times else None,
        "receiver_step_ms_p99": round(_percentile(recv_times, 0.99) * 1e3, 3)
        if recv_times else None,
        "source_step_ms_median": round(statistics.median(src_times) * 1e3, 3)
        if src_times else None,
        "source_step_ms_p99": round(_percentile(src_times, 0.99) * 1e3, 3)
        if src_times else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated, e.g. 2,4")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1,
                        help="steps each random tree is sent for, with a new step number "
                             "(default 1: a new tree every step; 4 takes the receivers' fast "
                             "paths for repeated structures)")
    parser.add_argument("--warmup", type=int, default=500,
                        help="steps before the first RSS reading and the timings")
    parser.add_argument("--rss-slack-mib", type=float, default=64.0,
                        help="receiver RSS growth after warm-up still called flat")
    parser.add_argument("--pg-timeout", type=float, default=120.0,
                        help="seconds any rank waits for one collective")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="hard limit for the whole run, seconds")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="write the results as JSON to PATH ('-' or no value: stdout)")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    if args.steps < 1 or args.repeat < 1 or any(w < 2 for w in worlds):
        parser.error("--steps and --repeat must be >= 1 and every world size >= 2")
    cfg = {"steps": args.steps, "seed": args.seed, "repeat": args.repeat,
           "prefetch": args.prefetch,
           "warmup": min(args.warmup, args.steps // 2), "pg_timeout": args.pg_timeout,
           "rss_slack_mib": args.rss_slack_mib}
    deadline = time.monotonic() + args.timeout
    results = [run_world(w, cfg, deadline) for w in worlds]
    report = {"config": cfg, "results": results}
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.json != "-":
        print(f"soak: {args.steps} steps, prefetch={args.prefetch}, seed={args.seed}, "
              f"repeat={args.repeat}, "
              f"warm-up {cfg['warmup']} steps")
        print(f"{'world':>5} {'steps':>6} {'compared':>9} {'mismatch':>8} "
              f"{'recv RSS start->end MiB':>24} {'step ms p50':>11} {'p99':>8} {'wall s':>7}")
        for r in results:
            rss = ", ".join(f"{a:.0f}->{b:.0f}" for a, b in
                            zip(r["receiver_rss_start_mib"], r["receiver_rss_end_mib"],
                                strict=True))
            print(f"{r['world_size']:>5} {r['steps']:>6} {r['batches_compared']:>9} "
                  f"{r['mismatches']:>8} {rss:>24} {r['receiver_step_ms_median']!s:>11} "
                  f"{r['receiver_step_ms_p99']!s:>8} {r['wall_s']:>7}"
                  + ("" if r["ok"] else f"  FAILED: {r['error']}"))
    bad = [r for r in results if not r["ok"] or r["mismatches"] or not r["rss_flat"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
