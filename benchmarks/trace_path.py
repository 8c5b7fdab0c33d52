"""Follow one batch down tensorcast's modules, on the source and on a receiver.

Two gloo ranks on loopback; after a few warm-up calls (the channel made, layouts and
views cached), one call on each rank is traced with ``sys.setprofile``: a ``tc.broadcast``
of a tree (``small``; ``audio``, random samples that nothing trims; ``padded``, rows that
end in zeros, which the source really trims and the receiver re-pads: on the wire, as
between hosts, since a payload through shared memory is never trimmed), or a
``BroadcastingDataLoader``'s ``next()`` with ``prefetch=0`` (``loader``, of small trees).

A module is *entered* by a call from another module (a return to the caller is not an
entry; calls into torch or the standard library are not followed, and a frame of theirs
between two of tensorcast's is skipped). An entry is a *back-and-forth* when the module
entered is already on the path below the module that calls it: A -> B -> A, B (or a
module B called) calling back into A, which A left for it. That is the smell (a room
that two others share an operation across); a cohesive module entered at three moments of
one operation, each time from its caller and returning to it, is not. Prints the entries
in order, their count per module and each back-and-forth, for each role:

    entries into N modules, B back-and-forth
    most entries into one module: N

    python benchmarks/trace_path.py [--tree small|audio|padded|loader] [--json out.json]
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

TREES = ("small", "audio", "padded", "loader")


def _tree(kind: str) -> Any:
    if kind == "audio":
        return {"audio": torch.randn(8, 64_000), "lens": torch.arange(8), "ids": ["a"] * 8}
    if kind == "padded":
        # 8 x 64,000 samples, 16k-36k real ones a row and zeros after: as lhotse pads audio
        g = torch.Generator().manual_seed(0)
        lens = torch.linspace(16_000, 36_000, 8).long()
        audio = torch.randn(8, 64_000, generator=g)
        audio.masked_fill_(torch.arange(64_000) >= lens[:, None], 0.0)
        return {"audio": audio, "lens": lens, "ids": ["a"] * 8}
    return {"x": torch.arange(16.0), "step": 3, "name": "utt"}


def _module(frame: Any) -> str:
    return frame.f_globals.get("__name__", "")


def _caller(frame: Any) -> Any:
    """The nearest frame below ``frame`` that runs tensorcast's code, or None."""
    below = frame.f_back
    while below is not None and not _module(below).startswith("tensorcast"):
        below = below.f_back
    return below


def _trace(fn: Any) -> tuple[Any, list[str], list[list[str]]]:
    """The tensorcast modules ``fn`` enters, in order, and each back-and-forth among those
    entries: the path (its modules, each once in a row) from the module re-entered, as it
    was left, to its entry again."""
    entries: list[str] = []
    returns: list[list[str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = _module(frame)
        if not name.startswith("tensorcast"):
            return
        below = _caller(frame)
        if below is not None and _module(below) == name:
            return
        entries.append(name)
        path = [(name, frame.f_code.co_name)]  # each module once, with the function that called on
        while below is not None:
            module = _module(below)
            if module == name:  # left for the modules above it on the path
                path.append((module, below.f_code.co_name))
                returns.append([f"{m.removeprefix('tensorcast.')}.{f}" for m, f in path[::-1]])
                break
            if module != path[-1][0]:
                path.append((module, below.f_code.co_name))
            below = _caller(below)

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, entries, returns


def _broadcasts(rank: int, kind: str) -> Any:
    tree = _tree(kind)
    if kind == "padded" and not any(
        leaf.trimmed for leaf in tc.read_header(tc.pack(tree).header).leaves
    ):
        raise SystemExit("the padded tree is not trimmed: its trace would not show trimming")
    # A payload that goes through shared memory is sent untrimmed (design.md, "One host"):
    # the padded tree travels on the wire, as it does between hosts, to show trimming.
    opts = {"shm": False} if kind == "padded" else {}
    for _ in range(5):
        tc.broadcast(tree if rank == 0 else None, src=0, **opts)
    return lambda: tc.broadcast(tree if rank == 0 else None, src=0, **opts)


def _loader(rank: int) -> Any:
    source = [_tree("small") for _ in range(8)] if rank == 0 else None
    loader = tc.BroadcastingDataLoader(source, group=dist.group.WORLD, src=0, prefetch=0)
    batches = iter(loader)
    for _ in range(5):
        next(batches)
    return lambda: next(batches)


def _rank(rank: int, world: int, path: str, kind: str, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    step = _loader(rank) if kind == "loader" else _broadcasts(rank, kind)
    _, entries, returns = _trace(step)
    dist.barrier()
    results.put((rank, entries, returns))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", choices=TREES, default="small")
    parser.add_argument("--json", help="write the entries and back-and-forths per role here")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    path = os.path.join(tempfile.mkdtemp(prefix="tensorcast-trace-"), "store")
    procs = [ctx.Process(target=_rank, args=(r, 2, path, args.tree, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, entries, returns = results.get(timeout=120)
        got[rank] = (entries, returns)
    for p in procs:
        p.join(30)
    out: dict[str, Any] = {}
    worst = 0
    for rank, role in ((0, "source"), (1, "receiver")):
        entries, returns = got[rank]
        visits = Counter(entries)
        worst = max(worst, max(visits.values()))
        out[role] = {"entries": entries, "visits": dict(visits), "back_and_forth": returns}
        print(
            f"{role}: {len(entries)} entries into {len(visits)} modules, "
            f"{len(returns)} back-and-forth"
        )
        print("  " + " -> ".join(s.removeprefix("tensorcast.") for s in entries))
        for module, n in visits.most_common():
            print(f"  {n}  {module}")
        for chain in returns:
            print("  back: " + " -> ".join(chain))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(f"most entries into one module: {worst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
