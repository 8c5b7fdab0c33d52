"""``python -m tensorcast.bench``: tensorcast against the peers' ways, on your own cluster.

Run it under any launcher, on the mesh your training uses::

    torchrun --nproc_per_node 8 -m tensorcast.bench --tp 8
    torchrun --nproc_per_node 8 -m tensorcast.bench --dp 2 --cp 2 --tp 2 --json bench.json
    srun -N 2 --ntasks-per-node 8 python -m tensorcast.bench --tp 8     # MASTER_ADDR/PORT set
    torchrun --standalone --nproc_per_node 4 -m tensorcast.bench --quick

Every data-parallel slot (the ranks of one ``(cp, tp)`` sub-mesh; all ranks when no mesh
is given) broadcasts from its first rank, all slots at once, as training does. Each
method runs once per iteration, interleaved; a method's time in an iteration is the
slowest rank's, and the table gives the median and p90 over iterations, GB/s of tensor
bytes, and the multiple of the floor (one broadcast of a preallocated buffer of the
batch's bytes): ``x floor`` is the method's median over the floor's median, ``paired``
the median of its per-iteration ratios to the floor (the same iteration's, so a drift
of the machine's load over the run does not move it). Every rank checks every batch
each method handed it, every iteration, against its source's batch, bit for bit.

tensorcast's methods run twice where this tensorcast trims padding (issue 34): as they
are (``trim=True``, the default) and as ``...(trim=False)``, which sends every leaf
whole, in the same run. The floor stays one broadcast of the whole, padded, batch, so
trimming shows as a ratio below 1x; ``wire`` gives the bytes each method sent, and the
"trim on / off" line says "nothing trimmed" where both ways sent the same bytes.

Each workload's rows are printed as it finishes (flushed: a SLURM log or ``| cat`` shows
them as the run goes), and ``--json`` is rewritten then with every workload done so far
(``"complete": false`` until the last): a run stopped midway keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tensorcast.bench import report, run, workloads
from tensorcast.bench.timing import METHODS, UNTRIMMED, trim_supported

QUICK_ITERS, QUICK_WARMUP = 3, 1
# else 100, user 40; the padded ones are the large batches they are drawn as
DEFAULT_ITERS = {
    **{"audio_large": 30, "audio_medium": 60, "gpt": 40},
    **{"audio_padded": 30, "audio_bucketed": 30, "fbank_padded": 30, "gpt_padded": 60},
}


def _at_least(low: int) -> Any:
    """An argparse type: an int of at least ``low`` (a mesh size of 0 is refused here,
    before any process group is up)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not allowed: it must be at least {low}")
        return value

    parse.__name__ = "int"  # what argparse says it expected
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value:g} is not allowed: it must be > 0")
    return value


def _csv(text: str | None, allowed: tuple[str, ...], what: str) -> list[str] | None:
    if text is None:
        return None
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return items


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tensorcast.bench",
        description="tensorcast against the peers' ways to share a batch, on your own cluster.",
        epilog="examples:\n" + __doc__.split("::\n\n")[1].split("\n\n")[0] + "\n\n"
        f"{report.COLUMNS}\n\n"
        "Batch files: tensorcast.bench.save_batch(path, batch). "
        "The chart: pip install 'tensorcast[bench]'.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = _at_least(1)
    p.add_argument("--dp", type=size, default=None, help="data-parallel size (default: the rest)")
    p.add_argument("--cp", type=size, default=1, help="context-parallel size (default 1)")
    p.add_argument(
        "--tp",
        type=size,
        default=None,
        help="tensor-parallel size (default: one group of all ranks)",
    )
    p.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated, from {', '.join(workloads.WORKLOADS)} (default: all)",
    )
    p.add_argument(
        "--batch",
        action="append",
        default=[],
        metavar="PATH|MODULE:FUNCTION",
        help="your own batch: a file from tensorcast.bench.save_batch or a "
        "torch.save of tensors, or a function that returns one (repeatable)",
    )
    p.add_argument("--methods", default=None, help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--iters", type=size, default=None, help="timed iterations per workload")
    p.add_argument(
        "--warmup", type=_at_least(0), default=None, help="untimed iterations first (default 3)"
    )
    p.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="the default group's backend (default: nccl where CUDA is, else gloo)",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=300.0,
        help="the process group's timeout in seconds (default 300)",
    )
    p.add_argument(
        "--quick", action="store_true", help="small batches and few iterations: a smoke run for CI"
    )
    p.add_argument("--json", metavar="PATH", help="write every figure, with raw times, here")
    p.add_argument("--png", metavar="PATH", help="a bar chart (needs matplotlib)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    try:
        chosen = _csv(args.workloads, workloads.WORKLOADS, "workloads")
        args.methods = _csv(args.methods, METHODS, "methods")
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if chosen is None:
        chosen = [] if args.batch and args.workloads is None else list(workloads.WORKLOADS)
    args.specs = [*chosen, *args.batch]
    asked = [m for m in args.methods or () if m in UNTRIMMED]
    if asked and not trim_supported():
        p.error(
            f"{', '.join(asked)} need a tensorcast that takes trim= (tc.pack, tc.broadcast, "
            f"tc.BroadcastingDataLoader); this one does not: leave them out"
        )
    if args.methods is not None and "floor" not in args.methods:
        args.methods.append("floor")  # every ratio needs it
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--png needs matplotlib: pip install 'tensorcast[bench]'")
    return args


def _iters(args: argparse.Namespace, spec: str) -> tuple[int, int]:
    if args.quick:
        return args.iters or QUICK_ITERS, QUICK_WARMUP if args.warmup is None else args.warmup
    default = DEFAULT_ITERS.get(spec, 100 if spec in workloads.WORKLOADS else 40)
    return args.iters or default, 3 if args.warmup is None else args.warmup


def _run(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """Every workload in turn; rank 0 prints each one's rows as it finishes (flushed, so
    a SLURM log or ``| cat`` shows them) and rewrites ``--json`` with what is done so far:
    a run stopped midway keeps its finished workloads."""
    world = dist.get_world_size()
    tp = args.tp if args.tp is not None else max(1, world // (args.cp * (args.dp or 1)))
    slot, mesh = run.make_slot(args.dp, args.cp, tp)
    names = run.method_names(args.methods)
    plan = [(spec, *_iters(args, spec)) for spec in args.specs]
    total = sum((iters + warmup) * len(names) for _, iters, warmup in plan)
    first = dist.get_rank() == 0
    progress = report.Progress(total, enabled=first)
    started = time.monotonic()
    info = run.where(backend, mesh, slot)
    result: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "tensorcast.bench", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "where": (
            f"{info['backend']}, world {info['world_size']}, mesh {mesh}, "
            f"{info.get('gpu', 'CPU')} ({info['device']}), torch {info['torch']}"
        ),
        **info,
        "quick": args.quick,
        "trim_supported": trim_supported(),  # whether the (trim=False) methods could run
        "complete": False,  # True once every workload ran
        "wall_s": 0.0,
        "workloads": [],
    }
    if first:
        _say(f"$ {result['command']}   ({result['date']})")
        _say(f"on {result['where']}; times are the slowest rank's")
    try:
        for spec, iters, warmup in plan:
            done = run.run_workload(spec, names, iters, warmup, args.quick, slot, progress)
            result["workloads"].append(done)
            result["wall_s"] = time.monotonic() - started
            if first:  # the file first: whoever reads the rows finds it written
                _write_json(result, args)
                progress.clear()
                _say(report.text_table({"workloads": [done]}))
    finally:
        progress.close()
    result["complete"] = True
    return result


def _say(text: str) -> None:
    print(text, flush=True)


def _write_json(result: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json + ".tmp").write_text(json.dumps(result, indent=1))
        os.replace(args.json + ".tmp", args.json)  # never a half-written file


def _print(result: dict[str, Any], args: argparse.Namespace) -> None:
    """What follows the rows (printed as each workload finished): the columns, the table
    for a README, the files written and what was checked."""
    _say(f"\n{report.COLUMNS}")
    _say("\n" + report.markdown_table(result))
    if args.json:
        _write_json(result, args)
        _say(f"\nwrote {args.json}")
    if args.png:
        report.write_png(result, args.png)
        _say(f"wrote {args.png}")
    failures = [f for wl in result["workloads"] for f in wl["check_failures"]]
    for f in failures:
        print(f"CHECK FAILED: {f}", file=sys.stderr, flush=True)
    if not failures:
        _say("\n" + report.checked_line(result))


def shadowed() -> str | None:
    """Why ``import tensorcast`` is not the tensorcast package, if it is not: a folder named
    ``tensorcast`` in the working directory (or elsewhere on ``sys.path``) shadows an
    editable install as a namespace package, and everything fails later, deep inside, with
    ``module 'tensorcast' has no attribute 'pack'``."""
    import tensorcast

    if hasattr(tensorcast, "pack"):
        return None
    found = getattr(tensorcast, "__file__", None) or [str(p) for p in tensorcast.__path__]
    here = os.path.join(os.getcwd(), "tensorcast")
    culprit = f"the folder {here}" if os.path.isdir(here) else "a folder named tensorcast"
    return (
        f"`import tensorcast` found {found}, not the tensorcast package (it has no "
        f"tensorcast.pack): {culprit} shadows the installed package. Run from another "
        f"directory, or rename that folder"
    )


def main(argv: list[str] | None = None) -> int:
    why = shadowed()
    if why is not None:  # before anything uses the package, or a group is up
        print(f"error: {why}", file=sys.stderr)
        return 2
    args = parse_args(argv)
    # per_tensor sends a torch pytree spec through broadcast_object_list; unpickling it warns.
    warnings.filterwarnings(
        "ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning
    )
    try:
        backend = run.init_default_group(args.backend, args.timeout)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = _run(args, backend)
        if dist.get_rank() == 0:
            _print(result, args)
        dist.barrier(group=None)
    except ValueError as e:  # a mesh or a batch that cannot be: raised on every rank alike
        print(f"error on rank {dist.get_rank()}: {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    failed = any(wl["check_failures"] for wl in result["workloads"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
