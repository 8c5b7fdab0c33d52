"""A reusable pool of local ranks on a real gloo group, for multi-process tests.

Starting ranks is slow, so a pool starts ``world_size`` processes once and then runs many
test functions on them; each is forked from a server process that imported torch once
for all of them (``forkserver``), rather than spawned to import torch again (seconds
each on a busy machine). Every call has a hard timeout: a hang kills the pool (it is
re-started on the next call) and fails the test with what each rank had reported. No fixed ports: ranks meet through a FileStore in a temp dir, and
gloo binds ephemeral loopback ports.

    pool = RankPool(4)
    results = pool.run(my_rank_fn, arg1, timeout=30)   # my_rank_fn(rank, world, arg1)

``my_rank_fn`` must be a module-level function (it is sent to the ranks by reference).
A rank function may tear the process group down; the next call initialises a new one.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import gc
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# The ranks share one host, so payloads would take the shared-memory lane: off here, so that
# the wire's tests test the wire; the lane's tests (test_dist_shm.py) turn it on per call.
_ENV = {
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TENSORCAST_SHM_LIMIT": "0",
}
#: what the fork server imports before it forks any rank: no threads, no process group
_PRELOAD = ["torch", "torch.distributed", "numpy"]


def start_context() -> Any:
    """How test ranks start: forked from a server that imported torch once (a rank then
    starts in a fraction of a second, and exits without tearing an interpreter down),
    else spawned."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs: the same list
    return ctx


@dataclass(frozen=True)
class Died:
    """What a rank that died during a call reports."""

    rank: int
    exitcode: int | None


class RankFailure(AssertionError):
    """One or more ranks raised, died or timed out; the message has every rank's report."""


def _init(rank: int, world: int, store_path: str, timeout_s: float) -> None:
    import datetime

    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def in_a_new_process_group(
    fn: Callable[..., Any], *, pg_timeout: float = 60.0
) -> Callable[..., Any]:
    """Run the rank function ``fn`` on a new default group over a new store, and tear it
    down after, whatever happened: tensorcast's state for it (agreements, groups,
    channels) starts empty, and a scenario that breaks a group on purpose leaves nothing
    for the next call on the pool."""

    @functools.wraps(fn)
    def run(rank: int, world: int, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        name: list[Any] = [f"tensorcast-tests-{uuid.uuid4().hex}"] if rank == 0 else [None]
        dist.broadcast_object_list(name, src=0)  # the test's own traffic: pickling is fine
        dist.destroy_process_group()
        _init(rank, world, os.path.join(tempfile.gettempdir(), name[0]), pg_timeout)
        try:
            return fn(rank, world, *args, **kwargs)
        finally:
            if dist.is_initialized():  # a rank function may have torn it down itself
                dist.destroy_process_group()
            # Free tensorcast's groups of this default group here, not in some thread of
            # the next call: gloo waits for a pending operation when its group is freed.
            gc.collect()

    return run


def _worker(rank: int, world: int, tasks: Any, results: Any) -> None:
    for k, v in _ENV.items():
        os.environ[k] = v
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    while True:
        task = tasks.get()
        if task is None:
            break
        call_id, fn, args, kwargs, store_path, pg_timeout, timeout = task
        # A rank still running just before the parent gives up writes every thread's
        # stack, which the parent's report of the hang then shows.
        stacks = open(_stacks_path(store_path, rank), "w")  # noqa: SIM115
        faulthandler.dump_traceback_later(max(timeout - 1.0, 0.5), file=stacks)
        try:
            if not dist.is_initialized():
                _init(rank, world, store_path, pg_timeout)
            value = fn(rank, world, *args, **kwargs)
            results.put((call_id, rank, True, value))
        except BaseException as e:  # reported to the parent, which fails the test
            results.put(
                (call_id, rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            )
        finally:
            faulthandler.cancel_dump_traceback_later()
            stacks.close()
            # A call's garbage goes here, not in a process the next call forks (a DataLoader
            # worker), whose collection would free a process group that the garbage holds
            # (a test's mesh, once its default group is torn down): gloo's destructor then
            # joins threads the child does not have, and segfaults.
            gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _stacks_path(store_path: str, rank: int) -> str:
    return f"{store_path}-stacks-{rank}"


def _read_stacks(path: str) -> str:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "(no stacks written)"
    return text or "(no stacks written)"


class RankPool:
    """``world_size`` local ranks that run test functions on a gloo group.

    Args:
        world_size: how many ranks.
        pg_timeout: the process group's collective timeout, in seconds.
    """

    def __init__(self, world_size: int, *, pg_timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.pg_timeout = pg_timeout
        self._ctx = start_context()
        self._dir = tempfile.mkdtemp(prefix="tensorcast-ranks-")
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None

    def _start(self) -> None:
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            self._ctx.Process(
                target=_worker,
                args=(r, self.world_size, self._tasks[r], self._results),
                daemon=True,
                name=f"rank{r}",
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        self._procs = []

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = 60.0,
        allow_death: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; its results by rank.

        Raises:
            RankFailure: a rank raised, died (unless ``allow_death``) or did not finish
                within ``timeout`` seconds. The pool is re-started after a hang or death.
        """
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self._kill()
            self._start()
        call_id = uuid.uuid4().hex
        store_path = os.path.join(self._dir, f"store-{call_id}")
        for q in self._tasks:
            q.put((call_id, fn, args, kwargs, store_path, self.pg_timeout, timeout))
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size and time.monotonic() < deadline:
            try:
                cid, rank, ok, value = self._results.get(timeout=0.1)
            except queue.Empty:
                dead = [i for i, p in enumerate(self._procs) if not p.is_alive() and i not in got]
                for i in dead:  # give a dying rank's last report a moment to arrive
                    got.setdefault(i, (False, Died(i, self._procs[i].exitcode)))
                continue
            if cid == call_id:
                got[rank] = (ok, value)
        hung = [r for r in range(self.world_size) if r not in got]
        died = [r for r, (ok, v) in got.items() if isinstance(v, Died)]
        failed = [r for r, (ok, v) in got.items() if not ok and not isinstance(v, Died)]
        if hung or died:
            self._kill()  # a hung or dead rank leaves the group unusable
        if hung or failed or (died and not allow_death):
            lines = [f"{fn.__name__} on {self.world_size} ranks:"]
            for r in range(self.world_size):
                if r in hung:
                    lines.append(f"--- rank {r}: no result within {timeout}s (hung)")
                    lines.append(_read_stacks(_stacks_path(store_path, r)))
                else:
                    ok, v = got[r]
                    lines.append(f"--- rank {r}: {'ok' if ok else 'FAILED'}\n{v if not ok else ''}")
            raise RankFailure("\n".join(lines))
        return [got[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._tasks:
            with contextlib.suppress(ValueError, OSError):  # a killed rank's closed queue
                q.put(None)
        for p in self._procs:
            p.join(10)
        self._kill()


@contextlib.contextmanager
def may_start_workers() -> Iterator[None]:
    """Let this pool rank start DataLoader workers.

    The pool's ranks are daemonic processes, and multiprocessing refuses children to a
    daemon. The workers never outlive the loaders that start them here.
    """
    config = mp.current_process()._config  # type: ignore[attr-defined]
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon
