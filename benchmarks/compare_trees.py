"""Two checkouts of tensorcast, one harness: ``python -m tensorcast.bench`` over each, alternating.

A change that claims "no speed change" is measured against the tree it changes, in the same
session and on the same machine: this script runs the bench of each tree (the package found
under each path) for ``--rounds`` rounds, alternating A, B, B, A, ... so that a drift of the
machine's load falls on both sides, and prints per workload and method the median over rounds
of each tree's paired multiple of the floor, and B's median against A's.

    python benchmarks/compare_trees.py /path/to/old/checkout . --world-sizes 2,4 --rounds 2

Each tree's bench is its own (``python -m tensorcast.bench`` with that tree first on
``PYTHONPATH``), so each side measures its own code with its own harness; only the workloads
and methods that both know are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_bench(tree: Path, world: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One bench run of ``tree`` on ``world`` gloo ranks; its JSON document."""
    env = dict(os.environ, PYTHONPATH=str(tree.resolve()), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={world}", "-m", "tensorcast.bench",
        "--workloads", args.workloads, "--methods", args.methods,
        "--iters", str(args.iters), "--json", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), check=True, timeout=args.timeout,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return json.loads(out.read_text())


def paired(report: dict[str, Any]) -> dict[tuple[str, str], float]:
    """(workload, method) -> the paired multiple of the floor."""
    return {
        (wl["workload"], row["method"]): row["x_floor_paired"]
        for wl in report["workloads"]
        for row in wl["rows"]
        if row.get("x_floor_paired") is not None and row["method"] != "floor"
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tree_a", type=Path, help="the reference checkout (its repository root)")
    p.add_argument("tree_b", type=Path, help="the checkout measured against it")
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", default="tiny,many_small,audio_large,gpt")
    p.add_argument("--methods", default="tc.broadcast,tc.loader,tc.loader+packed")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path, help="write every round's figures here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    trees = {"A": args.tree_a, "B": args.tree_b}
    results: dict[str, Any] = {"trees": {k: str(v) for k, v in trees.items()}, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(w) for w in args.world_sizes.split(",")):
            got: dict[str, list[dict[tuple[str, str], float]]] = {"A": [], "B": []}
            for r in range(args.rounds):
                order = ("A", "B") if r % 2 == 0 else ("B", "A")
                for side in order:
                    report = run_bench(trees[side], world, args, Path(tmp) / f"{side}{r}.json")
                    got[side].append(paired(report))
                    results["runs"].append({"world": world, "round": r, "side": side,
                                            "paired": {"/".join(k): v for k, v in got[side][-1].items()}})  # fmt: skip
            keys = sorted(set.intersection(*(set(d) for d in got["A"] + got["B"])))
            print(f"\n{world} gloo ranks, {args.rounds} rounds, x floor (paired, median of rounds)")
            print(f"  {'workload':<12} {'method':<18} {'A':>7} {'B':>7} {'B / A':>7}")
            for key in keys:
                a = statistics.median(d[key] for d in got["A"])
                b = statistics.median(d[key] for d in got["B"])
                print(f"  {key[0]:<12} {key[1]:<18} {a:>6.2f}x {b:>6.2f}x {b / a:>7.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
