"""What building a loader costs the store, as the world grows: requests per rank and time.

Two modes.

``sim`` (the default) simulates large worlds on one machine: every rank is a thread with
its own client of one real ``TCPStore`` (no process group: the agreement needs only the
store), building one mesh loader's agreement, ``(cp, tp)`` groups of ``--group`` ranks.
It runs the agreement of today (``tensorcast.transport.agreement``: each rank reads its group's
keys and the mesh's first rank's) and, as the baseline, a faithful copy of the one
before it (``_WholeMesh``: every rank reads every rank's key, one ``get`` each, and polls
the whole mesh every 2 ms in the second round), up to ``--old-max`` ranks. It prints,
per world size, the requests per rank (median and most) and the wall time of a build
(all ranks released together, until the last is through; median of ``--builds``). It
then checks that a rank with other axes is caught by every rank of the mesh within
seconds.

``real`` builds ``BroadcastingDataLoader`` on real gloo ranks (4, 8, 16, 32 processes):
a ``(N/4, 2, 2)`` ``(dp, cp, tp)`` mesh and a ``(N/8, 8)`` ``(dp, tp)`` one, each rank
on a default group whose store counts the requests made through it (a subclass of
``torch.distributed.Store`` over a ``TCPStore``), checks every sub-mesh's batches bit for
bit, and prints the build time (slowest rank, median of ``--builds``) and the requests
per rank. ``--root`` runs another checkout's ``tensorcast`` (e.g. the previous release's
tree, for the before column).

    python benchmarks/bench_setup.py --worlds 64 256 1024 4096 --group 4
    python benchmarks/bench_setup.py --group 8 --json bench-results/setup-8.json
    python benchmarks/bench_setup.py real --worlds 4 8 16 32
    python benchmarks/bench_setup.py plot setup-4.json setup-8.json --out docs/setup_scale.png
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
SETUP = {"prefetch": 1, "verify": False, "axes": ["cp", "tp"], "format": 2, "frames": 1}


class _WholeMesh:
    """The agreement as it was before it was scoped to the group (tensorcast 0.2.0's
    ``World.agree``), kept as the baseline: scope the whole mesh, one ``get`` per rank
    of it, and a second round that polls ``check`` over every rank's key every 2 ms."""

    def __init__(self, store: Any, rank: int, timeout: datetime.timedelta) -> None:
        self.store, self.rank, self.timeout = store, rank, timeout
        self._agreed: dict[tuple[int, ...], int] = {}

    def agree(self, scope: tuple[int, ...], what: str, setup: dict[str, Any]) -> None:
        seq = self._agreed[scope] = self._agreed.get(scope, 0) + 1
        base = f"agree/{len(scope)}/{seq}/"
        text = json.dumps({"setup": setup, "extra": {}}, sort_keys=True)
        self.store.set(base + str(self.rank), text)
        keys = [base + str(r) for r in scope]
        self.store.wait(keys, self.timeout)
        theirs = {r: json.loads(self.store.get(k)) for r, k in zip(scope, keys)}
        if any(v["setup"] != json.loads(text)["setup"] for v in theirs.values()):
            raise RuntimeError(f"rank {self.rank} disagrees on {what}")
        self.store.set(base + f"ready/{self.rank}", "1")
        ready = [base + f"ready/{r}" for r in scope]
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self.store.check(ready):
            if self.store.check([base + "abandoned"]) or time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.rank}: the second round failed")
            time.sleep(0.002)
        if self.store.add(base + "done", 1) == len(scope):
            for key in [*keys, *ready, base + "done"]:
                self.store.delete_key(key)


def _clients(port: int, n: int) -> list[Any]:
    # A client's connection now and then takes seconds on this box: connect in parallel.
    with ThreadPoolExecutor(64) as pool:
        return list(pool.map(lambda _: dist.TCPStore("127.0.0.1", port, is_master=False), range(n)))


def _build(n: int, builds: list[Callable[[], None]]) -> float:
    """Run one build on ``n`` threads released together; seconds until the last is done."""
    start = threading.Barrier(n + 1)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        start.wait()
        try:
            builds[r]()
        except BaseException as e:
            print(f"rank {r}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    start.wait()
    began = time.monotonic()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.monotonic() - began


def _sim_one(scheme: str, n: int, group: int, clients: list[Any], builds: int) -> dict[str, Any]:
    from tensorcast.transport.agreement import Agreement, ranks_name
    from tensorcast.transport.testing import CountingStore

    timeout = datetime.timedelta(seconds=600)
    prefix = f"{scheme}/{n}/"
    stores = [CountingStore(dist.PrefixStore(prefix, clients[r])) for r in range(n)]
    mesh = tuple(range(n))
    scope = ranks_name(mesh)
    calls: list[Callable[[], None]] = []
    for r in range(n):
        row = list(range(r - r % group, r - r % group + group))
        if scheme == "new":
            a = Agreement(stores[r], r, timeout)
            calls.append(
                lambda a=a, row=row: a.agree(scope, row, "loader", SETUP, first=(0, n)) and None
            )
        else:
            w = _WholeMesh(stores[r], r, timeout)
            calls.append(lambda w=w: w.agree(mesh, "loader", SETUP))
    times, per_rank = [], []
    for _ in range(builds):
        for s in stores:
            s.requests = 0
        times.append(_build(n, calls))
        per_rank = [s.requests for s in stores]
    return {
        "scheme": scheme,
        "world": n,
        "group": group,
        "build_s": statistics.median(times),
        "requests_median": statistics.median(per_rank),
        "requests_max": max(per_rank),
        "requests_total": sum(per_rank),
    }


def _sim_mismatch(n: int, group: int, clients: list[Any]) -> dict[str, Any]:
    """Rank 5 asks for other axes (it believes its group is half its real one): how soon
    does every rank of its group raise, with a 600 s timeout?"""
    from tensorcast._errors import DesyncError
    from tensorcast.transport.agreement import Agreement, ranks_name

    timeout = datetime.timedelta(seconds=600)
    scope = ranks_name(range(n))
    odd = 5
    raised: dict[int, float] = {}
    began = time.monotonic()

    def call(r: int) -> Callable[[], None]:
        a = Agreement(dist.PrefixStore(f"mismatch/{n}/", clients[r]), r, timeout)
        row = list(range(r - r % group, r - r % group + group))
        setup = SETUP
        if r == odd:  # it believes its group is the half of its real one that holds it
            half = group // 2
            row, setup = list(range(r - r % half, r - r % half + half)), {**SETUP, "axes": ["tp"]}

        def run() -> None:
            try:
                a.agree(scope, row, "loader", setup, first=(0, n))
            except DesyncError:
                raised[r] = time.monotonic() - began

        return run

    _build(n, [call(r) for r in range(n)])
    return {"world": n, "caught_by": len(raised), "must_catch": n,  # every rank of the mesh
            "slowest_s": max(raised.values())}  # fmt: skip


def sim(args: argparse.Namespace) -> list[dict[str, Any]]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    threading.stack_size(512 * 1024)
    clients = _clients(server.port, max(args.worlds))
    rows: list[dict[str, Any]] = []
    for n in args.worlds:
        for scheme in ("old", "new"):
            if scheme == "old" and n > args.old_max:
                continue
            row = _sim_one(scheme, n, args.group, clients, args.builds)
            rows.append(row)
            print(
                f"{scheme:>3}  world {n:5d}  group {args.group}  build {row['build_s'] * 1e3:9.1f} ms"
                f"  requests/rank median {row['requests_median']:6.0f} max {row['requests_max']:6d}"
                f"  total {row['requests_total']:9d}",
                flush=True,
            )
    for n in args.worlds:
        m = _sim_mismatch(n, args.group, clients)
        ok = m["caught_by"] == m["must_catch"]
        print(f"mismatch  world {n:5d}  caught by {m['caught_by']} ranks in {m['slowest_s']:.2f} s "
              f"({'every rank of the mesh' if ok else 'NOT every rank of the mesh'})")  # fmt: skip
        rows.append({"scheme": "mismatch", **m})
    return rows


# -- real: gloo ranks ---------------------------------------------------------------------


def _counting_store() -> type:
    class Counting(dist.Store):
        """Every request made through it counted (what the server sees, one a call)."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner, self.requests = inner, 0

        def _call(self, name: str, *args: Any) -> Any:
            self.requests += 1
            return getattr(self.inner, name)(*args)

        def set(self, k: str, v: Any) -> None:
            self._call("set", k, v)

        def get(self, k: str) -> bytes:
            return self._call("get", k)  # type: ignore[no-any-return]

        def add(self, k: str, v: int) -> int:
            return self._call("add", k, v)  # type: ignore[no-any-return]

        def compare_set(self, k: str, e: Any, d: Any) -> bytes:
            return self._call("compare_set", k, e, d)  # type: ignore[no-any-return]

        def delete_key(self, k: str) -> bool:
            return self._call("delete_key", k)  # type: ignore[no-any-return]

        def num_keys(self) -> int:
            return self._call("num_keys")  # type: ignore[no-any-return]

        def check(self, ks: list[str]) -> bool:
            return self._call("check", ks)  # type: ignore[no-any-return]

        def wait(self, ks: list[str], t: Any = None) -> None:
            self._call("wait", ks) if t is None else self._call("wait", ks, t)

        def multi_get(self, ks: list[str]) -> list[bytes]:
            return self._call("multi_get", ks)  # type: ignore[no-any-return]

        def multi_set(self, ks: list[str], vs: list[Any]) -> None:
            self._call("multi_set", ks, vs)

        def append(self, k: str, v: Any) -> None:
            self._call("append", k, v)

        def has_extended_api(self) -> bool:
            return True

        def set_timeout(self, t: Any) -> None:
            self.inner.set_timeout(t)

    return Counting


def _batch(step: int, dp: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 * dp + step)
    return {"x": torch.randn(3, 5, generator=g), "ids": torch.arange(4) + 10 * dp + step}


def _real_rank(rank: int, world: int, shape: list[int], names: list[str], builds: int) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import tensorcast as tc

    port: list[Any] = [None]
    if rank == 0:
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = [server.port]
    dist.broadcast_object_list(port, src=0)  # the benchmark's own traffic
    dist.barrier()
    old = dist.group.WORLD
    store = _counting_store()(dist.TCPStore("127.0.0.1", port[0], is_master=False))
    dist.destroy_process_group(old)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    try:
        mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
        dp, _ = tc.dp_rank_and_size(mesh)
        steps = 4
        want = [_batch(s, dp) for s in range(steps)]
        out = []
        for _ in range(builds):
            dist.barrier()
            before = store.requests
            began = time.monotonic()
            loader = tc.BroadcastingDataLoader(want if tc.is_dp_source_rank(mesh) else None, mesh)
            took = time.monotonic() - began
            requests = store.requests - before
            got = list(loader)
            exact = len(got) == steps and all(
                torch.equal(a["x"], b["x"]) and torch.equal(a["ids"], b["ids"])
                for a, b in zip(got, want, strict=True)
            )
            out.append((took, requests, exact))
        if names == ["dp", "cp", "tp"] and world >= 16:
            out.append(_other_axes(rank, mesh))
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def _other_axes(rank: int, mesh: Any) -> tuple[str, float]:
    """Rank 5 builds with axes=("tp",), the others with ("cp", "tp"), timeout 60 s: what
    each rank got, and how long it took."""
    import tensorcast as tc

    axes = ("tp",) if rank == 5 else ("cp", "tp")
    source = [{"x": 1}] if tc.is_dp_source_rank(mesh, axes) else None
    dist.barrier()
    began = time.monotonic()
    try:
        tc.BroadcastingDataLoader(source, mesh, axes=axes, timeout=60)
        said = "ok"
    except tc.DesyncError as e:
        said = f"DesyncError: {e}"
    return said, time.monotonic() - began


def real(args: argparse.Namespace) -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "tests"))
    from rankpool import RankPool

    rows = []
    for n in args.worlds:
        pool = RankPool(n, pg_timeout=300)
        try:
            for shape, names in (([n // 4, 2, 2], ["dp", "cp", "tp"]), ([n // 8, 8], ["dp", "tp"])):
                if n % 8 and names == ["dp", "tp"]:
                    continue
                res = pool.run(_real_rank, shape, names, args.builds, timeout=args.call_timeout)
                builds = [[res[r][b] for r in range(n)] for b in range(args.builds)]
                if len(res[0]) > args.builds:  # the rank with other axes
                    odd = [res[r][-1] for r in range(n)]
                    caught = [r for r in range(n) if odd[r][0].startswith("DesyncError")]
                    slowest = max(odd[r][1] for r in caught)
                    print(f"world {n:3d}  rank 5 with other axes: DesyncError on ranks {caught} "
                          f"within {slowest:.2f} s (timeout 60 s)", flush=True)  # fmt: skip
                    rows.append({"world": n, "other_axes_caught_by": caught, "slowest_s": slowest})
                row = {
                    "world": n,
                    "mesh": f"({', '.join(map(str, shape))}) {tuple(names)}",
                    "first_build_s": max(t for t, _, _ in builds[0]),
                    "first_requests_max": max(q for _, q, _ in builds[0]),
                    "build_s": statistics.median(max(t for t, _, _ in b) for b in builds[1:]),
                    "requests_median": statistics.median(q for _, q, _ in builds[-1]),
                    "requests_max": max(q for _, q, _ in builds[-1]),
                    "exact": all(e for b in builds for _, _, e in b),
                }
                rows.append(row)
                print(
                    f"world {n:3d}  mesh {row['mesh']:<28} first build (groups made) "
                    f"{row['first_build_s'] * 1e3:8.1f} ms, requests/rank max "
                    f"{row['first_requests_max']:4d}; later builds {row['build_s'] * 1e3:8.1f} ms,"
                    f" requests/rank median {row['requests_median']:5.0f} max "
                    f"{row['requests_max']:4d}; batches {'exact' if row['exact'] else 'WRONG'}",
                    flush=True,
                )
        finally:
            with contextlib.suppress(Exception):
                pool.close()
    return rows


def plot(inputs: list[Path], out: Path) -> None:
    """Requests per rank and build time against world size, old and new (from --json)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for p in inputs for r in json.loads(p.read_text()) if r.get("scheme") != "mismatch"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for scheme, group in sorted({(r["scheme"], r["group"]) for r in rows if "scheme" in r}):
        mine = sorted((r for r in rows if (r.get("scheme"), r.get("group")) == (scheme, group)),
                      key=lambda r: r["world"])  # fmt: skip
        label = f"{'whole mesh (0.2.0)' if scheme == 'old' else 'group-scoped'}, groups of {group}"
        style = "--o" if scheme == "old" else "-s"
        worlds = [r["world"] for r in mine]
        left.plot(worlds, [r["requests_max"] for r in mine], style, label=label)
        right.plot(worlds, [r["build_s"] for r in mine], style, label=label)
    for axis, title in ((left, "store requests per rank (most)"), (right, "build wall time, s")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("world size (simulated ranks, one TCPStore)")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=("sim", "real", "plot"), default="sim")
    parser.add_argument("inputs", nargs="*", type=Path, help="plot: --json files of sim")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "setup_scale.png")
    parser.add_argument("--worlds", type=int, nargs="+", default=None)
    parser.add_argument("--group", type=int, default=4, help="(cp, tp) group size (sim)")
    parser.add_argument("--old-max", type=int, default=256, help="largest world for the old")
    parser.add_argument("--builds", type=int, default=4, help="per world (real: 2 or more)")
    parser.add_argument("--call-timeout", type=float, default=600.0)
    parser.add_argument("--root", type=Path, default=None, help="a tensorcast checkout to run")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.root is not None:
        sys.path.insert(0, str(args.root.resolve()))
    if args.mode == "plot":
        plot(args.inputs, args.out)
        return 0
    if args.mode == "sim":
        args.worlds = args.worlds or [64, 256, 1024, 4096]
        rows = sim(args)
    else:
        args.worlds = args.worlds or [4, 8, 16, 32]
        rows = real(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
