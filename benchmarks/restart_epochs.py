"""A new epoch after a ``break``, many times: a lhotse sampler behind a DataLoader with
persistent workers (or none), epochs broken after 1, 2, 3 batches then run in full, on 2
local gloo ranks; every epoch must yield every cut once on every rank, without an error.

The suite runs it a few times (``tests/gloo/test_dist_restart.py``); this loop runs it more:

    PYTHONPATH=.:tests python benchmarks/restart_epochs.py --runs 20 --workers 2 --prefetch 3
"""

from __future__ import annotations

import argparse
import sys
import time

from rankpool import RankPool
from test_dist_restart import check, epochs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prefetch", type=int, nargs="+", default=[0, 1, 2, 3])
    args = parser.parse_args()
    pool = RankPool(2)
    failed = 0
    try:
        for run in range(args.runs):
            started = time.perf_counter()
            try:
                check(pool.run(epochs, args.prefetch, args.workers, timeout=120.0))
                print(f"run {run}: ok in {time.perf_counter() - started:.1f} s", flush=True)
            except AssertionError as e:  # RankFailure included
                failed += 1
                print(f"run {run}: FAILED\n{e}", flush=True)
    finally:
        pool.close()
    print(f"{args.runs - failed} of {args.runs} runs without an error", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
