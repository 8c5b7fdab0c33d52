"""What a source's heartbeat costs the store: writes per second per source rank.

Each timeout runs two heartbeats side by side for ``--seconds``, each writing through a
store that counts its writes, while a simulated source steps (``--step`` seconds a step,
``--inside`` of it in ``next(source)``): tensorcast's, and the baseline of 0.2.0 (one
write every ``min(1, timeout / 8)`` seconds, for as long as the job runs). Then the same
schedule over an hour of simulated time, for timeouts too long to wait out, and what it
all means at 16,384 ranks, one source per ``(cp, tp)`` group.

    python benchmarks/bench_heartbeat.py
    python benchmarks/bench_heartbeat.py --seconds 60 --timeouts 120 600 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tensorcast.transport.liveness import Heartbeat, Schedule

WORLD = 16_384


class Counting:
    """A store that counts the writes made through it."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.sets = 0

    def set(self, key: str, value: str) -> None:
        self.sets += 1
        self.store.set(key, value)


def _legacy(store: Counting, timeout_s: float, stop: threading.Event) -> None:
    """0.2.0's heartbeat: a write now, then one per period."""
    period = min(1.0, max(0.1, timeout_s / 8))
    store.set("alive/0", "0")
    while not stop.wait(period):
        store.set("alive/0", "0")


def measure(timeouts: list[float], seconds: float, step: float, inside: float) -> list[dict]:
    """Real threads, real time: writes per second of each scheme at each timeout."""
    stop = threading.Event()
    runs = []
    for timeout_s in timeouts:
        ours, old = Counting(), Counting()
        heartbeat = Heartbeat(ours, 0, timeout_s, lambda: not stop.is_set())
        mark = heartbeat.busy("next(source)", 1)
        heartbeat.start(timeout_s)
        threading.Thread(target=_legacy, args=(old, timeout_s, stop), daemon=True).start()
        runs.append((timeout_s, ours, old, mark))
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # the source: in next(source), then the caller's step
        for *_, mark in runs:
            mark.__enter__()
        time.sleep(step * inside)
        for *_, mark in runs:
            mark.__exit__()
        time.sleep(step * (1 - inside))
    stop.set()
    return [
        {"timeout_s": t, "ours": ours.sets / seconds, "baseline": old.sets / seconds}
        for t, ours, old, _ in runs
    ]


def simulate(timeout_s: float, seconds: float, step: float, inside: float) -> float:
    """The schedule over ``seconds`` of simulated time: writes per second."""
    schedule = Schedule(timeout_s)
    now = written = since = 0.0
    writes = 1
    while now < seconds:
        now += schedule.fast
        phase = now % step  # inside next(source) for the first `inside` of each step
        since = now - phase if phase < step * inside else now - phase + step * inside
        if schedule.due(now, written, since, held=False):
            written, writes = now, writes + 1
    return writes / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeouts", type=float, nargs="+", default=[120.0, 600.0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--step", type=float, default=0.1, help="seconds per training step")
    parser.add_argument("--inside", type=float, default=0.3, help="share in next(source)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    measured = measure(args.timeouts, args.seconds, args.step, args.inside)
    print(f"measured over {args.seconds:g} s, real threads (writes/s per source rank):")
    print(f"{'timeout':>9} {'tensorcast':>11} {'0.2.0':>7} {'ratio':>7}")
    for row in measured:
        ratio = row["baseline"] / row["ours"] if row["ours"] else float("inf")
        print(
            f"{row['timeout_s']:>8g}s {row['ours']:>11.3f} {row['baseline']:>7.3f} {ratio:>6.1f}x"
        )

    simulated: list[dict[str, Any]] = []
    print("\nsimulated over an hour, and at 16,384 ranks (writes/s on the store):")
    print(
        f"{'timeout':>9} {'per source':>11} {'0.2.0':>7} "
        + " ".join(f"{'groups of ' + str(g):>13}" for g in (2, 4, 8))
    )
    for timeout_s in sorted({*args.timeouts, 600.0, 1800.0}):
        ours = simulate(timeout_s, 3600.0, args.step, args.inside)
        old = 1 / min(1.0, max(0.1, timeout_s / 8))
        totals = {g: ours * WORLD / g for g in (2, 4, 8)}
        simulated.append({"timeout_s": timeout_s, "ours": ours, "baseline": old, "world": totals})
        cells = " ".join(f"{v:>7.0f} ({old * WORLD / g:>4.0f})" for g, v in totals.items())
        print(f"{timeout_s:>8g}s {ours:>11.4f} {old:>7.3f} {cells}")
    print("(in brackets: 0.2.0's heartbeat)")
    if args.json:
        args.json.write_text(json.dumps({"measured": measured, "simulated": simulated}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
