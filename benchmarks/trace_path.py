"""Follow one ``tc.broadcast`` down tensorcast's modules, on the source and on a receiver.

Two gloo ranks on loopback; after a few warm-up calls (the channel made, layouts and
views cached), one call on each rank is traced with ``sys.setprofile``. A module is
*entered* by a call from another module (a return to the caller is not an entry;
calls into torch or the standard library are not followed). Prints the entries in
order and their count per module, for each role: a path that reads straight down
enters each module once or twice.

    python benchmarks/trace_path.py [--tree small|audio] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tensorcast as tc


def _tree(kind: str) -> Any:
    if kind == "audio":
        return {"audio": torch.randn(8, 64_000), "lens": torch.arange(8), "ids": ["a"] * 8}
    return {"x": torch.arange(16.0), "step": 3, "name": "utt"}


def _trace(fn: Any) -> tuple[Any, list[str]]:
    """The tensorcast modules ``fn`` enters, in order: a call from one module into another
    (a return to a caller is not an entry)."""
    entries: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("tensorcast"):
            return
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        if caller != name:
            entries.append(name)

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, entries


def _rank(rank: int, world: int, path: str, kind: str, results: Any) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{path}", rank=rank, world_size=world
    )
    tree = _tree(kind)
    for _ in range(5):
        tc.broadcast(tree if rank == 0 else None, src=0)
    _, stays = _trace(lambda: tc.broadcast(tree if rank == 0 else None, src=0))
    dist.barrier()
    results.put((rank, stays))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", choices=("small", "audio"), default="small")
    parser.add_argument("--json", help="write the stays per role here")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    path = os.path.join(tempfile.mkdtemp(prefix="tensorcast-trace-"), "store")
    procs = [ctx.Process(target=_rank, args=(r, 2, path, args.tree, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    out: dict[str, Any] = {}
    worst = 0
    for rank, role in ((0, "source"), (1, "receiver")):
        stays = got[rank]
        visits = Counter(stays)
        worst = max(worst, max(visits.values()))
        out[role] = {"stays": stays, "visits": dict(visits)}
        print(f"{role}: {len(stays)} entries into {len(visits)} modules")
        print("  " + " -> ".join(s.removeprefix("tensorcast.") for s in stays))
        for module, n in visits.most_common():
            print(f"  {n}  {module}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(f"most entries into one module: {worst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
