"""How much of a batch's upload a training step hides, on one GPU.

Two gloo ranks on one machine. Rank 0 is the source and never touches the GPU; rank 1
trains on it: a loop of bf16 matmuls (``--n`` square, as many per step as make a step
take about ``--step-ms``), fed by ``BroadcastingDataLoader(prefetch=2, device="cuda")``
with batches of ``--batch-mb`` MB. With ``prefetch=2`` the next batch's upload (pinned
staging to the GPU, on tensorcast's transfer stream) is posted at the ``next()`` before
the step that needs it, so it should run under that step's matmuls.

What rank 1 measures, in one run:

- ``hidden_share``: of the time the device spent in the loader's host-to-device copies
  (from a ``torch.profiler`` trace of the measured steps), the share that ran while a
  kernel ran (target: 0.8 or more);
- the step period on the GPU (CUDA events at the start of every step) with the loader and
  with the same matmuls alone, and the time per step that the loader adds;
- the upload bandwidth of the loader's copies against a plain ``copy_`` from pinned
  memory of the same size, on an idle GPU and under the same matmuls (target: 80% of the
  idle copy's or more);
- the loader's data stall (``loader.stats()``).

    python benchmarks/bench_gpu_overlap.py
    python benchmarks/bench_gpu_overlap.py --steps 60 --json bench-results/gpu_overlap.json

``--json`` is written as the run goes (the baselines first, then every figure), so a run
cut off keeps what it measured; a run that fails or outlives ``--timeout`` (240 s by
default) writes its error there too. Exits with 77 and does nothing where no CUDA device
is visible; with 1 when the run failed, or with ``--check`` when a target is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the rank launcher
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # a plain copy: nothing installed

from rankpool import RankPool

SKIPPED = 77
TARGETS = {"hidden_share": 0.8, "h2d_bandwidth_ratio": 0.8}


class _Source:
    """``steps`` batches of ``nbytes`` (two buffers, taken in turn) and a few small leaves."""

    def __init__(self, steps: int, nbytes: int) -> None:
        self.steps = steps
        gen = torch.Generator().manual_seed(0)
        self.buffers = [
            torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen) for _ in range(2)
        ]

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Any:
        for step in range(self.steps):
            yield {"x": self.buffers[step % 2], "lens": torch.arange(8) + step, "step": step}


def _median_ms(pairs: list[tuple[Any, Any]]) -> float:
    return statistics.median(a.elapsed_time(b) for a, b in pairs)


def _events(n: int) -> list[Any]:
    return [torch.cuda.Event(enable_timing=True) for _ in range(n)]


def _intervals(trace: dict[str, Any], cat: str) -> list[tuple[float, float, dict[str, Any]]]:
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") == cat and e.get("ph") == "X":
            start = float(e["ts"])
            out.append((start, start + float(e.get("dur", 0.0)), e))
    return sorted(out, key=lambda x: x[0])


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _covered(start: float, end: float, union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in union)


def _overlap(trace: dict[str, Any], min_bytes: int) -> dict[str, Any]:
    """The loader's uploads in a profiler trace: how much of their time a kernel covered,
    and their bandwidth."""
    kernels = _union([(s, e) for s, e, _ in _intervals(trace, "kernel")])
    copies = [
        (s, e, ev)
        for s, e, ev in _intervals(trace, "gpu_memcpy")
        if "HtoD" in str(ev.get("name")) and int(ev.get("args", {}).get("bytes", 0)) >= min_bytes
    ]
    busy = sum(e - s for s, e, _ in copies)
    hidden = sum(_covered(s, e, kernels) for s, e, _ in copies)
    moved = sum(int(ev["args"]["bytes"]) for _, _, ev in copies)
    return {
        "uploads": len(copies),
        "upload_ms_median": statistics.median((e - s) / 1e3 for s, e, _ in copies)
        if copies
        else None,
        "hidden_share": hidden / busy if busy else None,
        "upload_GBps": moved / (busy * 1e3) if busy else None,  # bytes per us / 1e3 = GB/s
    }


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` whole or not at all (a reader never sees half a file)."""
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    tmp.replace(target)


def _pinned_copy_GBps(nbytes: int, matmuls: Any = None, reps: int = 10) -> float:
    """A plain ``copy_`` from pinned memory to the GPU, on a stream of its own, timed with
    CUDA events; under ``matmuls()`` on the current stream when given."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    pairs = []
    for i in range(reps + 3):
        if matmuls is not None:
            matmuls()
        start, end = _events(2)
        with torch.cuda.stream(stream):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
        if i >= 3:
            pairs.append((start, end))
        torch.cuda.synchronize()
    return nbytes / (_median_ms(pairs) * 1e6)


def _rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any] | None:
    import tensorcast as tc

    nbytes = int(args["batch_mb"] * 1e6)
    steps = args["warmup"] + args["steps"]
    if rank == 0:
        # The source never touches the GPU: one CUDA context on it, the trainer's.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        loader = tc.BroadcastingDataLoader(
            _Source(steps, nbytes), group=dist.group.WORLD, src=0, prefetch=args["prefetch"]
        )
        for _ in loader:
            pass
        return None

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.set_device(0)
    n = args["n"]
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    start, end = _events(2)
    start.record()
    for _ in range(10):
        torch.matmul(a, b, out=c)
    end.record()
    end.synchronize()
    per_matmul_ms = start.elapsed_time(end) / 10
    k = max(1, round(args["step_ms"] / per_matmul_ms))

    def matmuls() -> None:
        for _ in range(k):
            torch.matmul(a, b, out=c)

    def periods(step: Any, count: int) -> list[float]:
        marks = _events(count + 1)
        for i in range(count):
            marks[i].record()
            step(i)
        marks[count].record()
        torch.cuda.synchronize()
        return [marks[i].elapsed_time(marks[i + 1]) for i in range(count)]

    compute_only = periods(lambda i: matmuls(), 20)[3:]
    idle_GBps = _pinned_copy_GBps(nbytes)
    under_compute_GBps = _pinned_copy_GBps(nbytes, matmuls)
    baselines = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "config": {**args, "matmuls_per_step": k, "per_matmul_ms": round(per_matmul_ms, 3)},
        "step_ms_compute_only": round(statistics.median(compute_only), 3),
        "plain_pinned_copy_GBps": {"idle": idle_GBps, "under_the_matmuls": under_compute_GBps},
    }
    _write_json(args["json"], {"phase": "baselines measured; the loader's steps next", **baselines})

    loader = tc.BroadcastingDataLoader(
        None, group=dist.group.WORLD, src=0, prefetch=args["prefetch"], device="cuda"
    )
    it = iter(loader)
    acc = torch.zeros((), device="cuda")

    def train_step(i: int) -> None:
        nonlocal acc
        batch = next(it)
        acc = acc + batch["x"][:4096].float().sum()  # the step reads its batch
        matmuls()

    periods(train_step, args["warmup"])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        with_loader = periods(train_step, args["steps"])
        wall_s = time.perf_counter() - started
    expect_end = next(it, None)
    if expect_end is not None:
        raise RuntimeError("the source sent more batches than steps")
    stats = loader.stats()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            overlap = _overlap(json.load(f), nbytes // 2)
    step_alone = statistics.median(compute_only)
    step_loader = statistics.median(with_loader)
    added = step_loader - step_alone
    upload = overlap["upload_ms_median"]
    ratio = overlap["upload_GBps"] / idle_GBps if overlap["upload_GBps"] else None
    result = {
        **baselines,
        "phase": "done",
        "step_ms_with_loader": round(step_loader, 3),
        "ms_added_per_step": round(added, 3),
        "hidden_share_from_step_times": (
            round(max(0.0, min(1.0, 1 - added / upload)), 3) if upload else None
        ),
        "profiler": overlap,
        "h2d_bandwidth_ratio": ratio,
        "host_steps_per_s": args["steps"] / wall_s,
        "data_stall_ms_median": stats.stall.median * 1e3,
        "stall_share": stats.stall_share,
        "targets": {
            "hidden_share": _target(overlap["hidden_share"], TARGETS["hidden_share"]),
            "h2d_bandwidth_ratio": _target(ratio, TARGETS["h2d_bandwidth_ratio"]),
        },
        "step_ms": {"compute_only": compute_only, "with_loader": with_loader},
    }
    _write_json(args["json"], result)
    return result


def _target(value: float | None, target: float) -> dict[str, Any]:
    return {"value": value, "target": target, "met": value is not None and value >= target}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--batch-mb", type=float, default=60.0, help="batch size (MB, 1e6 bytes)")
    p.add_argument("--n", type=int, default=8192, help="the matmuls' square size")
    p.add_argument("--step-ms", type=float, default=40.0, help="the step's target time")
    p.add_argument("--steps", type=int, default=40, help="measured steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--json", metavar="PATH", help="write every figure and raw step time here")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds the ranks may take in all")
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        reason = f"needs CUDA: torch {torch.__version__} sees no CUDA device; nothing was measured"
        print(reason)
        _write_json(args.json, {"skipped": reason})
        return SKIPPED
    config = {
        k: getattr(args, k) for k in ("batch_mb", "n", "step_ms", "steps", "warmup", "prefetch")
    }
    config["json"] = str(Path(args.json).resolve()) if args.json else None
    pool = RankPool(2, pg_timeout=args.timeout)
    try:
        results = pool.run(_rank, config, timeout=args.timeout)
    except Exception as e:  # a rank failed, died or outlived the timeout: say so, keep the rest
        partial = {}
        if args.json and Path(args.json).exists():
            with contextlib.suppress(ValueError):
                partial = json.loads(Path(args.json).read_text(encoding="utf-8"))
        _write_json(args.json, {**partial, "error": f"{type(e).__name__}: {e}"[:4000]})
        print(f"the run failed: {type(e).__name__}: {e}")
        return 1
    finally:
        pool.close()
    r = results[1]
    prof = r["profiler"]
    print(
        f"{r['device']}, torch {r['torch']}: {args.batch_mb:g} MB batches, prefetch {args.prefetch}"
    )
    print(
        f"  step: {r['step_ms_compute_only']:.2f} ms alone, {r['step_ms_with_loader']:.2f} ms with "
        f"the loader ({r['config']['matmuls_per_step']} matmuls of {args.n}^2 bf16)"
    )
    print(
        f"  uploads: {prof['uploads']}, median {prof['upload_ms_median']} ms, hidden share "
        f"{prof['hidden_share']} (from step times: {r['hidden_share_from_step_times']})"
    )
    plain = r["plain_pinned_copy_GBps"]
    print(
        f"  H2D: loader {prof['upload_GBps']} GB/s; plain pinned copy_ {plain['idle']:.1f} GB/s "
        f"idle, {plain['under_the_matmuls']:.1f} GB/s under the matmuls; ratio "
        f"{r['h2d_bandwidth_ratio']}"
    )
    print(f"  data stall: median {r['data_stall_ms_median']:.2f} ms, share {r['stall_share']:.3f}")
    for name, t in r["targets"].items():
        print(f"  target {name} >= {t['target']}: {'met' if t['met'] else 'MISSED'} ({t['value']})")
    _write_json(args.json, r)
    missed = not all(t["met"] for t in r["targets"].values())
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
