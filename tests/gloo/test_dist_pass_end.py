"""The end of a pass: only where the program says so, the same on every rank (contract section
3, items 6 and 11; issue 33, items 1-5). Everything here goes through the public API.

1. **Exit.** Training scripts that stop mid-epoch with module-level iterators still alive,
   run as real gloo jobs (2 ranks, and 4 on a ``("dp", "tp")`` mesh), one process per rank
   as torchrun starts them: every process ends within seconds of its script's last line,
   with the program's own exit code (1 on an uncaught exception), never an abort.
2. **The garbage collector.** Passes left after the same batch on every rank but kept in a
   reference cycle, collected at moments that differ between ranks (``gc.collect()`` on one
   rank only, or a collection that runs inside tensorcast's own code): the loaders used
   after them on the same ranks work, and nothing deadlocks.
3. **Several passes.** A second ``iter(loader)`` never silently ends the first.
4. **Threads.** ``next()`` from two threads on one iterator never hands out ``None`` nor
   skips a batch.
5. **A mid-pass load.** ``load_state_dict()`` while a pass is open raises, saying to call it
   before ``iter()``; it works before ``iter()`` and once a pass has ended.
"""

from __future__ import annotations

import concurrent.futures
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rankpool import in_a_new_process_group
from subprocs import LAUNCHER_ENV, run_killable
from torch.utils.data import DataLoader

import tensorcast as tc

N = 8  # batches per pass of the rank-pool tests
LOADER_TIMEOUT_S = 10.0  # a desync fails in bounded time rather than at the pool's timeout
CALL_TIMEOUT_S = 90.0  # a pool call that takes longer hung


def batch(i: int, tag: int = 0) -> dict[str, Any]:
    return {"i": torch.tensor([i]), "tag": torch.tensor([tag]), "x": torch.full((4,), i + 0.5)}


def numbers(batches: list[Any]) -> list[int]:
    """What each batch is: its ``i`` (and None for anything that is not a batch)."""
    return [int(b["i"]) if isinstance(b, dict) else None for b in batches]  # type: ignore[misc]


def loader_on(rank: int, source: Any, prefetch: int) -> tc.BroadcastingDataLoader:
    """A loader on the whole default group with rank 0 as its source."""
    return tc.BroadcastingDataLoader(
        source if rank == 0 else None,
        group=dist.group.WORLD,
        src=0,
        prefetch=prefetch,
        timeout=LOADER_TIMEOUT_S,
    )


def model_step(rank: int, step: int) -> None:
    """The model's own collective, entered at a rank-dependent moment."""
    time.sleep(0.002 * ((rank + step) % 3))
    dist.all_reduce(torch.ones(1))


# -- 1. exit -----------------------------------------------------------------------------------

#: A training script in the style of Megatron-LM: module-level iterators, a few steps, then the
#: end of the script with every iterator still alive. argv: mode ("destroy": ends with
#: destroy_process_group(); "keep": without it; "raise": an uncaught exception), layout
#: ("flat": one group, rank 0 the source; "mesh": a (dp, tp) mesh, one source per dp slot),
#: speed ("fast"; "slow": the last loader's source takes seconds per batch after the steps
#: the script takes, so at exit its receivers wait for a frame on the wire). Four loaders on
#: the same ranks, prefetch 0 to 3.
EXIT_SCRIPT = r'''
import datetime, faulthandler, os, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks on a hang
faulthandler.enable(all_threads=True)  # and an abort says where
import torch
import torch.distributed as dist
import tensorcast as tc

MODE, LAYOUT, SPEED = sys.argv[1], sys.argv[2], sys.argv[3]
STEPS = 4
SLOW_S = 2.0

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank, world = dist.get_rank(), dist.get_world_size()


class Source:
    """A re-iterable source; a slow one takes SLOW_S per batch after the first STEPS."""

    def __init__(self, tag, slow):
        self.tag, self.slow = tag, slow

    def __iter__(self):
        for i in range(1000):
            if self.slow and i >= STEPS:
                time.sleep(SLOW_S)
            yield {"i": torch.tensor([i]), "x": torch.full((4,), 100.0 * self.tag + i)}


if LAYOUT == "mesh":
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    mine = tc.is_dp_source_rank(mesh, "tp")

    def make(prefetch):
        source = Source(prefetch, slow=prefetch == 3 and SPEED == "slow") if mine else None
        return tc.BroadcastingDataLoader(source, device_mesh=mesh, axes="tp", prefetch=prefetch)
else:
    def make(prefetch):
        source = Source(prefetch, slow=prefetch == 3 and SPEED == "slow") if rank == 0 else None
        return tc.BroadcastingDataLoader(source, group=dist.group.WORLD, src=0, prefetch=prefetch)

loaders = [make(p) for p in range(4)]
data_iterator = iter(loaders[0])
more_iterators = [iter(loader) for loader in loaders[1:]]

for step in range(STEPS):
    got = [int(next(it)["i"]) for it in [data_iterator, *more_iterators]]
    assert got == [step] * 4, got
    time.sleep(0.03 * ((rank + step) % world))  # the model's step, rank-dependent
    dist.all_reduce(torch.ones(1))
print(f"rank {rank}: {STEPS} steps", flush=True)

time.sleep(0.3 * rank)  # ranks reach the end of the script at different moments
print(f"END {rank} {time.monotonic():.3f}", flush=True)
if MODE == "raise":
    raise ValueError(f"rank {rank}: the model failed")
if MODE == "destroy":
    dist.destroy_process_group()
'''

#: Starts every rank of one job as torchrun does (env://, a free port), waits for them, and
#: prints one RESULT line: each rank's exit code, how long after its END line it ended, and
#: its output. A rank still alive EXIT_WITHIN_S after its END line is asked for its stacks
#: (SIGUSR1), then killed. argv: script, ranks, seconds, script args...
LAUNCHER = r"""
import json, os, signal, socket, subprocess, sys, time
script, n, within = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
procs, logs = [], []
for r in range(n):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
               LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n))
    logs.append(open(f"rank{r}.log", "w+"))
    procs.append(subprocess.Popen([sys.executable, script, *sys.argv[4:]], env=env,
                                  stdout=logs[r], stderr=subprocess.STDOUT))
ends, exits, hung = {}, {}, set()
give_up = time.monotonic() + 120
while len(exits) < n and time.monotonic() < give_up:
    now = time.monotonic()
    for r, p in enumerate(procs):
        if r in exits:
            continue
        if p.poll() is not None:
            exits[r] = now
            continue
        if r not in ends:
            with open(f"rank{r}.log") as f:
                for line in f:
                    if line.startswith(f"END {r} "):
                        ends[r] = float(line.split()[2])
        if r in ends and now - ends[r] > within and r not in hung:
            hung.add(r)
            p.send_signal(signal.SIGUSR1)  # its stacks, into its log
    for r in hung:
        if r not in exits and time.monotonic() - ends[r] > within + 1.5:
            procs[r].kill()
    time.sleep(0.02)
for p in procs:
    if p.poll() is None:
        p.kill()
    p.wait()
out = []
for r, p in enumerate(procs):
    with open(f"rank{r}.log") as f:
        text = f.read()
    out.append({"rank": r, "rc": p.returncode, "hung": r in hung,
                "after_end": exits.get(r, time.monotonic()) - ends[r] if r in ends else None,
                "log": text[-5000:]})
print("RESULT " + json.dumps(out), flush=True)
"""

EXIT_WITHIN_S = 15.0  # after its last line a process has ended (in seconds; a loaded 2-core CI)


def _run_job(tmp_path: Path, ranks: int, *script_args: str) -> list[dict[str, Any]]:
    script, launcher = tmp_path / "train.py", tmp_path / "launch.py"
    script.write_text(EXIT_SCRIPT)
    launcher.write_text(LAUNCHER)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    args = [sys.executable, str(launcher), str(script), str(ranks), str(EXIT_WITHIN_S)]
    rc, out = run_killable([*args, *script_args], tmp_path, env, timeout=150.0)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and lines, f"the launcher failed ({rc}):\n{out[-6000:]}"
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


#: (ranks, mode, layout, speed) of each job, and the exit code its processes must end with
EXIT_JOBS = {
    (2, "destroy", "flat", "fast"): 0,  # destroy_process_group(), then the end of the script
    (2, "keep", "flat", "slow"): 0,  # without it, receivers waiting for a frame at the end
    (2, "raise", "flat", "fast"): 1,  # an uncaught exception: Python's own exit code
    (4, "raise", "mesh", "slow"): 1,  # the same on a (dp, tp) mesh, frames on the wire
}


@pytest.fixture(scope="module")
def exit_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    """Every job of EXIT_JOBS, run at once (starting torch dominates: together they take
    about as long as one); each one's results, or what failed its launch."""

    dirs = {job: tmp_path_factory.mktemp("job") for job in EXIT_JOBS}  # not thread-safe

    def run(job: tuple[Any, ...]) -> Any:
        try:
            return _run_job(dirs[job], job[0], *job[1:])
        except BaseException as e:  # pytest.fail() on a hard timeout too: raised by the test
            return e

    with concurrent.futures.ThreadPoolExecutor(len(EXIT_JOBS)) as pool:
        return dict(zip(EXIT_JOBS, pool.map(run, EXIT_JOBS), strict=True))


def _check_exits(results: list[dict[str, Any]], want_rc: int) -> None:
    report = "\n".join(
        f"--- rank {r['rank']}: rc {r['rc']}, {'HUNG, ' if r['hung'] else ''}ended "
        f"{r['after_end'] if r['after_end'] is None else round(r['after_end'], 2)} s after "
        f"its last line\n{r['log']}"
        for r in results
    )
    for r in results:
        assert r["after_end"] is not None, f"rank {r['rank']} never reached its end\n{report}"
        assert not r["hung"], f"rank {r['rank']} did not end (stacks in its log)\n{report}"
        assert r["after_end"] < EXIT_WITHIN_S, report
        assert "terminate called" not in r["log"], report
        assert "Fatal Python error" not in r["log"], report
        assert r["rc"] == want_rc, (
            f"rank {r['rank']}: exit code {r['rc']}, want {want_rc}\n{report}"
        )


@pytest.mark.dist
@pytest.mark.parametrize("job", list(EXIT_JOBS), ids=lambda job: "-".join(map(str, job)))
def test_a_script_ends_with_iterators_alive(exit_jobs: dict[Any, Any], job: Any) -> None:
    """Module-level iterators of four loaders (prefetch 0 to 3) left mid-pass: every process
    ends within seconds of its last line, with the program's own exit code."""
    results = exit_jobs[job]
    if isinstance(results, BaseException):
        raise results
    _check_exits(results, EXIT_JOBS[job])
    if job[1] == "raise":
        for r in results:
            assert "ValueError: rank" in r["log"] and "the model failed" in r["log"], r["log"]


# -- 2. the garbage collector ------------------------------------------------------------------


def _left_in_a_cycle(loader: Any, rank: int, k: int) -> list[Any]:
    """Take ``k`` batches of a new pass, then leave it where only the cyclic collector frees
    it: the exception stored in a local keeps this frame, and so the iterator, in a cycle."""
    it = iter(loader)
    got = []
    for step in range(k):
        got.append(next(it))
        model_step(rank, step)
    try:
        raise ValueError("kept")
    except ValueError as e:
        kept = e  # noqa: F841  # the frame -> kept -> its traceback -> the frame
    return got


@in_a_new_process_group
def _rank_gc_at_different_moments(rank: int, world: int, prefetch: int) -> list[list[int]]:
    gc.collect()
    gc.disable()  # collections happen only where this function says, differently per rank
    seen: list[list[int]] = []
    try:
        again = loader_on(rank, [batch(i, 1) for i in range(N)], prefetch)
        for epoch in range(6):
            # A loader left after 2 batches on every rank, kept in a cycle...
            once = loader_on(rank, [batch(i, 2) for i in range(N)], prefetch)
            seen.append(numbers(_left_in_a_cycle(once, rank, 2)))
            # ...and a pass of a loader kept across epochs, left after epoch % 3 + 1 batches.
            seen.append(numbers(_left_in_a_cycle(again, rank, epoch % 3 + 1)))
            if rank == world - 1 and epoch % 2 == 0:
                gc.collect()  # on one rank only
            model_step(rank, epoch)
            # Whole passes on the same ranks: a fresh loader, and the kept one.
            seen.append(numbers(list(loader_on(rank, [batch(i, 3) for i in range(N)], prefetch))))
            if rank == 0 and epoch % 3 == 1:
                gc.collect()  # on another rank, at another moment
            seen.append(numbers(list(again)))
            model_step(rank, epoch)
    finally:
        gc.enable()
    return seen


@pytest.mark.parametrize("prefetch", [0, 2])
def test_passes_freed_by_the_collector_at_different_moments(pool2: Any, prefetch: int) -> None:
    """Passes left after the same batch on every rank, freed by ``gc.collect()`` on one rank
    at a time: every later pass on the same ranks is whole, on every rank alike."""
    results = pool2.run(_rank_gc_at_different_moments, prefetch, timeout=CALL_TIMEOUT_S)
    want = []
    for epoch in range(6):
        want += [[0, 1], list(range(epoch % 3 + 1)), list(range(N)), list(range(N))]
    for rank, seen in enumerate(results):
        assert seen == want, f"rank {rank}: {seen}"


def _inside_tensorcast(where: str) -> bool:
    """Whether a collection starting now runs inside tensorcast's code (anywhere up the
    stack): on the caller's thread (``where="caller"``) or on a thread tensorcast started
    (``"own"``: the lane's worker, which holds the lane's lock at some of them)."""
    if (threading.current_thread() is threading.main_thread()) != (where == "caller"):
        return False
    package = os.path.dirname(tc.__file__)
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(package):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


@in_a_new_process_group
def _rank_collector_inside_tensorcast(
    rank: int, world: int, prefetch: int, where: str
) -> list[list[int]]:
    """Passes left after the same batch on every rank wait in ``spare``, held there only.
    With a collection at almost every allocation, the collector's callback lets one go at
    collections that start inside tensorcast's code (``where``: see
    :func:`_inside_tensorcast`): its finaliser runs right there, holding whatever
    tensorcast holds then, at moments that differ between ranks (on the caller's thread
    at every ``rank + 2``-th; on tensorcast's own, at every one from the ``150 * rank``-th
    on)."""
    spare: list[Any] = []
    for k in range(16):
        it = iter(loader_on(rank, [batch(i, 4) for i in range(N)], prefetch))
        for step in range(k % 3 + 1):
            next(it)
            model_step(rank, step)
        spare.append(it)
    del it
    calls = [0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and spare and _inside_tensorcast(where):
            calls[0] += 1
            if calls[0] % (rank + 2) == 0 if where == "caller" else calls[0] > 150 * rank:
                spare.pop()  # the last reference: finalised inside this collection

    seen: list[list[int]] = []
    old = gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(1)  # a young collection at almost every allocation
    try:
        loader = loader_on(rank, [batch(i, 5) for i in range(N)], prefetch)
        for _ in range(4):
            seen.append(numbers(list(loader)))
            got = []
            for step, b in enumerate(loader):
                got.append(b)
                model_step(rank, step)
                if step == 2:
                    break
            seen.append(numbers(got))
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*old)
    spare.clear()  # the rest, at the same point on every rank
    seen.append(numbers(list(loader_on(rank, [batch(i, 6) for i in range(N)], prefetch))))
    return seen


@pytest.mark.parametrize(
    ("where", "prefetch"), [("caller", 0), ("caller", 2), ("own", 1), ("own", 2)]
)
def test_a_collection_inside_tensorcast_never_deadlocks(
    pool2: Any, where: str, prefetch: int
) -> None:
    """Finalisers of left passes run inside collections triggered from tensorcast's own code
    (its locks may be held), at moments that differ between ranks: no deadlock, no error,
    every pass whole on every rank."""
    results = pool2.run(_rank_collector_inside_tensorcast, prefetch, where, timeout=CALL_TIMEOUT_S)
    want = [list(range(N)), [0, 1, 2]] * 4 + [list(range(N))]
    for rank, seen in enumerate(results):
        assert seen == want, f"rank {rank}: {seen}"


# -- 3. several passes ---------------------------------------------------------------------------


@in_a_new_process_group
def _rank_second_iter(rank: int, world: int, prefetch: int) -> dict[str, Any]:
    loader = loader_on(rank, [batch(i) for i in range(N)], prefetch)
    it1 = iter(loader)
    first = numbers([next(it1)])
    out: dict[str, Any] = {"first": first}
    try:
        it2 = iter(loader)
    except RuntimeError as e:  # allowed: a second pass while one is open is refused...
        out["refused"] = str(e)
        out["rest1"] = numbers(list(it1))  # ...and the open one goes on
    else:
        out["refused"] = None
        out["second"] = numbers([next(it2)])
        out["rest1"] = numbers(list(it1))
        out["rest2"] = numbers(list(it2))
    out["after"] = numbers(list(loader))  # a whole pass after them
    return out


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_second_iter_never_ends_the_first_silently(pool2: Any, prefetch: int) -> None:
    """``it1 = iter(loader); next(it1); it2 = iter(loader)``: either the second ``iter()``
    raises a RuntimeError naming the open pass, or both passes are whole; ``it1`` never stops
    early as if its epoch had ended."""
    results = pool2.run(_rank_second_iter, prefetch, timeout=CALL_TIMEOUT_S)
    for rank, out in enumerate(results):
        assert out["first"] == [0], out
        assert out["rest1"] == list(range(1, N)), f"rank {rank}: it1 stopped early: {out}"
        if out["refused"] is not None:
            assert "pass" in out["refused"].lower(), out  # names the open pass
        else:
            assert out["second"] == [0] and out["rest2"] == list(range(1, N)), out
        assert out["after"] == list(range(N)), out
    assert all(out == results[0] for out in results), results


class Restarting:
    """A source that is its own iterator and starts over at ``iter()``, as a lhotse sampler
    (and a ``DataLoader`` with persistent workers) does: its items are ``make(i)``."""

    def __init__(self, n: int, make: Any = batch) -> None:
        self.n = n
        self.make = make
        self.at = 0

    def __iter__(self) -> Restarting:
        self.at = 0
        return self

    def __next__(self) -> Any:
        if self.at == self.n:
            raise StopIteration
        self.at += 1
        return self.make(self.at - 1)


def _zipped(loader: tc.BroadcastingDataLoader) -> dict[str, Any]:
    """The pairs of ``zip(loader, loader)``, and what it raised (type and message)."""
    pairs: list[list[int]] = []
    try:
        for pair in zip(loader, loader):
            pairs.append(numbers(list(pair)))
    except RuntimeError as e:
        return {"pairs": pairs, "raised": (type(e).__name__, str(e))}
    return {"pairs": pairs, "raised": None}


@in_a_new_process_group
def _rank_zip(rank: int, world: int, prefetch: int) -> dict[str, Any]:
    out: dict[str, Any] = {"zip": _zipped(loader_on(rank, [batch(i) for i in range(N)], prefetch))}
    loader = loader_on(rank, [batch(i) for i in range(N)], prefetch)
    out["after"] = numbers(list(loader))
    # Sources that hand out one iterator: a generator, and one that restarts at iter().
    out["shared"] = _zipped(loader_on(rank, iter([batch(i) for i in range(2 * N)]), prefetch))
    restarting = loader_on(rank, Restarting(N), prefetch)
    out["restarting"] = _zipped(restarting)
    # A DataLoader's iterators are new each time, but draw from its one restarting sampler.
    batches = [batch(i) for i in range(N)]
    under = DataLoader(batches, sampler=Restarting(N, int), batch_size=None)  # type: ignore[arg-type]
    out["sampler"] = _zipped(loader_on(rank, under, prefetch))
    # A pass left by a break and kept alive is no obstacle to the next one; used again,
    # it raises rather than take the new pass's batches.
    kept = iter(restarting)
    head = [next(kept), next(kept)]
    out["head"] = numbers(head)
    out["next pass"] = numbers(list(restarting))
    try:
        more = [next(kept) for _ in range(N)]
    except (RuntimeError, StopIteration) as e:
        out["kept"] = type(e).__name__
    else:
        out["kept"] = numbers(more)
    out["after restarting"] = numbers(list(restarting))
    return out


@pytest.mark.parametrize("prefetch", [0, 2])
def test_zip_of_a_loader_with_itself(pool2: Any, prefetch: int) -> None:
    """``zip(loader, loader)`` is never zero steps, never repeats or shares a batch silently:
    over a re-iterable source it yields pairs (independent passes, as torch's DataLoader);
    over a source that hands out one iterator, the first pass raises at its next draw,
    naming the second, on every rank (the source's RuntimeError, the receivers'
    SourceError). Identical on every rank."""
    results = pool2.run(_rank_zip, prefetch, timeout=CALL_TIMEOUT_S)
    for rank, out in enumerate(results):
        assert out["zip"] == {"pairs": [[i, i] for i in range(N)], "raised": None}, out
        assert out["after"] == list(range(N)), out
        for kind in ("shared", "restarting", "sampler"):
            got = out[kind]
            assert got["raised"] is not None, f"rank {rank}, {kind}: {got}"
            name, message = got["raised"]
            assert name == ("RuntimeError" if rank == 0 else "SourceError"), got
            assert "pass 2 called iter() on the same source" in message, got
            # the pairs before it: each pass's batches, none repeated within a pass
            firsts = [a for a, _ in got["pairs"]]
            assert len(set(firsts)) == len(firsts), got
        assert out["head"] == [0, 1] and out["next pass"] == list(range(N)), out
        assert out["kept"] == ("RuntimeError" if rank == 0 else "SourceError"), out
        assert out["after restarting"] == list(range(N)), out
    assert [out["head"] for out in results] == [results[0]["head"]] * len(results)


class SlowAfter:
    """A dataset of ``batch(i)`` whose items from ``k`` on take a moment: the steps a pass
    queued ahead are still drawing when the program starts the next pass."""

    def __init__(self, k: int) -> None:
        self.k = k

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i >= self.k:
            time.sleep(0.2)
        return batch(i)

    def __len__(self) -> int:
        return N


@in_a_new_process_group
def _rank_loader_per_epoch(rank: int, world: int, prefetch: int) -> list[list[int]]:
    """A loader made anew each epoch over the same DataLoader and its restarting sampler
    (a framework that rebuilds its loaders), each epoch left after 3 batches."""
    inner = DataLoader(SlowAfter(3), sampler=Restarting(N, int), batch_size=None)  # type: ignore[arg-type]
    seen = []
    for _ in range(3):
        got = []
        for step, b in enumerate(loader_on(rank, inner, prefetch)):
            got.append(b)
            model_step(rank, step)
            if step == 2:
                break
        seen.append(numbers(got))
    return seen


@pytest.mark.parametrize("prefetch", [1, 2])
def test_a_loader_made_anew_each_epoch_over_one_source_starts_it_over(
    pool2: Any, prefetch: int
) -> None:
    """The steps the last epoch's loader queued ahead are done before the next loader's
    ``iter(source)`` restarts the sampler: they never draw (and drop) its first batches."""
    for rank, seen in enumerate(
        pool2.run(_rank_loader_per_epoch, prefetch, timeout=CALL_TIMEOUT_S)
    ):
        assert seen == [[0, 1, 2]] * 3, f"rank {rank}: {seen}"


# -- 4. threads ------------------------------------------------------------------------------------


class SlowList:
    """A re-iterable source whose batches take a moment each: a second thread arrives while
    the first is inside ``next()``."""

    def __init__(self, n: int, delay_s: float) -> None:
        self.n = n
        self.delay_s = delay_s

    def __iter__(self) -> Any:
        for i in range(self.n):
            time.sleep(self.delay_s)
            yield batch(i)


@in_a_new_process_group
def _rank_two_threads(rank: int, world: int, prefetch: int) -> dict[str, Any]:
    n = 40
    loader = loader_on(rank, SlowList(n, 0.002), prefetch)
    it = iter(loader)
    handed: list[Any] = []
    refused: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(2)

    def consume() -> None:
        start.wait()
        while True:
            try:
                b = next(it)
            except StopIteration:
                return
            except RuntimeError as e:  # allowed: "another thread is inside next()"
                if isinstance(e, (tc.DesyncError, tc.PeerError, tc.SourceError)):
                    errors.append(f"{type(e).__name__}: {e}")
                    return
                with lock:
                    refused.append(str(e))
                time.sleep(0.0005)
                continue
            except BaseException as e:
                errors.append(f"{type(e).__name__}: {e}")
                return
            with lock:
                handed.append(b)

    threads = [threading.Thread(target=consume) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    out = {
        "alive": [t.is_alive() for t in threads],
        "handed": sorted(numbers(handed), key=lambda i: -1 if i is None else i),
        "nones": sum(b is None for b in handed),
        "errors": errors,
        "refused": len(refused),
        "refused_text": refused[:1],
    }
    out["after"] = numbers(list(loader))  # the loader works after
    return out


@pytest.mark.parametrize("prefetch", [0, 2])
def test_next_from_two_threads(pool2: Any, prefetch: int) -> None:
    """Two threads call ``next()`` on one iterator at once: each batch is handed out once,
    never ``None``, never skipped (a RuntimeError to one of them, or waiting its turn, is
    allowed); every rank ends with the same batches."""
    results = pool2.run(_rank_two_threads, prefetch, timeout=CALL_TIMEOUT_S)
    for rank, out in enumerate(results):
        assert not any(out["alive"]) and not out["errors"], f"rank {rank}: {out}"
        assert out["nones"] == 0, f"rank {rank} handed out None: {out}"
        assert out["handed"] == list(range(40)), f"rank {rank}: {out}"
        assert out["after"] == list(range(40)), f"rank {rank}: {out}"


# -- 5. a mid-pass load ----------------------------------------------------------------------------


class Position:
    """A re-iterable source with a state: its position in the pass (0 again after the end)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0

    def __iter__(self) -> Any:
        while self.pos < self.n:
            self.pos += 1
            yield batch(self.pos - 1)
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


@in_a_new_process_group
def _rank_mid_pass_load(rank: int, world: int, prefetch: int) -> dict[str, Any]:
    loader = loader_on(rank, Position(N), prefetch)
    out: dict[str, Any] = {}
    # Before iter(): a resume from position 3.
    loader.load_state_dict({"pos": 3})
    it = iter(loader)
    out["resumed"] = numbers([next(it), next(it)])
    # While the pass is open: refused, and the pass goes on.
    try:
        loader.load_state_dict({"pos": 0})
        out["mid"] = None
    except RuntimeError as e:
        out["mid"] = str(e)
    out["rest"] = numbers(list(it))
    # Once the pass has ended: accepted.
    loader.load_state_dict({"pos": 5})
    out["after_end"] = numbers(list(loader))
    # After a pass left by a break after the same batch on every rank: accepted too.
    for _ in loader:
        break
    loader.load_state_dict({"pos": 6})
    out["after_break"] = numbers(list(loader))
    return out


@pytest.mark.parametrize("prefetch", [0, 2])
def test_load_state_dict_during_a_pass_raises(pool2: Any, prefetch: int) -> None:
    """``load_state_dict()`` while a pass is open raises a RuntimeError saying to call it
    before ``iter()`` (on every rank) and leaves the pass whole; before ``iter()``, after a
    pass ended and after a break it works."""
    results = pool2.run(_rank_mid_pass_load, prefetch, timeout=CALL_TIMEOUT_S)
    for rank, out in enumerate(results):
        assert out["resumed"] == [3, 4], f"rank {rank}: {out}"
        assert out["mid"] is not None, f"rank {rank}: a mid-pass load was accepted: {out}"
        assert "iter()" in out["mid"], out
        assert out["rest"] == list(range(5, N)), f"rank {rank}: the pass was ended: {out}"
        assert out["after_end"] == list(range(5, N)), out
        assert out["after_break"] == list(range(6, N)), out
