"""Check the CUDA paths on a machine with one GPU: PASS / FAIL / SKIP per check.

    python3 tests/gpu/gpu_stream_check.py [--out DIR] [--json out.json] [--parts A,B,C]
    python3 tests/gpu/gpu_stream_check.py --plan          # the parts, limits and checks
    python3 tests/gpu/gpu_stream_check.py --summary DIR   # summary.txt of a run's DIR

``bash tests/gpu/device_run.sh OUTDIR`` runs every part and the overlap benchmark within
one command's time, from a plain copy of the tree (see ``docs/reliability.md``, "GPU
checks"). Nothing needs installing: the script puts the repository on ``sys.path`` and
its parts' processes on ``PYTHONPATH``; it needs torch, numpy and a CUDA device.

Exit status: 0 when no check failed (a SKIP is not a failure); 1 when a check failed or
a part did not finish within its limit; 77 when no CUDA device is visible (nothing is
checked: 77 is the "skipped" status of test drivers).

Each part runs in processes of its own under a hard limit (``PART_TIMEOUT_S``), so a hang
fails that part and the next one still runs. Every check's outcome is written as one
JSON line the moment it is known; with ``--out DIR`` those lines, each process's output
and each part's verdicts (``part-X.json``) land in ``DIR`` as soon as they exist, so a run
that is cut off still returns what it did. GPU streams are made busy with
``torch.cuda._sleep``, calibrated once per part (by one process only: two calibrating at
once on one GPU would share it). A batch's device work is posted on the caller's thread,
on tensorcast's transfer stream, which first waits on the caller's current stream; the
caller's current stream then waits on an event, and the buffer is recorded on it (NOTE
[ Device work at next() ]). One GPU cannot hold a multi-rank NCCL group, so these checks
do what one GPU can (``benchmarks/multi_gpu_check.py`` has the rest, on two or more):

Part A, one process, no process group:

- R1-R6: round trips: pack / unpack of CUDA trees of every dtype, leaves that view the
  buffer, a CPU tree packed onto the GPU, unpack onto the GPU, numpy leaves of a GPU
  buffer, ``Packed.pin_memory``.
- T1: a real sender and receiver (over the shipped in-memory wire) that hand out CUDA
  trees: a tree read on a side stream behind a 200 ms sleep, then dropped, is not
  overwritten by the next frame; with a consumer on one side stream and the next frame
  taken on another, and with an explicit ``record_stream`` on a third.
- T2: host syncs of ``tc.pack`` / ``tc.unpack`` under ``set_sync_debug_mode("warn")``:
  none for a tensor-only CUDA tree or a CPU tree packed onto the GPU; ndarray and str
  leaves reported.
- T3: pinned staging (a pool over pinned host memory, uploads held until their event is
  seen done): a steady size reuses its buffers; 50 sizes from 1-64 MiB keep the pinned
  memory bounded by the size classes (checked only where torch can reset the peak of its
  host memory statistics; reported elsewhere).
- T18a: a padded (B, T) float32 audio batch whose rows end in runs of zeros, packed with
  ``trim=True`` onto the GPU: from the CPU, smaller than ``trim=False``; from the GPU (a
  2-D CUDA source leaf), packed with no host sync, so whole; both unpacked bit for bit
  with no host sync (SKIP while ``tc.pack`` has no ``trim=``).

Part B, two gloo ranks sharing the GPU (a FileStore; a new process group per check):

- R7: ``tc.broadcast`` and a loader pass of CUDA batches of every dtype, received on the GPU.
- T4: a consumer on a side stream, with a 300 ms sleep queued on the *default* stream
  before every ``next()`` / ``broadcast()``: each batch it snapshots on its stream is that
  step's, for ``tc.broadcast`` inline, the loader at ``prefetch`` 1 and 2, and a
  ``tc.broadcast`` made while a loader step is on the lane.
- T5: whole passes of tensor-only batches under ``set_sync_debug_mode("error")`` at
  ``prefetch`` 0, 1 and 2 raise nothing; syncs per batch with ``verify=True`` reported.
- T5b: batches with ndarray, str and bytes leaves on a gloo group with ``device="cuda"``:
  no host sync on either rank (review N-3).
- T7: under ``torch.profiler``, a receiver's lane worker makes no CUDA stream, event,
  copy or memory call; a trace whose thread ids are not the system's is a SKIP.
- T15: after a receiver refuses a batch (a payload corrupted in transit, ``verify=True``,
  ``prefetch=2``), the next payloads of the group (the loader's and a ``tc.broadcast``'s)
  are posted in the same order on both ranks (review N-1). The group's payloads take the
  device path on the GPU (``CudaTap``) and hop between the ranks through gloo.
- T18b: the trimmed audio batch, with a trimmed ndarray, over gloo to a receiver with
  ``device="cuda"``: bit for bit, no host sync on the receiver (SKIP while
  ``tc.broadcast`` has no ``trim=``).
- T6: a CUDA graph captured on the main thread after every ``next()`` while the loader
  prefetches (the source sleeps 20 ms per batch), 20 steps at ``prefetch`` 1 and 2: no
  capture error, the lane not broken, every batch right. T6b: the same with batch sizes
  cycling through six size classes, so that pinned staging misses its pool on every
  batch (allocations and the host allocator's event queries on the lanes' workers while
  the main thread captures). The capture mode is reported.

Part C, an NCCL group of one (``init_process_group("nccl", world_size=1, device_id=...)``):

- R8: CUDA and CPU trees of every dtype, a large tree that is a copy of the source's
  input, a pre-packed batch with ``device="cpu"``.
- T8: with the default stream busy for 1 s, a 64 MiB CPU tree broadcast from inside
  ``torch.cuda.stream(s)`` returns in under 50 ms and is ready on ``s`` in under 100 ms;
  the same with the host work forced onto the worker.
- T9: the source's own tree, read on a side stream behind a 200 ms sleep and dropped, is
  not overwritten by the next broadcast (the library's hand-over, and ``record_stream``).
- T10: a CPU ``tc.pack`` broadcasts to CUDA leaves with equal bytes; ``device="cpu"``.
- T11: syncs per broadcast: none for a CUDA tensor-only tree; others reported; a sender
  with ``verify=True``: a CUDA batch is a ``ValueError`` and the sender goes on.
- T16: ``tc.broadcast`` of a 256 MiB CUDA tree, then ``del`` and ``gc.collect()``:
  ``torch.cuda.memory_allocated()`` is back to its baseline at once (review N-2).
- T13a-c: the thread count after ``destroy_process_group`` is within 2 of a plain NCCL
  cycle's; no "destroyed without shutdown" warning; the process exits within 30 s.
- T14: ``lane.break_`` with a payload queued behind a 2 s sleep returns within 10 s, the
  next ``tc.broadcast`` raises ``PeerError`` (weak on one rank: nothing is in flight).
- T19: a CUDA input whose transfer is still queued when its deadline breaks the lane is
  not handed to the allocator before the transfer read it (review N-7).
- T20: with ``TORCH_NCCL_BLOCKING_WAIT=1``, a broadcast still returns at once while the
  stream is busy, or tensorcast warns or refuses naming the variable (review N-5).
- T21: two of tensorcast's NCCL groups on the GPU (two communicators of one rank, made
  as tensorcast makes them): group A's part waits 1.5 s on a slow peer, group B's is
  posted after it and is done at once, while A's is not (review N-4).
- T22: tensorcast's group's abort made to block for 30 s; a broadcast whose payload waits
  behind a 2 s sleep past its 0.3 s deadline breaks the lane on its worker, and a job
  queued behind the break raises ``PeerError`` within 15 s, the abort running on a
  thread of its own (review N-6).
- T12: a real ``Sender`` and ``Receiver`` on real lanes, over a wire whose payloads are
  CUDA copies with NCCL's stream contract, consumers on alternating side streams, the
  default stream busy before every step, ``prefetch`` 1 and 2: every snapshot that
  step's, a late read of a dropped tree still that step's, every payload posted by a
  consumer thread. T12s: no host sync on the receiver's consumer thread or its lane's
  worker, counted up to its last step (review S6).
- T24: a one-off ``tc.broadcast`` with a 1 s timeout, its part not done at its hand-out:
  a graph captured on the main thread from before its deadline, when the lane's worker
  queries its event, to after it; the capture does not fail, the lane stays whole
  (review G-8).
- T6c: a CUDA graph captured on the main thread while the source's lane worker makes a
  frame (the two meet by events, so the frame is made during the capture): of a CUDA
  batch (the worker records its ``ready`` event), and of a CPU batch of a new size
  (pinned staging allocated).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import gc
import inspect
import itertools
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a plain copy: nothing installed

import numpy as np
import torch
import torch.distributed as dist

import tensorcast as tc

# tensorcast's internals: the one place this script names them (the public API has no
# way to pair a sender with a receiver in one process, or to reach a group's lane).
from tensorcast.codec.dtypes import TORCH_CODES
from tensorcast.transport import groups as _groups
from tensorcast.transport.device import CudaStreams, DevicePart, Inflight
from tensorcast.transport.groups import Group
from tensorcast.transport.lane import Job, Lane
from tensorcast.transport.pool import BufferPool
from tensorcast.transport.receiver import Receiver
from tensorcast.transport.sender import Sender
from tensorcast.transport.staging import Staging
from tensorcast.transport.testing import FakeWire
from tensorcast.transport.wire import make_wire

_STARTED = time.monotonic()  # the first part's clock starts with this process
ROOT = Path(__file__).resolve().parents[2]
SKIPPED = 77
#: each part's hard limit, its processes' start-up and its verdicts included (the same
#: figures as ``device_run.sh``'s plan; ``tests/gpu/test_device_run_plan.py`` checks it)
PART_TIMEOUT_S = {"A": 65, "B": 140, "C": 170}
#: what a part's driver keeps of its limit for itself: importing torch, killing, verdicts
DRIVER_MARGIN_S = 15
#: what each part runs, for the plan
PART_SETUP = {
    "A": "one process, no process group",
    "B": "two gloo ranks sharing the GPU",
    "C": "an NCCL group of one",
}
CHECKS: dict[str, dict[str, str]] = {
    "A": {
        "R1": "pack / unpack a CUDA tree of every dtype",
        "R2": "unpacked CUDA leaves view the buffer",
        "R3": "a CPU tree packed onto the GPU",
        "R4": "unpack onto the GPU",
        "R5": "numpy leaves of a GPU buffer come back on the CPU",
        "R6": "Packed.pin_memory",
        "T1": "a dropped CUDA tree read late on a side stream is not overwritten",
        "T2": "host syncs of pack / unpack",
        "T3": "pinned staging reuse is bounded",
        "T18a": "trim=True onto the GPU: a CPU batch trimmed, a CUDA one whole, no sync",
    },
    "B": {
        "R7": "gloo ranks sharing the GPU: CUDA batches of every dtype",
        "T4": "a consumer on a side stream sees each step's batch, the default stream busy",
        "T5": "whole passes under sync-debug 'error'; syncs with verify reported",
        "T5b": "ndarray / str / bytes leaves, gloo with device='cuda': no host sync (N-3)",
        "T7": "the lane's worker makes no CUDA stream call on a receiver",
        "T15": "after a refused batch, the group's next payloads in the same order (N-1)",
        "T18b": "a trimmed audio batch over gloo to the GPU: bit for bit, no sync",
        "T6": "CUDA graph capture between next() calls while prefetching",
        "T6b": "capture while pinned staging misses its pool on every batch",
    },
    "C": {
        "R8": "NCCL group of one: trees, a copy of the input, a pre-packed batch",
        "T8": "a broadcast is independent of the default stream and returns at once",
        "T9": "the source's own tree is not overwritten under a side-stream read",
        "T10": "a CPU Packed broadcasts to CUDA leaves",
        "T11": "host syncs per broadcast (none for a 2-D CUDA leaf); verify=True refuses CUDA",
        "T23": "a trimmed ndarray, and device='cpu', on NCCL: host outputs not handed over",
        "T16": "memory back to its baseline after del of a broadcast tree (N-2)",
        "T13a": "no thread left after destroy_process_group",
        "T13b": "no 'destroyed without shutdown' warning",
        "T13c": "the process exits within 30 s of its last check",
        "T14": "lane.break_ returns, the next broadcast raises PeerError",
        "T19": "a CUDA input outlives its queued transfer when the deadline breaks (N-7)",
        "T20": "TORCH_NCCL_BLOCKING_WAIT=1: no host wait, or a warning (N-5)",
        "T21": "two groups' payloads on one GPU do not wait on each other (N-4)",
        "T22": "a deadline break whose abort blocks still fails the queued job (N-6)",
        "T12": "sender / receiver on real lanes over CUDA-stream payloads",
        "T12s": "no host sync on the NCCL-style receiver's threads",
        "T12p": "T12 with a trimmed (B, T) leaf saying its step: re-pad order, hand-over",
        "T24": "capture across a one-off broadcast's deadline (the worker's event query)",
        "T6c": "capture while the source's worker makes a frame (ready event, staging)",
    },
}
#: the checks judged from outside part C's process (its output and its exit)
DRIVER_CHECKS = ("T13b", "T13c")
TIMEOUT_S = 20.0  # a channel's wait for one message, in the checks
TD = datetime.timedelta(seconds=TIMEOUT_S)
_BENIGN_CUDA_CALLS = (  # runtime calls that neither touch a stream nor memory
    "cudaGetDevice",
    "cudaSetDevice",
    "cudaGetLastError",
    "cudaPeekAtLastError",
    "cudaDeviceGetAttribute",
    "cudaGetDeviceProperties",
    "cudaGetDeviceCount",
    "cudaDriverGetVersion",
    "cudaRuntimeGetVersion",
    "cudaStreamIsCapturing",
    "cudaStreamGetCaptureInfo",
    "cudaThreadExchangeStreamCaptureMode",
    "cuCtxGetCurrent",
    "cuDevicePrimaryCtxGetState",
)


# -- tensorcast's roles -------------------------------------------------------------------
# A sender and a receiver paired in one process (source: group rank 0, global rank 0;
# receiver: global rank 1); the roles number their frames themselves.


def submit(lane: Lane, fn: Callable[[], Any]) -> Any:
    """Queue ``fn`` on ``lane``'s worker, behind every job queued before it."""
    job: Any = Job(fn)
    lane.enqueue(job)
    return job


# -- recording ------------------------------------------------------------------------


class Failed(AssertionError):
    """A check's assertion, with what it measured."""

    def __init__(self, message: str, report: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.report = report or {}


class Skipped(Exception):
    """A check that cannot judge here (a missing feature, a trace it cannot read), with
    what it saw."""

    def __init__(self, message: str, report: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.report = report or {}


def expect(ok: bool, message: str, report: dict[str, Any] | None = None) -> None:
    if not ok:
        raise Failed(message, report)


class Recorder:
    """Writes each check's outcome as one JSON line the moment it is known."""

    def __init__(self, path: str, part: str, rank: int | None) -> None:
        self.path = path
        self.part = part
        self.rank = rank

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())  # a part killed right after still has it

    def run(self, cid: str, fn: Callable[[], Any]) -> bool:
        started = time.perf_counter()
        report: Any = {}
        try:
            report = fn()
            status, detail = "PASS", ""
        except Failed as e:
            status, detail, report = "FAIL", str(e), e.report
        except Skipped as e:
            status, detail, report = "SKIP", str(e), e.report
        except Exception:
            status, detail = "FAIL", traceback.format_exc()
        self.write(
            {
                "id": cid,
                "rank": self.rank,
                "status": status,
                "detail": detail,
                "report": report if isinstance(report, dict) else {},
                "seconds": round(time.perf_counter() - started, 3),
            }
        )
        who = "" if self.rank is None else f" rank {self.rank}"
        print(f"[part {self.part}{who}] {status} {cid} {detail[:200]}".rstrip(), flush=True)
        return status != "FAIL"


# -- streams, events and syncs ---------------------------------------------------------


class Sleeper:
    """``torch.cuda._sleep`` in milliseconds, calibrated on this device (cycles per ms)."""

    def __init__(self, cycles_per_ms: float | None = None) -> None:
        self.cycles_per_ms = cycles_per_ms or self.calibrate()

    @staticmethod
    def calibrate() -> float:
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        cycles = 20_000_000
        times = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return cycles / statistics.median(times)

    @classmethod
    def shared(cls, path: Path, rank: int, timeout_s: float = 60.0) -> Sleeper:
        """Calibrated by rank 0 alone and read from ``path`` by the others: two processes
        that calibrate at once on one GPU share its time and both mis-scale."""
        if rank == 0:
            sleeper = cls()
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(repr(sleeper.cycles_per_ms), encoding="utf-8")
            tmp.replace(path)  # whole or not at all
            return sleeper
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                print(f"rank {rank}: no calibration from rank 0; calibrating here", flush=True)
                return cls()
            time.sleep(0.05)
        return cls(float(path.read_text(encoding="utf-8")))

    def sleep(self, ms: float) -> None:
        """Queue ``ms`` of spinning on the current stream."""
        torch.cuda._sleep(int(ms * self.cycles_per_ms))


def poll(event: Any, limit_s: float) -> float | None:
    """Seconds from now until ``event`` is done (asking, never blocking), None past the limit."""
    start = time.perf_counter()
    while not event.query():
        if time.perf_counter() - start > limit_s:
            return None
        time.sleep(0.0002)
    return time.perf_counter() - start


def record_event(stream: Any = None) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


class SyncCount:
    """The host-device syncs torch reports under ``set_sync_debug_mode("warn")``, from any
    thread of this process: how many, the Python lines that made them, and the threads
    (a warning is shown on the thread whose call synced)."""

    def __init__(self) -> None:
        self.count = 0
        self.sites: dict[str, int] = {}
        self.threads: dict[str, int] = {}
        self._log: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def __enter__(self) -> SyncCount:
        torch.cuda.synchronize()
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")

        def show(message: Any, category: Any, filename: str, lineno: int, *_: Any) -> None:
            if "synchroniz" in str(message):
                site = f"{Path(filename).name}:{lineno}"
                with self._lock:
                    self._log.append((site, threading.current_thread().name, str(message)))

        warnings.showwarning = show  # type: ignore[assignment]  # restored by catch_warnings
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def now(self, threads: tuple[str, ...] | None = None) -> int:
        """The syncs so far, of ``threads`` (names; prefixes) or of every thread."""
        with self._lock:
            return sum(1 for _, t, _ in self._log if threads is None or t.startswith(threads))

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(None, None, None)
        self.count = len(self._log)
        self.sites = dict(collections.Counter(site for site, _, _ in self._log))
        self.threads = dict(collections.Counter(t for _, t, _ in self._log))


def cuda_calls_by_thread(trace_path: str) -> dict[int, dict[str, int]]:
    """The CUDA runtime and driver calls of a ``torch.profiler`` chrome trace, by thread
    (the system thread id, as ``threading.get_native_id`` gives it, where the trace uses it)."""
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f).get("traceEvents", [])
    calls: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X":
            with contextlib.suppress(TypeError, ValueError):
                calls[int(e["tid"])][str(e.get("name"))] += 1
    return {tid: dict(c) for tid, c in calls.items()}


def stream_calls(calls: dict[str, int]) -> dict[str, int]:
    return {n: k for n, k in calls.items() if not n.startswith(_BENIGN_CUDA_CALLS)}


def accepts(fn: Any, keyword: str) -> bool:
    """Whether ``fn`` takes the keyword argument ``keyword`` (a feature not yet there is a
    SKIP, the same on every rank, decided before anything is sent)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


# -- trees --------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)  # a bool copy would turn bytes other than 0 / 1 into 1
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t.to(torch.uint8)


def _diff(a: object, b: object, where: str = "batch") -> str | None:
    """Where ``a`` and ``b`` first differ (types, dtypes, shapes, bytes), or None."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return f"{where}: tensor vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if not torch.equal(_bits(a), _bits(b)):
            return f"{where}: bytes differ: {_bits(a)[:16].tolist()} vs {_bits(b)[:16].tolist()}"
        return None
    if isinstance(a, np.ndarray):
        same = isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
        return None if same else f"{where}: arrays differ"
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return f"{where}: keys differ"
        return next((d for k in a if (d := _diff(a[k], b[k], f"{where}[{k!r}]"))), None)
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):  # type: ignore[arg-type]
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        pairs = enumerate(zip(a, b))  # type: ignore[call-overload]
        return next((d for i, (x, y) in pairs if (d := _diff(x, y, f"{where}[{i}]"))), None)
    return None if a == b and type(a) is type(b) else f"{where}: {a!r} vs {b!r}"


def same(a: object, b: object, what: str = "batch") -> None:
    diff = _diff(a, b, what)
    expect(diff is None, str(diff))


def tensors(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors(v)]
    return []


def every_dtype(device: str, step: int = 0) -> dict[str, object]:
    """A batch with a leaf of every dtype tensorcast carries, small leaves and a str list."""
    g = torch.Generator().manual_seed(step)
    raw = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    leaves = {
        code: raw[: 64 * 16].view(dtype)[:8].to(device) for code, dtype in TORCH_CODES.items()
    }
    return {
        "audio": torch.randn(4, 16000, generator=g).to(device),
        "lens": torch.arange(4, device=device),
        "dtypes": leaves,
        "ids": [f"utt-{step}-{i}" for i in range(4)],
        "step": step,
    }


STEP_BYTES = 16 << 20


def step_batch(step: int, device: str = "cpu") -> dict[str, Any]:
    """A batch whose every byte says its step."""
    return {
        "x": torch.full((STEP_BYTES,), step % 256, dtype=torch.uint8, device=device),
        "step": step,
    }


def wrong_steps(snaps: list[tuple[int, torch.Tensor]]) -> list[tuple[int, list[int]]]:
    """The snapshots (taken on the device, read now) that do not hold their step."""
    return [
        (step, sorted(set(snap.cpu().tolist()))[:4])
        for step, snap in snaps
        if not bool((snap == step % 256).all())
    ]


class Source:
    """A sized source of ``make(step)`` batches; it can sleep per batch and records the
    thread, CUDA device and stream it is iterated on (a loader's lane worker)."""

    def __init__(self, n: int, make: Callable[[int], Any], sleep_s: float = 0.0) -> None:
        self.n = n
        self.make = make
        self.sleep_s = sleep_s
        self.seen: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[Any]:
        for step in range(self.n):
            if self.sleep_s:
                time.sleep(self.sleep_s)
            if torch.cuda.is_initialized():
                self.seen.append(
                    {
                        "thread": threading.current_thread().name,
                        "device": torch.cuda.current_device(),
                        "default_stream": torch.cuda.current_stream()
                        == torch.cuda.default_stream(),
                    }
                )
            yield self.make(step)


#: six payload sizes none of which fits another's pooled buffer (a pool reuses a buffer
#: of up to twice the size asked): cycled, they miss a pool of four every time
SIZE_CLASSES = [int(mib * (1 << 20)) for mib in (1, 2.5, 6, 13, 27, 56)]


def padded_audio(device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """A padded (B, T) float32 audio batch, as a collate makes it: rows of random
    lengths, +0.0 after; with the bit patterns a lossy trim would change (a -0.0 and a
    NaN inside a row, a row whose last sample is -0.0), a full row and an empty one."""
    g = torch.Generator().manual_seed(seed)
    rows, length = 8, 16000
    lens = torch.randint(length // 8, length, (rows,), generator=g)
    lens[0], lens[1] = length, 0
    audio = torch.randn(rows, length, generator=g)
    audio = torch.where(torch.arange(length) < lens[:, None], audio, torch.zeros(()))
    audio[2, 5], audio[2, 6] = -0.0, float("nan")
    audio[3, int(lens[3]) - 1] = -0.0
    ids = [f"utt-{seed}-{i}" for i in range(rows)]
    return {"audio": audio.to(device), "lens": lens.to(device), "ids": ids}


def trimmed_leaves(packed: Any) -> list[str]:
    """The paths of a packed batch's leaves its header says are trimmed (where the
    header says so at all: ``LeafSpec.trimmed``)."""
    schema = tc.read_header(packed.header)
    return [leaf.path for leaf in schema.leaves if getattr(leaf, "trimmed", None)]


def padded_step(step: int) -> dict[str, Any]:
    """A padded (B, T) float32 batch whose samples say its step: each row holds ``step``
    up to a length that depends on the step too, and +0.0 after, so it travels trimmed
    and is re-padded on the receiving side."""
    rows, length = 8, 1 << 16
    audio = torch.zeros(rows, length)
    for row in range(rows):
        audio[row, : length * (row + 1) // (rows + 1) + 131 * (step % 7)] = float(step)
    return {"audio": audio, "step": step}


def wrong_padded(snaps: list[tuple[int, torch.Tensor]]) -> list[tuple[int, str]]:
    """The snapshots of ``padded_step`` leaves (taken on the device, read now) that are
    not their step's leaf, prefixes and padding."""
    wrong = []
    for step, snap in snaps:
        want = padded_step(step)["audio"]
        got = snap.cpu()
        if not torch.equal(got, want):
            rows = sorted({int(r) for r in (got != want).nonzero()[:, 0].tolist()})
            wrong.append(
                (step, f"rows {rows[:4]}, values {sorted(set(got.unique().tolist()))[:4]}")
            )
    return wrong


def capture_kwargs() -> dict[str, Any]:
    """``torch.cuda.graph``'s capture mode, named: ``"global"``, torch's default, under
    which another thread's potentially unsafe CUDA call during the capture is an error."""
    with contextlib.suppress(TypeError, ValueError):
        if "capture_error_mode" in inspect.signature(torch.cuda.graph.__init__).parameters:
            return {"capture_error_mode": "global"}
    return {}


def warm_for_capture(static: torch.Tensor) -> None:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch's docs ask
        for _ in range(3):
            static * 2
    torch.cuda.current_stream().wait_stream(side)


def host_allocs() -> int | None:
    """How many pinned host allocations torch's host allocator made (where it says)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    with contextlib.suppress(Exception):
        value = stats().get("num_host_alloc")
        return None if value is None else int(value)
    return None


# -- part A: one process ----------------------------------------------------------------


def part_a(rec: Recorder) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    sleeper = Sleeper()
    cuda_tree, cpu_tree = every_dtype("cuda"), every_dtype("cpu")

    rec.run("R1", lambda: same(cuda_tree, tc.unpack(tc.pack(cuda_tree))))

    def r2() -> dict[str, Any]:
        p = tc.pack(cuda_tree)
        start = p.buffer.data_ptr()
        leaves = tensors(tc.unpack(p))
        inside = [start <= t.data_ptr() < start + p.nbytes for t in leaves if t.numel()]
        expect(all(inside), f"{inside.count(False)} of {len(inside)} leaves outside the buffer")
        expect(all(t.is_cuda for t in leaves), "a leaf is not on the GPU")
        return {"leaves": len(leaves)}

    rec.run("R2", r2)

    def r3() -> None:
        p = tc.pack(cpu_tree, device="cuda")
        expect(p.buffer.is_cuda, f"the buffer is on {p.buffer.device}")
        same(cpu_tree, tc.unpack(p, device="cpu"))

    rec.run("R3", r3)

    def r4() -> None:
        out = tc.unpack(tc.pack(cpu_tree), device="cuda")
        expect(all(t.is_cuda for t in tensors(out)), "a leaf is not on the GPU")
        same(cpu_tree, out)

    rec.run("R4", r4)

    def r5() -> None:
        out = tc.unpack(tc.pack({"a": np.arange(5)}, device="cuda"))["a"]
        expect(isinstance(out, np.ndarray), f"got {type(out).__name__}")
        expect(out.tolist() == list(range(5)), f"got {out!r}")

    rec.run("R5", r5)
    rec.run("R6", lambda: expect(tc.pack(cpu_tree).pin_memory().buffer.is_pinned(), "not pinned"))
    rec.run("T1", lambda: t1_dropped_tree_not_overwritten(dev, sleeper))
    rec.run("T2", lambda: t2_codec_syncs(cpu_tree))
    rec.run("T3", lambda: t3_pinned_staging(dev))
    rec.run("T18a", t18a_trimmed_on_the_gpu)


def t1_dropped_tree_not_overwritten(dev: torch.device, sleeper: Sleeper) -> dict[str, Any]:
    """The gloo path with ``device="cuda"`` (the source's own tree and a receiver's, each
    uploaded from pinned staging), on a real Sender and Receiver over the in-memory wire."""
    n = 32 << 20
    wires = FakeWire.pair()
    lanes = [Lane(f"check-a{w.rank}", w.abort) for w in wires]
    # (FakeWire's streams are the host fake's type; these ends have none)
    groups = [Group((0, 1), w, lane) for w, lane in zip(wires, lanes)]  # type: ignore[arg-type]
    sender = Sender(groups[0], 0, timeout=TD)
    receiver = Receiver(groups[1], 0, rank=1, timeout=TD)
    report: dict[str, Any] = {}

    def frame(step: int) -> dict[str, DevicePart]:
        # the in-memory source posts at once; the receiver reads after
        own = sender.send_batch({"x": torch.full((n,), step, dtype=torch.uint8)}, dev, TD)
        part = receiver.recv(dev, TD)
        for side, p in (("own", own), ("received", part)):
            expect(isinstance(p, DevicePart), f"{side}: not a device part but {type(p).__name__}")
        return {"own": own, "received": part}

    s1, s2, s3 = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()

    def late_read(trees: dict[str, Any], stream: Any) -> dict[str, torch.Tensor]:
        with torch.cuda.stream(stream):
            sleeper.sleep(200)
            return {side: t["x"][-(1 << 20) :].clone() for side, t in trees.items()}

    def wrong(late: dict[str, torch.Tensor], value: int) -> dict[str, list[int]]:
        return {
            s: sorted(set(t.cpu().tolist()))
            for s, t in late.items()
            if not bool((t == value).all())
        }

    # (a) taken on s1 (the library records s1), read on s1 after 200 ms, dropped; the next
    # frame is taken on s2, whose transfer does not wait on s1.
    first = frame(0)
    with torch.cuda.stream(s1):
        trees = {side: p.take() for side, p in first.items()}
    ptrs = {side: t["x"].data_ptr() for side, t in trees.items()}
    late = late_read(trees, s1)
    del trees, first  # nothing holds the trees now but the lanes' in-flight work
    time.sleep(0.05)  # the uploads are done: the next post lets go of them
    second = frame(1)
    with torch.cuda.stream(s2):
        trees = {side: p.take() for side, p in second.items()}
    held = [len(lane.inflight) for lane in lanes]
    report["a_reused_address"] = {s: trees[s]["x"].data_ptr() == ptrs[s] for s in trees}
    report["a_inflight_after_next_post"] = held
    torch.cuda.synchronize()
    expect(
        held == [1, 1], f"the first frame's work was not let go ({held}): nothing tested", report
    )
    bad = wrong(late, 0)
    expect(not bad, f"a dropped tree read late on s1 held the next frame's bytes: {bad}", report)
    expect(all(bool((t["x"] == 1).all()) for t in trees.values()), "frame 1 is wrong", report)
    del trees, second
    # (b) taken on the default stream, read on s3 with an explicit record_stream (torch's
    # contract for a tensor used on another stream), dropped; the next frame on the default.
    third = frame(2)
    trees = {side: p.take() for side, p in third.items()}
    s3.wait_stream(torch.cuda.current_stream())
    for t in trees.values():
        t["x"].record_stream(s3)
    late = late_read(trees, s3)
    del trees, third
    time.sleep(0.05)
    fourth = frame(3)
    trees = {side: p.take() for side, p in fourth.items()}
    held = [len(lane.inflight) for lane in lanes]
    report["b_inflight_after_next_post"] = held
    torch.cuda.synchronize()
    expect(
        held == [1, 1], f"the third frame's work was not let go ({held}): nothing tested", report
    )
    bad = wrong(late, 2)
    expect(not bad, f"with record_stream(s3), the dropped tree held new bytes: {bad}", report)
    expect(all(bool((t["x"] == 3).all()) for t in trees.values()), "frame 3 is wrong", report)
    return report


def t2_codec_syncs(cpu_tree: dict[str, object]) -> dict[str, Any]:
    tensor_only = {"a": torch.randn(1000, device="cuda"), "b": torch.arange(7, device="cuda")}
    with_array = {**tensor_only, "feats": np.arange(12, dtype=np.float32)}
    with_str = {**tensor_only, "text": "x" * 4096}
    cpu_tensors = {
        "a": torch.randn(1000),
        "b": torch.arange(7),
        "m": torch.ones(3, dtype=torch.bool),
    }
    cases = {
        "tensor-only CUDA": lambda: tc.unpack(tc.pack(tensor_only)),
        "CUDA + one ndarray": lambda: tc.unpack(tc.pack(with_array)),
        "CUDA + one 4 KiB str": lambda: tc.unpack(tc.pack(with_str)),
        "CPU tensors packed onto the GPU": lambda: tc.unpack(tc.pack(cpu_tensors, device="cuda")),
    }
    report: dict[str, Any] = {}
    outs: dict[str, Any] = {}
    for name, fn in cases.items():
        fn()  # warm up (first-call allocations, the pinned cache)
        with SyncCount() as syncs:
            outs[name] = fn()
        report[name] = {"syncs": syncs.count, "sites": syncs.sites}
    same(tensor_only, outs["tensor-only CUDA"])
    same(with_array, outs["CUDA + one ndarray"])
    same(with_str, outs["CUDA + one 4 KiB str"])
    same(cpu_tensors, outs["CPU tensors packed onto the GPU"])
    for name in ("tensor-only CUDA", "CPU tensors packed onto the GPU"):
        expect(report[name]["syncs"] == 0, f"{name}: {report[name]} host syncs", report)
    return report


def t3_pinned_staging(dev: torch.device) -> dict[str, Any]:
    """The receiver's upload path with ``device="cuda"``: staging from a pool over
    ``CudaStreams.host``, held by the in-flight work until its upload is seen done."""
    streams = CudaStreams(dev)
    inflight = Inflight()
    mib = 1 << 20
    stats = getattr(torch.cuda, "host_memory_stats", None)

    def staged_pool() -> tuple[BufferPool, list[int]]:
        allocations: list[int] = []

        def allocate(nbytes: int) -> torch.Tensor:
            allocations.append(nbytes)
            return streams.host(nbytes)

        return BufferPool(max_buffers=4, allocate=allocate), allocations

    def frames(
        pool: BufferPool, sizes: list[int], *, step_syncs: bool, after: Callable[[int], None]
    ) -> None:
        for i, n in enumerate(sizes):
            staging = pool.take(n, torch.device("cpu"))
            staging[:8].fill_(i % 256)

            def upload(buffer: torch.Tensor, staging: torch.Tensor = staging) -> None:
                buffer.copy_(staging, non_blocking=True)

            part = DevicePart(
                streams,
                n,
                lambda buffer: (buffer, []),
                fill=upload,
                holds=staging,
                inflight=inflight,
                timeout_s=60.0,
                on_error=lambda e: None,
            )
            out = part.take()  # staging held by `inflight` until its upload is seen done
            if step_syncs:  # a training step that reads a value (a loss) waits for it
                expect(int(out[0]) == i % 256, f"frame {i}: {int(out[0])}")
            del out, part, staging
            after(i)

    def host_bytes() -> Any:
        return stats().get("allocated_bytes.current") if stats is not None else None

    report: dict[str, Any] = {}
    steady, steady_allocs = staged_pool()
    frames(steady, [48 * mib] * 50, step_syncs=True, after=lambda i: None)
    report["steady_48MiB_allocations"] = len(steady_allocs)
    # The host running ahead of the device (no step waits for a value): each post finds
    # the uploads before it still in flight, so their staging cannot come back yet.
    ahead, ahead_allocs = staged_pool()
    frames(ahead, [48 * mib] * 50, step_syncs=False, after=lambda i: None)
    torch.cuda.synchronize()
    report["steady_48MiB_allocations_host_ahead"] = len(ahead_allocs)
    del steady, ahead
    inflight.reap()
    gc.collect()
    with contextlib.suppress(AttributeError, RuntimeError):
        torch._C._host_emptyCache()  # cached pinned blocks of the phases before
    rng = np.random.default_rng(0)
    sizes = [int(x) for x in rng.integers(mib, 64 * mib, size=50)]
    can_reset = stats is not None and hasattr(torch.cuda, "reset_peak_host_memory_stats")
    if can_reset:
        torch.cuda.reset_peak_host_memory_stats()
    before = host_bytes()
    varied, varied_allocs = staged_pool()
    marks: dict[int, Any] = {}

    def note(i: int) -> None:
        if i + 1 in (10, 25, 50):
            marks[i + 1] = {
                "pool_allocations": len(varied_allocs),
                "host_allocated_bytes": host_bytes(),
                "num_host_alloc": stats().get("num_host_alloc") if stats is not None else None,
            }

    frames(varied, sizes, step_syncs=True, after=note)
    report["varied"] = marks
    report["varied_largest_MiB"] = round(max(sizes) / mib, 1)
    expect(len(steady_allocs) <= 3, f"a steady size allocated {len(steady_allocs)} buffers", report)
    if not can_reset:
        # Without a reset, the peak includes the host-ahead phase (up to 50 x 48 MiB in
        # flight): a bound on it would fail for reasons outside this phase.
        report["bound"] = "not checked: this torch cannot reset the host memory peak"
    elif stats is not None and before is not None:
        grew = stats().get("allocated_bytes.peak", 0) - before
        report["host_allocated_bytes_growth_peak"] = grew
        # The pool keeps 4 idle buffers and two more are in flight: at most 6 alive, each
        # in one power-of-two class from 1 to 64 MiB (the host allocator rounds to those).
        bound = 6 * sum(1 << k for k in range(20, 27))
        report["bound_bytes"] = bound
        expect(grew <= bound, f"pinned memory grew by {grew} bytes (bound {bound})", report)
    return report


def t18a_trimmed_on_the_gpu() -> dict[str, Any]:
    """``trim=True`` packed onto the GPU. From a CPU source: smaller than ``trim=False``,
    unpacked bit for bit with no host sync. From a CUDA source (a 2-D CUDA leaf): packed
    with no host sync at all, so whole (deciding its trim would read it back), and
    unpacked bit for bit with no host sync."""
    if not accepts(tc.pack, "trim"):
        raise Skipped("tc.pack has no trim= keyword yet: nothing to check")
    report: dict[str, Any] = {}
    for source in ("cpu", "cuda"):
        batch = padded_audio(source)
        tc.pack(batch, device="cuda", trim=True)  # warm: first-call allocations
        with SyncCount() as packing:
            trimmed = tc.pack(batch, device="cuda", trim=True)
        plain = tc.pack(batch, device="cuda", trim=False)
        tc.unpack(trimmed)
        with SyncCount() as unpacking:
            out = tc.unpack(trimmed)
        report[f"{source} source"] = {
            "nbytes": {"untrimmed": plain.nbytes, "trim=True": trimmed.nbytes},
            "trimmed_leaves": trimmed_leaves(trimmed),
            "pack_syncs": packing.count,
            "pack_sync_sites": packing.sites,
            "unpack_syncs": unpacking.count,
            "unpack_sync_sites": unpacking.sites,
        }
        expect(
            out["audio"].is_cuda, f"{source}: the audio leaf is on {out['audio'].device}", report
        )
        same(batch, out, f"{source} source, trim=True")
        if source == "cpu":
            expect(
                trimmed.nbytes < plain.nbytes,
                f"cpu: trim=True {trimmed.nbytes} bytes, trim=False {plain.nbytes}: not trimmed",
                report,
            )
        else:
            expect(packing.count == 0, f"cuda: {packing.count} syncs to pack", report)
            expect(not trimmed_leaves(trimmed), "cuda: a CUDA leaf was trimmed", report)
        expect(unpacking.count == 0, f"{source}: {unpacking.count} syncs to unpack", report)
    return report


# -- part B: two gloo ranks sharing the GPU ---------------------------------------------


def part_b(rec: Recorder, rank: int, store_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.cuda.set_device(0)
    sleeper = Sleeper.shared(Path(store_dir) / "sleeper-cycles-per-ms", rank)
    numbers = itertools.count()

    def in_world(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            # A group of its own per check: a failure on one rank (the other then fails at
            # its timeout) cannot leave the next check a broken lane.
            path = os.path.join(store_dir, f"store-{next(numbers)}")
            dist.init_process_group(
                "gloo",
                store=dist.FileStore(path, 2),
                rank=rank,
                world_size=2,
                timeout=datetime.timedelta(seconds=60),
            )
            try:
                return fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                if dist.is_initialized():
                    dist.destroy_process_group()

        return run

    rec.run("R7", in_world(lambda: r7_gloo_cuda_batches(rank)))
    rec.run("T4", in_world(lambda: t4_side_stream_consumer(rank, sleeper)))
    rec.run("T5", in_world(lambda: t5_sync_free_passes(rank)))
    rec.run("T5b", in_world(lambda: t5b_host_leaves_without_syncs(rank)))
    rec.run("T7", in_world(lambda: t7_worker_cuda_calls(rank, store_dir)))
    rec.run("T15", in_world(lambda: t15_order_after_a_refusal(rank)))
    rec.run("T18b", in_world(lambda: t18b_trimmed_over_gloo(rank)))
    # Last: a capture that fails may leave this process unable to go on.
    rec.run("T6", in_world(lambda: t6_graph_capture(rank, steady=True)))
    rec.run("T6b", in_world(lambda: t6_graph_capture(rank, steady=False)))


def _lane() -> Lane:
    """The lane of tensorcast's group over every rank (made by then)."""
    return _groups.world().group(tuple(range(dist.get_world_size()))).lane


def r7_gloo_cuda_batches(rank: int) -> dict[str, Any]:
    for step in range(3):
        out = tc.broadcast(
            every_dtype("cuda", step) if rank == 0 else None, 0, device="cuda", timeout=TIMEOUT_S
        )
        expect(all(t.is_cuda for t in tensors(out)), f"step {step}: a leaf is not on the GPU")
        same(every_dtype("cuda", step), out, f"broadcast step {step}")
    loader = tc.BroadcastingDataLoader(
        Source(4, lambda s: every_dtype("cuda", s)) if rank == 0 else None,
        group=dist.group.WORLD,
        src=0,
        prefetch=1,
        device="cuda",
        timeout=TIMEOUT_S,
    )
    got = list(loader)
    expect(len(got) == 4, f"{len(got)} batches")
    for s, b in enumerate(got):
        same(every_dtype("cuda", s), b, f"loader step {s}")
    return {}


def t4_side_stream_consumer(rank: int, sleeper: Sleeper) -> dict[str, Any]:
    s = torch.cuda.Stream()
    default = torch.cuda.default_stream()
    report: dict[str, Any] = {}
    failures: dict[str, Any] = {}

    def busy_default() -> None:
        with torch.cuda.stream(default):
            sleeper.sleep(300)

    # (i) tc.broadcast, the lane idle: its job runs on this thread
    snaps: list[tuple[int, torch.Tensor]] = []
    inline = 0
    for step in range(9):
        if step >= 3:
            busy_default()
        with torch.cuda.stream(s):
            if step:
                inline += _lane().idle()
            out = tc.broadcast(
                step_batch(step) if rank == 0 else None, 0, device="cuda", timeout=TIMEOUT_S
            )
            snaps.append((step, out["x"][:4096].clone()))
        del out
    torch.cuda.synchronize()
    report["broadcast"] = {"ran_inline": inline, "of": 8}
    if bad := wrong_steps(snaps[3:]):
        failures["broadcast"] = bad

    # (ii, iii) the loader at prefetch 1 and 2: host work on the lane's worker
    for prefetch in (1, 2):
        loader = tc.BroadcastingDataLoader(
            Source(9, step_batch) if rank == 0 else None,
            group=dist.group.WORLD,
            src=0,
            prefetch=prefetch,
            device="cuda",
            timeout=TIMEOUT_S,
        )
        snaps = []
        it = iter(loader)
        with torch.cuda.stream(s):
            for step in range(9):
                if step >= 3:
                    busy_default()
                batch = next(it)
                snaps.append((step, batch["x"][:4096].clone()))
                expect(
                    batch["step"] == step, f"prefetch {prefetch}: step {batch['step']} at {step}"
                )
                del batch
            expect(next(it, None) is None, "the pass did not end with the source")
        torch.cuda.synchronize()
        if bad := wrong_steps(snaps[3:]):
            failures[f"loader prefetch={prefetch}"] = bad

    # (iv) tc.broadcast while a loader step is on the lane: its job runs on the worker
    loader = tc.BroadcastingDataLoader(
        Source(9, step_batch, sleep_s=0.1) if rank == 0 else None,
        group=dist.group.WORLD,
        src=0,
        prefetch=1,
        device="cuda",
        timeout=TIMEOUT_S,
    )
    snaps = []
    on_worker = 0
    it = iter(loader)
    with torch.cuda.stream(s):
        for step in range(9):
            if step >= 3:
                busy_default()
            batch = next(it)
            snaps.append((step, batch["x"][:4096].clone()))
            del batch
            if step >= 3:
                busy_default()
            on_worker += not _lane().idle()
            value = 100 + step
            out = tc.broadcast(
                step_batch(value) if rank == 0 else None, 0, device="cuda", timeout=TIMEOUT_S
            )
            snaps.append((value, out["x"][:4096].clone()))
            del out
        expect(next(it, None) is None, "the pass did not end with the source")
    torch.cuda.synchronize()
    report["broadcast_with_a_loader_step_queued"] = {"on_worker": on_worker, "of": 9}
    if bad := wrong_steps(snaps[6:]):
        failures["broadcast with a loader step queued"] = bad
    expect(
        on_worker > 0, "no broadcast ran behind a loader step: variant (iv) tested nothing", report
    )
    expect(not failures, f"stale or foreign bytes on the consumer's stream: {failures}", report)
    return report


def t5_sync_free_passes(rank: int) -> dict[str, Any]:
    report: dict[str, Any] = {}

    def loader(prefetch: int, make: Callable[[int], Any], verify: bool = False) -> Any:
        return tc.BroadcastingDataLoader(
            Source(6, make) if rank == 0 else None,
            group=dist.group.WORLD,
            src=0,
            prefetch=prefetch,
            device="cuda",
            timeout=TIMEOUT_S,
            verify=verify,
        )

    def small(step: int) -> dict[str, Any]:
        return {"x": torch.full((1 << 20,), step, dtype=torch.uint8), "n": torch.arange(5)}

    for prefetch in (0, 1, 2):
        passes = loader(prefetch, small)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            snaps = [(i, b["x"][:4096].clone()) for i, b in enumerate(passes)]
        except RuntimeError as e:
            raise Failed(f"prefetch {prefetch}: a sync under 'error': {e}", report) from e
        finally:
            torch.cuda.set_sync_debug_mode("default")
        expect(len(snaps) == 6, f"prefetch {prefetch}: {len(snaps)} batches")
        bad = wrong_steps(snaps)
        expect(not bad, f"prefetch {prefetch}: wrong batches {bad}")
        report[f"prefetch={prefetch}"] = "no sync"
    # verify=True checks each payload's CRC32 on the host: a sync per batch, documented
    with SyncCount() as syncs:
        got = [b["x"][:4096].clone() for b in loader(1, small, verify=True)]
    expect(len(got) == 6, f"verify=True: {len(got)} batches")
    report["verify=True"] = {"syncs_per_batch": syncs.count / 6, "sites": syncs.sites}
    return report


def host_leaves(step: int) -> dict[str, Any]:
    """A batch with a leaf of each kind that is not a tensor and travels in the buffer."""
    return {
        "x": torch.full((1 << 20,), step % 256, dtype=torch.uint8),
        "feats": np.full(1000, step, dtype=np.float32),
        "text": f"{step}:" + "t" * 4096,
        "raw": bytes([step % 256]) * 4096,
    }


def t5b_host_leaves_without_syncs(rank: int) -> dict[str, Any]:
    """A gloo group with ``device="cuda"``: the payload is on the host, so its ndarray, str
    and bytes leaves need no copy back from the GPU (review N-3), on either rank."""
    report: dict[str, Any] = {}
    tc.broadcast(host_leaves(99) if rank == 0 else None, 0, device="cuda", timeout=TIMEOUT_S)
    n = 4
    outs: list[Any] = []
    with SyncCount() as syncs:
        for step in range(n):
            outs.append(
                tc.broadcast(
                    host_leaves(step) if rank == 0 else None, 0, device="cuda", timeout=TIMEOUT_S
                )
            )
    report["tc.broadcast"] = {"syncs_per_batch": syncs.count / n, "sites": syncs.sites}
    total = syncs.count
    for prefetch in (0, 1):
        loader = tc.BroadcastingDataLoader(
            Source(n, host_leaves) if rank == 0 else None,
            group=dist.group.WORLD,
            src=0,
            prefetch=prefetch,
            device="cuda",
            timeout=TIMEOUT_S,
        )
        with SyncCount() as syncs:
            outs += list(loader)
        report[f"loader prefetch={prefetch}"] = {
            "syncs_per_batch": syncs.count / n,
            "sites": syncs.sites,
            "threads": syncs.threads,
        }
        total += syncs.count
    expect(len(outs) == 3 * n, f"{len(outs)} batches of {3 * n}", report)
    for i, out in enumerate(outs):
        same(host_leaves(i % n), out, f"batch {i}")
        expect(out["x"].is_cuda, f"batch {i}: the tensor leaf is on {out['x'].device}", report)
    expect(total == 0, f"{total} host syncs in {3 * n} batches with host leaves", report)
    return report


def t6_graph_capture(rank: int, *, steady: bool) -> dict[str, Any]:
    """A graph captured on the main thread after every ``next()`` while the lanes'
    workers prepare the next batches; ``steady=False``: batch sizes cycle through
    ``SIZE_CLASSES``, so that every batch misses the pinned staging pool on both ranks
    (the source's upload of its own tree, the receiver's upload)."""
    static = torch.zeros(1 << 16, device="cuda")
    warm_for_capture(static)
    kwargs = capture_kwargs()
    report: dict[str, Any] = {
        "capture_error_mode": kwargs.get("capture_error_mode", "torch's default (global)"),
    }

    def make(step: int) -> dict[str, Any]:
        if steady:
            return step_batch(step)
        size = SIZE_CLASSES[step % len(SIZE_CLASSES)]
        return {"x": torch.full((size,), step % 256, dtype=torch.uint8), "step": step}

    pinned: list[int] = []  # the staging buffers allocated: a miss of the pool each
    real_host = CudaStreams.host

    def host(streams: CudaStreams, nbytes: int) -> torch.Tensor:
        pinned.append(nbytes)
        return real_host(streams, nbytes)

    for prefetch in (1, 2):
        loader = tc.BroadcastingDataLoader(
            Source(20, make, sleep_s=0.02) if rank == 0 else None,
            group=dist.group.WORLD,
            src=0,
            prefetch=prefetch,
            device="cuda",
            timeout=TIMEOUT_S,
        )
        errors: list[str] = []
        snaps = []
        allocs_before = host_allocs()
        del pinned[:]
        CudaStreams.host = host  # type: ignore[method-assign]
        try:
            for step, batch in enumerate(loader):
                snaps.append((step, batch["x"][:4096].clone()))
                del batch
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, **kwargs):
                        y = static
                        for _ in range(50):
                            y = y * 1.0001
                    graph.replay()
                except RuntimeError as e:
                    errors.append(f"step {step}: capture: {e}")
        except Exception as e:
            errors.append(f"the pass: {type(e).__name__}: {e}")
        finally:
            CudaStreams.host = real_host  # type: ignore[method-assign]
        torch.cuda.synchronize()
        broken = _lane().broken
        allocs_after = host_allocs()
        report[f"prefetch={prefetch}"] = {
            "steps": len(snaps),
            "errors": errors[:3],
            "broken": repr(broken),
            "pinned_allocations": (
                None if allocs_before is None or allocs_after is None
                else allocs_after - allocs_before
            ),
            "staging_allocated": len(pinned),
        }  # fmt: skip
        expect(not errors, f"prefetch {prefetch}: {errors[:3]}", report)
        expect(broken is None, f"prefetch {prefetch}: the lane broke: {broken!r}", report)
        expect(len(snaps) == 20, f"prefetch {prefetch}: {len(snaps)} steps", report)
        bad = wrong_steps(snaps)
        expect(not bad, f"prefetch {prefetch}: wrong batches {bad}", report)
        if not steady:  # else the capture met no allocation: nothing tested
            expect(
                len(pinned) >= len(snaps) // 2,
                f"prefetch {prefetch}: pinned staging missed {len(pinned)} times in "
                f"{len(snaps)} batches",
                report,
            )
    return report


def t7_worker_cuda_calls(rank: int, store_dir: str) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    source = Source(12, step_batch)
    loader = tc.BroadcastingDataLoader(
        source if rank == 0 else None,
        group=dist.group.WORLD,
        src=0,
        prefetch=1,
        device="cuda",
        timeout=TIMEOUT_S,
    )
    it = iter(loader)
    snaps = [(i, next(it)["x"][:4096].clone()) for i in range(3)]  # the pools warm
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        snaps += [(i, next(it)["x"][:4096].clone()) for i in range(3, 9)]
        torch.cuda.synchronize()
    snaps += [(i, b["x"][:4096].clone()) for i, b in enumerate(it, start=9)]
    torch.cuda.synchronize()
    expect(not wrong_steps(snaps) and len(snaps) == 12, "wrong batches")
    trace = os.path.join(store_dir, f"trace-rank{rank}.json")
    prof.export_chrome_trace(trace)
    calls = cuda_calls_by_thread(trace)
    main = threading.get_native_id()
    names = {t.native_id: t.name for t in threading.enumerate()}
    others = {
        f"{tid} ({names.get(tid, '?')})": stream_calls(c) for tid, c in calls.items() if tid != main
    }
    others = {k: v for k, v in others.items() if v}
    report: dict[str, Any] = {
        "main_thread_calls": calls.get(main, {}),
        "other_threads_stream_calls": others,
    }
    if rank == 0:
        report["source_iterator"] = source.seen[:2]
        expect(bool(source.seen), "the source iterator saw no CUDA state", report)
        expect(
            all(s["thread"].startswith("tensorcast-lane") for s in source.seen),
            "the source iterator did not run on the lane's worker",
            report,
        )
        expect(all(s["default_stream"] for s in source.seen), "a job ran on another stream", report)
        return report
    if main not in calls:
        # The trace names threads by ids that are not the system's (a Kineto or platform
        # quirk): which thread made a call cannot be told, so nothing is judged.
        report["trace_thread_ids"] = sorted(calls)
        report["native_ids"] = {t.name: t.native_id for t in threading.enumerate()}
        raise Skipped(
            f"the trace's thread ids {sorted(calls)[:6]} do not include the training thread's "
            f"system id {main}: its calls cannot be told from the worker's here",
            report,
        )
    expect(not others, f"threads other than the training thread made CUDA calls: {others}", report)
    return report


class CudaTap:
    """A gloo group's wire whose payloads take the device path on this rank's GPU: the
    frame's buffer, its upload and its stream waits are CUDA work posted by the caller's
    thread (NOTE [ Device work at next() ]), as on an NCCL group; the bytes themselves hop
    between the ranks through the host, over gloo (one GPU cannot hold an NCCL group of
    two). Heads travel as they do.

    Attributes:
        posts: the size of every payload this rank posted, in order.
        corrupt: ``(nbytes, k)``: flip a bit of the ``k``-th received payload of that size.
    """

    def __init__(self, wire: Any, device: torch.device) -> None:
        self._wire = wire
        self.rank = wire.rank
        self.size = wire.size
        self.device = device
        self.streams = CudaStreams(device)
        self.posts: list[int] = []
        self.corrupt: tuple[int, int] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wire, name)

    def head(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Any:
        return self._wire.head(tensor, root, timeout)

    def payload(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Any:
        n = tensor.numel()
        self.posts.append(n)
        if self.rank == root:
            # On the transfer stream, after the upload that filled it: the host waits.
            return self._wire.payload(tensor.cpu(), root, timeout)
        host = torch.empty(n, dtype=torch.uint8)
        posted = self._wire.payload(host, root, timeout)
        flip = self.corrupt is not None and self.corrupt == (n, self.posts.count(n))
        return _Landed(posted, host, tensor, flip)


class _Landed:
    """A payload received on the host; waiting copies it to the device, on the current
    stream (the transfer stream, where the frame's event is recorded next)."""

    def __init__(self, posted: Any, host: torch.Tensor, tensor: torch.Tensor, flip: bool) -> None:
        self._posted = posted
        self._host = host
        self._tensor = tensor
        self._flip = flip

    def wait(self, timeout: datetime.timedelta) -> None:
        self._posted.wait(timeout)
        if self._flip:
            self._host[0] ^= 1
        self._tensor.copy_(self._host)


def t15_order_after_a_refusal(rank: int) -> dict[str, Any]:
    """A loader at ``prefetch=2`` with ``verify=True`` and, after each ``next()``, a
    ``tc.broadcast`` on the same ranks (one group, one lane, one payload order). Rank 1
    refuses step 2 (its payload flipped in transit): its peers post step 3's payload at
    that ``next()``, so must it, before the broadcast's (review N-1)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    loader_n, broadcast_n, steps, refused_step = 1 << 20, 256 << 10, 6, 2
    taps: list[CudaTap] = []

    def tap(wire: Any) -> CudaTap:
        taps.append(CudaTap(wire, dev))
        if rank == 1:
            taps[-1].corrupt = (loader_n, refused_step + 1)
        return taps[-1]

    def batch(step: int) -> dict[str, Any]:
        return {"x": torch.full((loader_n,), step, dtype=torch.uint8)}

    def extra(step: int) -> dict[str, Any]:
        return {"y": torch.full((broadcast_n,), 100 + step, dtype=torch.uint8)}

    refused: list[int] = []
    wrong: list[int] = []
    error = ""
    ended = False
    with _groups.wrapping_wires(tap):
        loader = tc.BroadcastingDataLoader(
            Source(steps, batch) if rank == 0 else None,
            group=dist.group.WORLD,
            src=0,
            prefetch=2,
            device="cuda",
            timeout=10.0,
            verify=True,
        )
        it = iter(loader)
        try:
            for step in range(steps):
                try:
                    got = next(it)
                    if not bool((got["x"][:4096] == step).all()):
                        wrong.append(step)
                    del got
                except tc.HeaderError:
                    refused.append(step)
                out = tc.broadcast(extra(step) if rank == 0 else None, 0, device="cuda", timeout=10)
                if not bool((out["y"][:4096] == 100 + step).all()):
                    wrong.append(100 + step)
                del out
            ended = next(it, None) is None
        except Exception as e:  # reported below, once the ranks have told each other
            error = f"{type(e).__name__}: {str(e)[:300]}"
    torch.cuda.synchronize()
    label = {loader_n: "L", broadcast_n: "B"}
    mine = "".join(label.get(n, "?") for t in taps for n in t.posts)
    every: list[Any] = [None, None]
    dist.all_gather_object(every, {"posts": mine, "refused": refused, "error": error})
    report: dict[str, Any] = {
        f"rank {r}": e for r, e in enumerate(every)
    }  # L: a loader payload, B: a broadcast's
    report["taps"] = len(taps)
    expect(len(taps) == 1, f"{len(taps)} groups tapped, expected the one over both ranks", report)
    expect(every[1]["refused"] == [refused_step], f"rank 1 refused {every[1]['refused']}", report)
    expect(every[0]["refused"] == [], f"the source refused {every[0]['refused']}", report)
    posts = [e["posts"] for e in every]
    at = next((i for i, (a, b) in enumerate(zip(*posts)) if a != b), None)
    expect(
        at is None and posts[0] == posts[1],
        f"the ranks posted payloads in different orders (first at {at}): "
        f"source {posts[0]}, rank 1 {posts[1]}",
        report,
    )
    expect(not error and not every[0]["error"], f"{error or every[0]['error']}", report)
    expect(not wrong, f"wrong batches at steps {wrong}", report)
    expect(ended, "the pass did not end with the source", report)
    return report


def with_feats(batch: dict[str, Any], seed: int) -> dict[str, Any]:
    """``batch`` and a padded ndarray of features (it travels trimmed, in the host block,
    and is re-padded on the host)."""
    feats = np.full((8, 1500, 16), -23.025850929940457, dtype=np.float32)
    for row in range(8):
        feats[row, : 150 * row + seed] = row + seed / 8
    return {**batch, "feats": feats}


def t18b_trimmed_over_gloo(rank: int) -> dict[str, Any]:
    """The trimmed audio batch, with a trimmed ndarray, from a CPU source over gloo to
    ``device="cuda"``: bit for bit on both ranks, and no host sync on the receiver's
    threads."""
    if not accepts(tc.broadcast, "trim"):
        raise Skipped("tc.broadcast has no trim= keyword yet: nothing to check")
    report: dict[str, Any] = {}

    def send(seed: int) -> Any:
        batch = with_feats(padded_audio("cpu", seed), seed) if rank == 0 else None
        return tc.broadcast(batch, 0, device="cuda", timeout=TIMEOUT_S, trim=True)

    send(99)  # warm: the group, the pools
    outs: list[Any] = []
    with SyncCount() as syncs:
        for seed in range(4):
            outs.append(send(seed))
    report["tc.broadcast"] = {"syncs": syncs.count, "sites": syncs.sites}
    total = syncs.count
    if accepts(tc.BroadcastingDataLoader, "trim"):
        loader = tc.BroadcastingDataLoader(
            Source(4, lambda s: with_feats(padded_audio("cpu", s), s)) if rank == 0 else None,
            group=dist.group.WORLD,
            src=0,
            prefetch=2,
            device="cuda",
            timeout=TIMEOUT_S,
            trim=True,
        )
        with SyncCount() as syncs:
            outs += list(loader)
        report["loader prefetch=2"] = {"syncs": syncs.count, "sites": syncs.sites}
        total += syncs.count
    else:
        report["loader"] = "BroadcastingDataLoader has no trim= keyword yet: not checked"
    for i, out in enumerate(outs):
        same(with_feats(padded_audio("cpu", i % 4), i % 4), out, f"batch {i}")
        expect(out["audio"].is_cuda, f"batch {i}: audio on {out['audio'].device}", report)
    if rank == 1:  # the receiver's path; the source may read its batch to trim it
        expect(total == 0, f"{total} host syncs on the receiver", report)
    return report


# -- part C: an NCCL group of one -------------------------------------------------------


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settle() -> int:
    gc.collect()
    time.sleep(3.0)  # threads that were told to leave
    gc.collect()
    return _threads()


def _init_nccl(store_dir: str, name: str) -> None:
    kwargs: dict[str, Any] = {
        "store": dist.FileStore(os.path.join(store_dir, name), 1),
        "rank": 0,
        "world_size": 1,
        "timeout": datetime.timedelta(seconds=60),
    }
    try:
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0), **kwargs)
    except TypeError:  # a torch without device_id
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", **kwargs)


def part_c(rec: Recorder, store_dir: str) -> None:
    sleeper = Sleeper()
    counts: dict[str, Any] = {"before_init": _threads()}
    if not dist.is_nccl_available():
        for cid in CHECKS["C"]:
            if cid not in DRIVER_CHECKS:
                rec.run(cid, lambda: expect(False, "NCCL is not available in this torch build"))
        return
    # A plain NCCL cycle first: the threads torch and NCCL keep for themselves.
    _init_nccl(store_dir, "control")
    t = torch.ones(4, device="cuda")
    dist.broadcast(t, 0)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    counts["after_a_plain_nccl_cycle"] = _settle()

    _init_nccl(store_dir, "world-1")
    counts["after_init"] = _threads()
    started = time.perf_counter()
    first = tc.broadcast({"x": torch.arange(1024, device="cuda")}, 0)
    torch.cuda.synchronize()
    counts["first_broadcast_s"] = round(time.perf_counter() - started, 3)
    counts["after_first_broadcast"] = _threads()
    del first
    rec.run("R8", r8_nccl_trees)
    rec.run("T8", lambda: t8_independent_of_the_default_stream(sleeper))
    rec.run("T9", lambda: t9_own_tree_not_overwritten(sleeper))
    rec.run("T10", t10_cpu_packed)
    rec.run("T11", lambda: t11_syncs_per_broadcast(sleeper))
    rec.run("T23", t23_trimmed_leaves_rebuilt_on_the_host)
    rec.run("T16", t16_memory_after_a_one_off_broadcast)
    dist.destroy_process_group()
    counts["after_destroy_1"] = _settle()
    counts["threads_after_destroy_1"] = sorted(t.name for t in threading.enumerate())
    _init_nccl(store_dir, "world-2")
    tc.broadcast({"x": torch.arange(1024, device="cuda")}, 0)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    counts["after_destroy_2"] = _settle()
    counts["threads_after_destroy_2"] = sorted(t.name for t in threading.enumerate())

    def t13a() -> dict[str, Any]:
        control = counts["after_a_plain_nccl_cycle"]
        for key in ("after_destroy_1", "after_destroy_2"):
            expect(
                counts[key] <= control + 2,
                f"{counts[key]} threads {key.replace('_', ' ')}, {control} after a plain NCCL cycle",
                counts,
            )
        return counts

    rec.run("T13a", t13a)
    # Each in a world of its own: they break tensorcast's group on purpose.
    rec.run("T14", _in_nccl_world(store_dir, "world-3", lambda: t14_break(sleeper)))
    rec.run(
        "T19",
        _in_nccl_world(store_dir, "world-4", lambda: t19_input_outlives_its_transfer(sleeper)),
    )
    rec.run("T20", lambda: t20_blocking_wait(store_dir, sleeper))
    rec.run("T21", _in_nccl_world(store_dir, "world-6", lambda: t21_groups_apart(sleeper)))
    rec.run("T22", _in_nccl_world(store_dir, "world-7", lambda: t22_abort_that_blocks(sleeper)))
    pair: dict[str, Any] = {}
    rec.run("T12", lambda: t12_sender_receiver_on_cuda_streams(sleeper, pair))
    rec.run("T12s", lambda: t12s_receiver_syncs(pair))
    rec.run("T12p", lambda: t12p_padded_leaf_on_cuda_streams(sleeper))
    # Last: a capture that fails may leave this process unable to go on.
    rec.run(
        "T24",
        _in_nccl_world(store_dir, "world-8", lambda: t24_capture_at_a_one_off_deadline(sleeper)),
    )
    rec.run("T6c", t6c_capture_while_the_worker_makes_a_frame)
    rec.write({"event": "done", "time": time.time()})


def _in_nccl_world(store_dir: str, name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run in a new NCCL world of one, torn down after whatever happened."""

    def run() -> Any:
        _init_nccl(store_dir, name)
        try:
            return fn()
        finally:
            _destroy()

    return run


def _destroy() -> None:
    """Tear the default group down after a check that may have broken tensorcast's
    group: what it raises is printed, and the part goes on."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:
        print(f"destroy_process_group: {type(e).__name__}: {e}", flush=True)


def r8_nccl_trees() -> dict[str, Any]:
    for step in range(3):
        for device in ("cuda", "cpu"):
            batch = every_dtype(device, step)
            got = tc.broadcast(batch, 0)
            same(batch, got, f"a {device} tree, step {step}")
            expect(all(t.is_cuda for t in tensors(got)), f"a {device} tree: a leaf not on the GPU")
    big = {"audio": torch.randn(4, 1 << 20, device="cuda"), "lens": torch.arange(4, device="cuda")}
    for step in range(2):
        got = tc.broadcast(big, 0)
        same(big, got, f"a large tree, step {step}")
        expect(
            got["audio"].data_ptr() != big["audio"].data_ptr(),
            "the source's tree aliases its input",
        )
    got = tc.broadcast(tc.pack(every_dtype("cpu", 9)), 0, device="cpu")
    same(every_dtype("cpu", 9), got, "a pre-packed batch, device='cpu'")
    return {}


def t8_independent_of_the_default_stream(sleeper: Sleeper) -> dict[str, Any]:
    x = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
    tree = {"x": x, "step": 8}
    s = torch.cuda.Stream()
    for _ in range(3):  # the pinned staging pool and NCCL warm
        with torch.cuda.stream(s):
            tc.broadcast(tree, 0)
    torch.cuda.synchronize()
    lane = _lane()
    report: dict[str, Any] = {}
    outs = []
    for variant in ("inline", "on the worker"):
        torch.cuda.synchronize()
        sleeper.sleep(1000)  # the default stream: busy for a second
        busy = record_event()
        with torch.cuda.stream(s):
            if variant == "on the worker":
                submit(lane, lambda: time.sleep(0.05))  # the broadcast's job queues behind
            started = time.perf_counter()
            out = tc.broadcast(tree, 0)
            returned = time.perf_counter() - started
            ready = record_event(s)
        waited = poll(ready, 5.0)
        default_busy = not busy.query()
        outs.append(out)
        report[variant] = {
            "returned_ms": round(returned * 1e3, 2),
            "ready_ms_after_return": None if waited is None else round(waited * 1e3, 2),
            "default_stream_still_busy": default_busy,
        }
    torch.cuda.synchronize()
    for out in outs:
        expect(torch.equal(out["x"].cpu(), x), "the broadcast tree's bytes differ", report)
    inline, worker = report["inline"], report["on the worker"]
    for name, r in report.items():
        expect(r["ready_ms_after_return"] is not None, f"{name}: not ready within 5 s", report)
        expect(
            r["default_stream_still_busy"], f"{name}: the default stream was idle by then", report
        )
    expect(inline["returned_ms"] < 50, f"inline: returned after {inline['returned_ms']} ms", report)
    total = inline["returned_ms"] + inline["ready_ms_after_return"]
    expect(total < 100, f"inline: ready on s after {total:.1f} ms", report)
    expect(worker["ready_ms_after_return"] < 100, f"on the worker: {worker}", report)
    return report


def t9_own_tree_not_overwritten(sleeper: Sleeper) -> dict[str, Any]:
    s1, s2, s3 = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    report: dict[str, Any] = {}

    def batch(value: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((STEP_BYTES,), value, dtype=torch.uint8, device="cuda")}

    # (a) the library's hand-over: taken on s1, read late on s1, dropped; the next on s2
    first = batch(1)
    s1.wait_stream(torch.cuda.current_stream())  # the batch was made on this stream
    with torch.cuda.stream(s1):
        own = tc.broadcast(first, 0)
        ptr = own["x"].data_ptr()
        sleeper.sleep(200)
        late = own["x"][-(1 << 20) :].clone()
    aliased = ptr == first["x"].data_ptr()
    del own, first
    time.sleep(0.05)
    second = batch(2)
    s2.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s2):
        own2 = tc.broadcast(second, 0)
    report["a_reused_address"] = own2["x"].data_ptr() == ptr
    torch.cuda.synchronize()
    expect(not aliased, "the source's own tree aliases its input", report)
    expect(bool((late == 1).all()), f"read late on s1: {sorted(set(late.cpu().tolist()))}", report)
    expect(bool((own2["x"] == 2).all()), "the second broadcast is wrong", report)
    # (b) taken on the default stream, read on s3 with an explicit record_stream, dropped
    own = tc.broadcast(batch(3), 0)
    s3.wait_stream(torch.cuda.current_stream())
    own["x"].record_stream(s3)
    with torch.cuda.stream(s3):
        sleeper.sleep(200)
        late = own["x"][-(1 << 20) :].clone()
    del own
    time.sleep(0.05)
    own4 = tc.broadcast(batch(4), 0)
    torch.cuda.synchronize()
    expect(bool((late == 3).all()), f"read late on s3: {sorted(set(late.cpu().tolist()))}", report)
    expect(bool((own4["x"] == 4).all()), "the fourth broadcast is wrong", report)
    return report


def t10_cpu_packed() -> dict[str, Any]:
    tree = every_dtype("cpu", 10)
    packed = tc.pack(tree)
    out = tc.broadcast(packed, 0)
    expect(all(t.is_cuda for t in tensors(out)), "a leaf is not on the GPU")
    same(tree, out, "to the GPU")
    tc.broadcast(packed, 0, device="cpu")
    with SyncCount() as syncs:
        out = tc.broadcast(packed, 0, device="cpu")
    same(tree, out, "device='cpu'")
    expect(all(t.is_cpu for t in tensors(out)), "device='cpu': a leaf is not on the CPU")
    return {"device_cpu_syncs": syncs.count, "sites": syncs.sites}


def t11_syncs_per_broadcast(sleeper: Sleeper) -> dict[str, Any]:
    report: dict[str, Any] = {}

    def count(name: str, make: Callable[[], Any], n: int = 5) -> float:
        tc.broadcast(make(), 0)
        batches = [make() for _ in range(n)]
        with SyncCount() as syncs:
            outs = [tc.broadcast(b, 0) for b in batches]
        for b, o in zip(batches, outs):
            same(b, o, name)
        report[name] = {"syncs_per_broadcast": syncs.count / n, "sites": syncs.sites}
        return syncs.count / n

    def tensor_only() -> dict[str, Any]:
        return {"a": torch.randn(1 << 16, device="cuda"), "b": torch.arange(9, device="cuda")}

    def mixed() -> dict[str, Any]:
        return {**tensor_only(), "feats": np.arange(256, dtype=np.float32), "text": "y" * 4096}

    def cpu_mixed() -> dict[str, Any]:
        return {"a": torch.randn(1 << 16), "feats": np.arange(256, dtype=np.float32)}

    per = count("(a) CUDA tensor-only", tensor_only)
    padded = count("(e) a padded 2-D CUDA leaf (sent whole)", lambda: padded_audio("cuda"))
    count("(b) CUDA + ndarray + 4 KiB str", mixed)
    count("(c) CPU + ndarray", cpu_mixed)
    # How long (b) takes to return when the caller's stream is busy: its non-tensor leaves
    # are written into the device buffer on the transfer stream.
    batch = mixed()
    torch.cuda.synchronize()
    sleeper.sleep(300)
    started = time.perf_counter()
    tc.broadcast(batch, 0)
    report["(b) returned_ms_with_the_stream_busy_300ms"] = round(
        (time.perf_counter() - started) * 1e3, 1
    )
    torch.cuda.synchronize()
    # (d) a sender with verify=True on the same group: a CPU batch travels (its CRC32
    # taken from the pinned staging on the host); a CUDA batch has no host copy to take
    # it from, and is a ValueError
    group = _groups.world().group((dist.get_rank(),))
    sender = Sender(group, 0, verify=True, timeout=TD)

    def send(tree: Any) -> Any:
        own = sender.send_batch(tree, None, TD)  # an ERROR frame, then raised, if refused
        return own.take() if isinstance(own, DevicePart) else own

    cpu = {"a": torch.randn(1 << 16), "b": torch.arange(5)}
    send(cpu)
    with SyncCount() as syncs:
        out = send(cpu)
    same(cpu, out, "(d) verify=True")
    report["(d) verify=True, CPU batch"] = {
        "syncs_per_broadcast": syncs.count,
        "sites": syncs.sites,
    }
    try:
        send(tensor_only())
    except ValueError as e:
        report["(d) verify=True, CUDA batch"] = f"ValueError: {str(e)[:80]}"
    else:
        raise Failed("(d) verify=True: a CUDA batch travelled", report)
    lane = group.lane
    expect(lane.broken is None, f"(d) the group broke: {lane.broken!r}", report)
    same(cpu, send(cpu), "(d) after the refused batch")
    expect(per == 0, f"(a) a CUDA tensor-only tree: {per} syncs per broadcast", report)
    expect(padded == 0, f"(e) a padded 2-D CUDA leaf: {padded} syncs per broadcast", report)
    return report


def host_padded() -> dict[str, Any]:
    """A CPU batch whose padded tensor and ndarray both trim, for GPU and CPU receivers
    alike (a CPU receiver's trim must save a third of the leaf and a few hundred KiB)."""
    g = torch.Generator().manual_seed(23)
    rows, length = 8, 64_000
    audio = torch.zeros(rows, length)
    feats = np.zeros((rows, 4000, 16), dtype=np.float32)
    for row in range(rows):
        n = length * (row + 2) // 10
        audio[row, :n] = torch.randn(n, generator=g)
        feats[row, : 250 * row] = row + 0.5
    return {"audio": audio, "feats": feats, "ids": [f"utt-{row}" for row in range(rows)]}


def t23_trimmed_leaves_rebuilt_on_the_host() -> dict[str, Any]:
    """A CPU batch with a padded ndarray (it travels trimmed, in the host block) and a
    padded tensor, on the NCCL group: to the GPU (the ndarray rebuilt on the host) and
    with ``device="cpu"`` (every trimmed leaf rebuilt on the host). ``record_stream``
    takes device memory only: a host output handed to it raises on every rank."""
    batch = host_padded()
    trimmed = {
        "for GPU receivers": trimmed_leaves(tc.pack(batch, device="cuda")),
        "for CPU receivers": trimmed_leaves(tc.pack(batch)),
    }
    report: dict[str, Any] = {"trimmed_leaves": trimmed}
    for who, paths in trimmed.items():
        expect(paths == ["['audio']", "['feats']"], f"{who}, trimmed: {paths}", report)
    for device in (None, "cpu"):
        where = f"device={device!r}"
        for _ in range(2):  # the first, then one into reused memory
            out = tc.broadcast(batch, 0, device=device, timeout=TIMEOUT_S)
        same(batch, out, where)
        on = out["audio"].device.type
        expect(on == (device or "cuda"), f"{where}: the audio leaf is on {on}", report)
    return report


MIB = 1 << 20


def t16_memory_after_a_one_off_broadcast() -> dict[str, Any]:
    """A one-off ``tc.broadcast`` of a large CUDA tree, then ``del`` of the tree and its
    input: nothing of either may stay allocated until the next post or a deadline (review
    N-2). The caching allocator counts a block free at ``del`` even while a stream it was
    recorded on still uses it, so the baseline comes back at once when nothing holds it."""
    slack = 4 * MIB
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    big = {"audio": torch.randn(64 * MIB, device="cuda"), "lens": torch.arange(4, device="cuda")}
    out = tc.broadcast(big, 0)
    torch.cuda.synchronize()
    report: dict[str, Any] = {
        "tree_MiB": round(big["audio"].nbytes / MIB),
        "held_MiB_with_both": round((torch.cuda.memory_allocated() - base) / MIB, 1),
    }
    same_bytes = torch.equal(out["audio"], big["audio"])
    del big, out
    gc.collect()
    held = torch.cuda.memory_allocated() - base
    report["held_MiB_after_del"] = round(held / MIB, 2)
    if held > slack:  # for the report only: how long until it went (the check fails anyway)
        started = time.perf_counter()
        while torch.cuda.memory_allocated() - base > slack and time.perf_counter() - started < 3:
            time.sleep(0.05)
            gc.collect()
        back = torch.cuda.memory_allocated() - base <= slack
        report["back_within_3s"] = round(time.perf_counter() - started, 2) if back else False
    expect(same_bytes, "the broadcast tree differs from its input", report)
    expect(
        held <= slack,
        f"{held / MIB:.1f} MiB still allocated after del and gc.collect() (slack "
        f"{slack // MIB} MiB): the last transfer's buffer or input is held",
        report,
    )
    return report


def t19_input_outlives_its_transfer(sleeper: Sleeper) -> dict[str, Any]:
    """A CUDA input whose transfer waits behind a 3 s sleep, with a 1 s deadline: the
    lane's worker breaks the lane at the deadline and lets go of what the transfer reads.
    The caller then drops the input and allocates a same-sized tensor: unless the input
    was recorded on the transfer stream, the allocator hands its block out at once, and
    the transfer copies the new bytes (review N-7)."""
    n = STEP_BYTES
    tc.broadcast({"x": torch.full((n // 2,), 1, dtype=torch.uint8, device="cuda")}, 0)
    torch.cuda.synchronize()
    x = torch.full((n,), 7, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    ptr = x.data_ptr()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        sleeper.sleep(3000)  # the transfer stream waits on s
        out = tc.broadcast({"x": x}, 0, timeout=1.0)
    lane = _lane()
    started = time.perf_counter()
    while lane.broken is None and time.perf_counter() - started < 10:
        time.sleep(0.02)
    report: dict[str, Any] = {
        "broken_after_s": round(time.perf_counter() - started, 2),
        "broken": repr(lane.broken)[:200],
    }
    if lane.broken is None:
        torch.cuda.synchronize()
        raise Failed("the 1 s deadline did not break the lane within 10 s: nothing tested", report)
    transfer_done = poll(record_event(s), 0.0) is not None
    report["transfer_done_when_the_lane_broke"] = transfer_done
    del x
    # Same-sized tensors on the default stream (idle) until one gets the input's block:
    # the allocator may hold other free blocks of that size from the checks before.
    ys: list[torch.Tensor] = []
    while len(ys) < 16 and (not ys or ys[-1].data_ptr() != ptr):
        ys.append(torch.full((n,), 9, dtype=torch.uint8, device="cuda"))
    report["input_block_handed_out_again"] = ys[-1].data_ptr() == ptr
    torch.cuda.synchronize()
    values = sorted(set(out["x"][-4096:].cpu().tolist()))
    report["own_tree_values"] = values
    expect(not transfer_done, "the transfer was done before the deadline: nothing tested", report)
    expect(values == [7], f"the transfer read {values} instead of the input's 7s", report)
    return report


def t20_blocking_wait(store_dir: str, sleeper: Sleeper) -> dict[str, Any]:
    """``TORCH_NCCL_BLOCKING_WAIT=1`` makes an NCCL work's ``wait()`` poll on the host. A
    broadcast posted while the caller's stream is busy for 500 ms must still return at
    once, or tensorcast must say it cannot (a warning or an error naming the variable;
    review N-5)."""
    name = "TORCH_NCCL_BLOCKING_WAIT"
    report: dict[str, Any] = {}
    os.environ[name] = "1"  # read when an NCCL backend is made: tensorcast's included
    refused: BaseException | None = None
    returned_ms: float | None = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                _init_nccl(store_dir, "world-5")
                tree = {"x": torch.arange(1 << 18, device="cuda")}
                tc.broadcast(tree, 0)  # tensorcast's group is made here
                torch.cuda.synchronize()
                sleeper.sleep(500)
                started = time.perf_counter()
                out = tc.broadcast(tree, 0)
                returned_ms = round((time.perf_counter() - started) * 1e3, 1)
                torch.cuda.synchronize()
                expect(torch.equal(out["x"], tree["x"]), "the broadcast tree differs", report)
            except Exception as e:
                if name not in str(e):
                    raise
                refused = e
    finally:
        os.environ.pop(name, None)
        _destroy()
    named = [str(w.message)[:200] for w in caught if name in str(w.message)]
    report.update({"returned_ms_with_the_stream_busy_500ms": returned_ms, "warnings": named[:2]})
    if refused is not None:
        report["refused"] = f"{type(refused).__name__}: {str(refused)[:200]}"
        return report
    if named:
        return report
    expect(
        returned_ms is not None and returned_ms < 100,
        f"the broadcast returned after {returned_ms} ms (the host waited for the stream) "
        f"and nothing warned of {name}",
        report,
    )
    return report


def t21_groups_apart(sleeper: Sleeper) -> dict[str, Any]:
    """Two NCCL wires made as tensorcast makes a group's (``wire.make_wire``), each with
    a lane: group A's part first waits on a slow peer (an event behind a 1.5 s sleep on a
    side stream), group B's is posted after it. Each group has its own transfer stream,
    so B is done at once and A is not (review N-4); both carry the right bytes."""
    dev = torch.device("cuda", torch.cuda.current_device())
    base = dist.distributed_c10d._get_default_store()
    td = datetime.timedelta(seconds=30)
    wires = [
        make_wire(
            dist.PrefixStore(f"t21/{name}/", base),
            0,
            1,
            connect=td,
            timeout=td,
            device=dev,
            name=f"t21-{name}",
            ranks=(0,),
        )
        for name in "ab"
    ]
    report: dict[str, Any] = {"own_streams": wires[0].streams is not wires[1].streams}
    lanes = [Lane(f"t21-{i}", w.abort, dev.index, device_group=True) for i, w in enumerate(wires)]
    try:
        stagings = [
            Staging(Group((0,), w, lane), 0, lambda error: None) for w, lane in zip(wires, lanes)
        ]
        n = 4 * MIB
        sources = [torch.full((n,), v, dtype=torch.uint8, device=dev) for v in (5, 6)]
        torch.cuda.synchronize()
        slow = torch.cuda.Stream(dev)
        with torch.cuda.stream(slow):
            sleeper.sleep(1500)
        late = record_event(slow)  # the slow peer of group A

        def part(i: int, **work: Any) -> DevicePart:
            src = sources[i]
            fill = lambda buffer: buffer.copy_(src, non_blocking=True)  # noqa: E731
            build = lambda buffer: (buffer, [])  # noqa: E731  # as the codec's: (tree, re-pads)
            return stagings[i].part(n, build, None, TD, fill=fill, **work)

        a, b = part(0, ready=late), part(1)
        a.post()
        b.post()
        side_a, side_b = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        with torch.cuda.stream(side_a):
            got_a = a.take()
            a_event = record_event(side_a)
        with torch.cuda.stream(side_b):
            got_b = b.take()
            b_done = poll(record_event(side_b), 1.0)
        a_done_then = bool(a_event.query())
        a_done = poll(a_event, 10.0)
        torch.cuda.synchronize()
        report.update(
            b_done_s=None if b_done is None else round(b_done, 4),
            a_done_when_b_was=a_done_then,
            a_done_after_s=None if a_done is None else round(a_done, 3),
        )
        right = [bool((got == v).all()) for got, v in ((got_a, 5), (got_b, 6))]
    finally:
        for lane in lanes:  # watch no deadline: no event query lands in T6c's capture
            lane.inflight.clear()
            lane.wake()
        for wire in wires:
            wire.shutdown()
    expect(report["own_streams"], "both groups have the same transfer stream", report)
    expect(
        b_done is not None and b_done < 0.5,
        f"group B's payload waited for group A's slow peer ({b_done} s)",
        report,
    )
    expect(not a_done_then, "group A's part did not wait on its slow peer: nothing tested", report)
    expect(all(right), f"wrong bytes (A, B): {right}", report)
    return report


def t22_abort_that_blocks(sleeper: Sleeper) -> dict[str, Any]:
    """An NCCL abort can block (NVIDIA/nccl #829, #549). tensorcast's group's abort is made
    to block for up to 30 s; a broadcast whose payload waits behind a 2 s sleep has a
    0.3 s deadline, so the lane's worker breaks the lane and aborts. A job queued behind
    must still run on that worker and raise ``PeerError`` soon (the abort waited for a
    bounded time, on a thread of its own: review N-6)."""
    tree = {"x": torch.full((MIB,), 3, dtype=torch.uint8, device="cuda")}
    tc.broadcast(tree, 0)
    torch.cuda.synchronize()
    group = _groups.world().group((dist.get_rank(),))
    lane = group.lane
    release = threading.Event()
    aborted_on: list[str] = []

    class BlockingAbort:
        """The group's wire, its abort held until released (as a stuck ``ncclCommAbort``)."""

        def __init__(self, wire: Any) -> None:
            self._wire = wire

        def __getattr__(self, name: str) -> Any:
            return getattr(self._wire, name)

        def abort(self) -> None:
            aborted_on.append(threading.current_thread().name)
            release.wait(30)
            self._wire.abort()

    group.wire = BlockingAbort(group.wire)  # type: ignore[assignment]
    report: dict[str, Any] = {}
    s = torch.cuda.Stream()
    try:
        with torch.cuda.stream(s):
            sleeper.sleep(2000)  # the transfer stream waits on s
            out = tc.broadcast(tree, 0, timeout=0.3)
        started = time.perf_counter()
        while lane.broken is None and time.perf_counter() - started < 10:
            time.sleep(0.01)
        report["broken_after_s"] = round(time.perf_counter() - started, 2)
        report["broken"] = repr(lane.broken)[:200]
        job: Any = Job(lane.check)
        lane.enqueue(job)  # on the worker, behind the break it is making
        while not job.done and time.perf_counter() - started < 15:
            time.sleep(0.01)
        report["queued_job_done_after_s"] = round(time.perf_counter() - started, 2)
        report["queued_job_error"] = repr(job.error)[:200] if job.done else None
        report["aborted_on"] = aborted_on
        del out
    finally:
        release.set()
        report["device_drained_s"] = poll(record_event(s), 20.0)
    expect(lane.broken is not None, "the 0.3 s deadline did not break the lane", report)
    expect(job.done, "the job queued behind a blocked abort did not run within 15 s", report)
    expect(isinstance(job.error, tc.PeerError), f"the queued job: {job.error!r}", report)
    expect(
        len(aborted_on) == 1 and aborted_on[0].startswith("tensorcast-abort"),
        f"the abort ran on {aborted_on}",
        report,
    )
    return report


# -- T12: a wire whose payloads are CUDA copies with NCCL's stream contract -------------


class _Ended:
    """A posted payload: waiting makes the current stream wait on its end (never the host)."""

    def __init__(self, event: Any, device: torch.device) -> None:
        self._event = event
        self._device = device

    def wait(self, timeout: datetime.timedelta) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)


class CudaLinkWire:
    """One end of an in-process two-rank link. Heads move as ``FakeWire`` moves them;
    a payload is a CUDA copy on a stream of this end's own, which first waits on the
    posting thread's current stream (what NCCL's stream does at a collective); its end is
    an event the waiter's current stream waits on.

    Attributes:
        posts: the name of the thread that posted each payload.
    """

    size = 2

    def __init__(self, heads: FakeWire, payloads: queue.Queue[Any], device: torch.device) -> None:
        self._heads = heads
        self._payloads = payloads
        self.rank = heads.rank
        self.device = device
        self.streams: Any = CudaStreams(device)  # each end its own transfer stream, as two ranks
        self._stream = torch.cuda.Stream(device)
        self.posts: list[str] = []
        self.aborted = False

    def head(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Any:
        return self._heads.head(tensor, root, timeout)

    def payload(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> _Ended:
        self.posts.append(threading.current_thread().name)
        mine = self._stream
        mine.wait_stream(torch.cuda.current_stream(self.device))
        if self.rank == root:
            sent = record_event(mine)
            self._payloads.put((tensor, sent))
            return _Ended(sent, self.device)
        try:
            source, sent = self._payloads.get(timeout=timeout.total_seconds())
        except queue.Empty:
            raise RuntimeError(f"no payload within {timeout.total_seconds():g} s") from None
        mine.wait_event(sent)
        with torch.cuda.stream(mine):
            tensor.copy_(source, non_blocking=True)
        source.record_stream(mine)  # the source's buffer is read here: not reused before
        return _Ended(record_event(mine), self.device)

    def abort(self) -> None:
        self.aborted = True
        self._heads.abort()

    def shutdown(self) -> None:
        pass


#: the receiver's threads in T12: its consumer and its lane's worker
RECEIVER_THREADS = ("receiver-main", "tensorcast-lane-link1")


def t12_sender_receiver_on_cuda_streams(sleeper: Sleeper, pair: dict[str, Any]) -> dict[str, Any]:
    """Runs the pair at ``ahead`` 1 and 2; what T12s judges (the receiver's host syncs)
    goes into ``pair``."""
    report: dict[str, Any] = {}
    for ahead in (1, 2):
        report[f"ahead={ahead}"] = _t12_pair(sleeper, ahead, report, pair)
    return report


def t12p_padded_leaf_on_cuda_streams(sleeper: Sleeper) -> dict[str, Any]:
    """T12 at ``ahead=2`` with a trimmed (B, T) leaf whose samples say the step: its
    re-pad must be ordered before the hand-out (a snapshot right after ``take()``) and its
    memory handed to the consumer's stream (a late read, after a 200 ms sleep, of a tree
    dropped meanwhile); no host sync on the receiver's threads."""
    trimmed = trimmed_leaves(tc.pack(padded_step(1), device="cuda"))
    report: dict[str, Any] = {"trimmed_leaves": trimmed}
    expect(trimmed == ["['audio']"], f"the padded leaf is not trimmed: {trimmed}", report)
    pair: dict[str, Any] = {}
    report["ahead=2"] = _t12_pair(sleeper, 2, report, pair, padded=True)
    report["syncs"] = pair["ahead=2"]
    syncs = pair["ahead=2"]["receiver_syncs"]
    expect(syncs == 0, f"{syncs} host syncs on the receiver's threads", report)
    return report


def t12s_receiver_syncs(pair: dict[str, Any]) -> dict[str, Any]:
    """The NCCL-style receiver's host syncs, counted under ``set_sync_debug_mode("warn")``
    on its consumer thread and its lane's worker, up to the consumer's last step (its own
    final ``torch.cuda.synchronize()`` would count)."""
    expect(len(pair) == 2, f"T12 ran {sorted(pair)} of ahead=1 and ahead=2", pair)
    for ahead, counted in pair.items():
        expect(
            counted["receiver_syncs"] == 0,
            f"{ahead}: {counted['receiver_syncs']} host syncs on the receiver's threads",
            pair,
        )
    return pair


def _t12_pair(
    sleeper: Sleeper,
    ahead: int,
    report: dict[str, Any],
    pair: dict[str, Any],
    *,
    padded: bool = False,
) -> dict[str, Any]:
    """One source and one receiver, each a consumer thread that keeps ``ahead`` steps
    submitted to its lane (with 2, it posts the next batch's device work at each step, as
    a loader at ``prefetch=2`` does). Host syncs are counted throughout, by thread.
    ``padded``: CPU batches of :func:`padded_step`, trimmed, so that both sides re-pad
    the leaf on the transfer stream; each side snapshots it whole."""
    dev = torch.device("cuda", torch.cuda.current_device())
    steps = 6
    heads = FakeWire.pair()
    link: queue.Queue[Any] = queue.Queue()
    wires = [CudaLinkWire(h, link, dev) for h in heads]
    lanes = [
        Lane(f"link{w.rank}", w.abort, dev.index, device_group=True, idle_exit_s=0.5) for w in wires
    ]
    groups = [Group((0, 1), w, lane) for w, lane in zip(wires, lanes)]
    sender = Sender(groups[0], 0, timeout=TD)
    receiver = Receiver(groups[1], 0, rank=1, timeout=TD)

    def send(i: int) -> Any:
        if padded:
            return sender.send_batch(padded_step(i + 1), None, TD)
        # odd steps: a CUDA batch made on the lane's worker, as a source iterator makes it
        return sender.send_batch(step_batch(i + 1, "cuda" if i % 2 else "cpu"), None, TD)

    def first(tree: Any) -> torch.Tensor:
        return tree["audio"].clone() if padded else tree["x"][:4096].clone()

    def last(tree: Any) -> torch.Tensor:
        return tree["audio"].clone() if padded else tree["x"][-4096:].clone()

    wrong = wrong_padded if padded else wrong_steps

    def recv(i: int) -> Any:
        return receiver.recv(None, TD)

    out: dict[str, Any] = {}
    receiver_syncs: list[int] = []

    def consumer(name: str, lane: Lane, step_fn: Callable[[int], Any]) -> None:
        try:
            side = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))
            jobs: list[Any] = []

            def queue_next() -> None:
                i = len(jobs)
                jobs.append(submit(lane, lambda: step_fn(i)))

            for _ in range(ahead):
                queue_next()
            snaps: list[tuple[int, torch.Tensor]] = []
            lates: list[tuple[int, torch.Tensor]] = []
            for i in range(steps):
                part = jobs[i].result()
                sleeper.sleep(300)  # this thread's default stream, before each step
                with torch.cuda.stream(side[i % 2]):  # the next step is taken on the other
                    tree = part.take()
                    snaps.append((i + 1, first(tree)))
                    if ahead >= 2 and i + 1 < len(jobs):  # as a loader posts ahead
                        jobs[i + 1].result().post()
                    sleeper.sleep(200)
                    lates.append((i + 1, last(tree)))
                del tree, part
                jobs[i] = None
                if len(jobs) < steps:
                    queue_next()
            if name == "receiver":
                receiver_syncs.append(syncs.now(RECEIVER_THREADS))
            torch.cuda.synchronize()
            out[name] = (wrong(snaps), wrong(lates))
        except BaseException as e:
            out[name] = e

    threads = [
        threading.Thread(target=consumer, args=("source", lanes[0], send), name="source-main"),
        threading.Thread(target=consumer, args=("receiver", lanes[1], recv), name="receiver-main"),
    ]
    with SyncCount() as syncs:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    pair[f"ahead={ahead}"] = {
        "receiver_syncs": receiver_syncs[0] if receiver_syncs else None,
        "syncs_by_thread": syncs.threads,
        "sites": syncs.sites,
    }
    expect(not any(t.is_alive() for t in threads), f"ahead={ahead}: a consumer hung", report)
    got: dict[str, Any] = {}
    for name, wire, main in (
        ("source", wires[0], "source-main"),
        ("receiver", wires[1], "receiver-main"),
    ):
        result = out.get(name)
        if isinstance(result, BaseException):
            raise Failed(
                f"ahead={ahead}, {name}: {type(result).__name__}: {result}", report
            ) from result
        assert isinstance(result, tuple), result
        snaps_bad, lates_bad = result
        got[name] = {"posted_by": sorted(set(wire.posts)), "posts": len(wire.posts)}
        where = f"ahead={ahead}, {name}"
        expect(not snaps_bad, f"{where}: stale bytes on the consumer's stream: {snaps_bad}", report)
        expect(not lates_bad, f"{where}: a dropped tree was overwritten: {lates_bad}", report)
        expect(set(wire.posts) == {main}, f"{where}: payloads posted by {set(wire.posts)}", report)
        expect(len(wire.posts) == steps, f"{where}: {len(wire.posts)} payloads", report)
    return got


def t14_break(sleeper: Sleeper) -> dict[str, Any]:
    tree = {"x": torch.full((STEP_BYTES,), 3, dtype=torch.uint8, device="cuda")}
    tc.broadcast(tree, 0)
    torch.cuda.synchronize()
    lane = _lane()
    sleeper.sleep(2000)
    tc.broadcast(tree, 0)  # its payload waits behind the sleep
    started = time.perf_counter()
    lane.break_(RuntimeError("broken on purpose by the GPU check"))
    broke_s = time.perf_counter() - started
    report: dict[str, Any] = {"break_s": round(broke_s, 3)}
    started = time.perf_counter()
    try:
        tc.broadcast(tree, 0, timeout=10)
    except tc.PeerError as e:
        report["next_broadcast"] = (
            f"PeerError after {time.perf_counter() - started:.3f} s: {str(e)[:100]}"
        )
        raised = time.perf_counter() - started
    else:
        raise Failed("the broadcast after break_ did not raise", report)
    drained = poll(record_event(), 20.0)
    report["device_drained_s"] = drained
    expect(broke_s < 10, f"break_ took {broke_s:.1f} s", report)
    expect(raised < 10, f"PeerError after {raised:.1f} s", report)
    expect(drained is not None, "the device did not drain within 20 s of the abort", report)
    return report


def t24_capture_at_a_one_off_deadline(sleeper: Sleeper) -> dict[str, Any]:
    """A one-off ``tc.broadcast`` whose part is not done at its hand-out stays watched
    until its deadline (1 s here), when the lane's worker queries its event. A graph is
    captured on the main thread (torch's default global mode) from before that moment to
    after it (the host waits inside the capture): it may not fail, and the lane stays
    whole (the worker's calls ignore other threads' captures)."""
    static = torch.zeros(1 << 16, device="cuda")
    warm_for_capture(static)
    kwargs = capture_kwargs()
    report: dict[str, Any] = {
        "capture_error_mode": kwargs.get("capture_error_mode", "torch's default (global)"),
    }
    tree = {"x": torch.arange(1 << 22, device="cuda")}
    tc.broadcast(tree, 0, timeout=1.0)  # the channel, once: its agreement and group
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        sleeper.sleep(300)  # the part waits on it: not done at its hand-out
        tc.broadcast(tree, 0, timeout=1.0)
    posted = time.monotonic()
    lane = _groups.world().group((dist.get_rank(),)).lane
    report["watched_after_take"] = len(lane.inflight)
    if not len(lane.inflight):
        raise Skipped("the part was seen done at its hand-out: no deadline to meet", report)
    errors: list[str] = []
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, **kwargs):
            y = static * 1.0001
            time.sleep(max(0.0, posted + 2.0 - time.monotonic()))  # the deadline: 1 s in
            y = y * 1.0001
        graph.replay()
    except RuntimeError as e:
        errors.append(str(e)[:300])
    torch.cuda.synchronize()
    report.update(errors=errors, broken=repr(lane.broken), watched_after_capture=len(lane.inflight))
    expect(not errors, f"the capture failed: {errors}", report)
    expect(lane.broken is None, f"the lane broke: {lane.broken!r}", report)
    if len(lane.inflight):
        raise Skipped("the worker had not looked at the deadline by the capture's end", report)
    return report


def t6c_capture_while_the_worker_makes_a_frame() -> dict[str, Any]:
    """A source on a lane of its own over a ``CudaLinkWire`` (its receiver never reads):
    each step, the main thread begins capturing a graph, and only then lets the lane's
    worker make the step's frame, and waits for it before the capture ends. The worker's
    CUDA calls thus fall inside the capture: the ``ready`` event of a CUDA batch, and the
    pinned staging of a CPU batch of a size the pool has not seen (review S5)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    heads, _ = FakeWire.pair()
    link: queue.Queue[Any] = queue.Queue()
    wire = CudaLinkWire(heads, link, dev)
    lane = Lane("capture0", wire.abort, dev.index, device_group=True, idle_exit_s=0.5)
    sender = Sender(Group((0, 1), wire, lane), 0, timeout=TD)
    static = torch.zeros(1 << 16, device="cuda")
    warm_for_capture(static)
    kwargs = capture_kwargs()
    steps = 6
    made_on_main = [step_batch(i + 1, "cuda") for i in range(steps)]  # not the worker's work
    torch.cuda.synchronize()
    variants: dict[str, Callable[[int], Any]] = {
        "a CUDA batch: its ready event recorded on the worker": lambda i: made_on_main[i],
        "a CPU batch of a new size: pinned staging allocated on the worker": lambda i: {
            "x": torch.full((SIZE_CLASSES[i],), (i + 1) % 256, dtype=torch.uint8),
            "step": i + 1,
        },
    }
    report: dict[str, Any] = {
        "capture_error_mode": kwargs.get("capture_error_mode", "torch's default (global)"),
    }
    for variant, make in variants.items():
        errors: list[str] = []
        snaps: list[tuple[int, torch.Tensor]] = []
        inside = 0
        for i in range(steps):
            go, made = threading.Event(), threading.Event()

            batch = make(i)

            def job(
                batch: Any = batch, go: threading.Event = go, made: threading.Event = made
            ) -> Any:
                go.wait(10)
                try:
                    frame, own = sender.write(batch, None, TD)
                finally:
                    made.set()
                sender.send(frame, TD)
                return own

            submitted = submit(lane, job)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, **kwargs):
                    y = static
                    for _ in range(20):
                        y = y * 1.0001
                    go.set()  # the worker makes the frame now, while this thread captures
                    inside += made.wait(10)  # a host wait: no CUDA call
                    for _ in range(20):
                        y = y * 1.0001
                graph.replay()
            except RuntimeError as e:
                errors.append(f"step {i}: capture: {str(e)[:200]}")
            go.set()
            try:
                tree = submitted.result().take()
                snaps.append((i + 1, tree["x"][:4096].clone()))
                del tree
            except Exception as e:
                errors.append(f"step {i}: the frame: {type(e).__name__}: {str(e)[:200]}")
                break  # the lane is broken: no later step can go
        torch.cuda.synchronize()
        report[variant] = {
            "steps": len(snaps),
            "frames_made_inside_the_capture": inside,
            "errors": errors[:3],
            "broken": repr(lane.broken)[:200],
        }
        expect(not errors, f"{variant}: {errors[:3]}", report)
        expect(lane.broken is None, f"{variant}: the lane broke: {lane.broken!r}", report)
        expect(inside == steps, f"{variant}: {inside} of {steps} frames inside the capture", report)
        bad = wrong_steps(snaps)
        expect(not bad, f"{variant}: wrong batches {bad}", report)
    while not link.empty():  # the payloads no receiver took
        link.get_nowait()
    return report


# -- the driver ---------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _run_part(
    part: str, out: Path, scratch: Path, deadline: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run one part's processes until ``deadline`` (``time.time()``); every record they
    wrote, and how they ended. Their records and output go to ``out`` as they come:
    ``part-X.<process>.jsonl`` and ``.log``. Each process also ends itself shortly after
    the deadline, should this driver be killed first (they have sessions of their own)."""
    ranks: list[int | None] = [0, 1] if part == "B" else [None]
    (out / f"part-{part}.json").unlink(missing_ok=True)  # a rerun into the same folder
    stores = scratch / f"stores-{part}"
    stores.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in ranks:
        tag = part if rank is None else f"{part}{rank}"
        results, log = out / f"part-{part}.{tag}.jsonl", out / f"part-{part}.{tag}.log"
        results.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part]
        cmd += ["--results", str(results), "--store-dir", str(stores)]
        cmd += ["--deadline", f"{deadline + 3:.0f}"]
        if rank is not None:
            cmd += ["--rank", str(rank)]
        with open(log, "w", encoding="utf-8") as sink:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=_child_env(), stdout=sink, stderr=subprocess.STDOUT,
                start_new_session=True,  # one process group each: killed whole on a hang
            )  # fmt: skip
        procs.append((tag, proc, results, log))
    started = time.monotonic()
    ended: dict[str, float] = {}
    while len(ended) < len(procs) and time.time() < deadline:
        for tag, proc, _, _ in procs:
            if tag not in ended and proc.poll() is not None:
                ended[tag] = time.time()
        time.sleep(0.1)
    timed_out = [tag for tag, *_ in procs if tag not in ended]
    for tag, proc, _, _ in procs:
        if tag in timed_out:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    records: list[dict[str, Any]] = []
    outcome: dict[str, Any] = {
        "seconds": round(time.monotonic() - started, 1),
        "limit_s": PART_TIMEOUT_S[part],
        "processes": {},
    }
    for tag, proc, results, log in procs:
        text = log.read_text(encoding="utf-8", errors="replace")
        records += _read_records(results)
        outcome["processes"][tag] = {
            "rc": proc.returncode,
            "timed_out": tag in timed_out,
            "ended": ended.get(tag),
            "log_tail": text[-4000:],
            "log": text,
        }
    return records, outcome


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a part's process; a line cut off by a kill is left out."""
    records = []
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records


def _verdicts(
    part: str, records: list[dict[str, Any]], procs: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """One verdict per check of ``part``: FAIL where a process that runs it failed it or did
    not get to it, else SKIP where one skipped it, else PASS. ``procs``: how the part's
    processes ended (None: not known, the part's driver was cut off)."""
    expected_ranks = 2 if part == "B" else 1
    verdicts = []
    for cid, name in CHECKS[part].items():
        mine = [r for r in records if r.get("id") == cid]
        if part == "C" and cid in DRIVER_CHECKS:
            proc = None if procs is None else procs.get("C")
            mine = [_driver_check(cid, records, proc)]
        details = []
        statuses = {r["status"] for r in mine}
        if len(mine) < expected_ranks:
            statuses.add("FAIL")
            if procs is None:
                how = "the part was cut off before its verdicts"
            else:
                how = ", ".join(
                    f"{tag}: rc={p['rc']}{' (timed out)' if p['timed_out'] else ''}"
                    for tag, p in procs.items()
                )
            details.append(f"did not run everywhere ({how})")
        for r in mine:
            if r["status"] != "PASS":
                who = "" if r.get("rank") is None else f"rank {r['rank']}: "
                details.append(f"{who}{r['status']}: {r['detail']}")
        status = "FAIL" if "FAIL" in statuses else "SKIP" if "SKIP" in statuses else "PASS"
        reports = {
            ("-" if r.get("rank") is None else f"rank {r['rank']}"): r.get("report", {})
            for r in mine
        }
        verdicts.append(
            {
                "id": cid,
                "part": part,
                "name": name,
                "status": status,
                "detail": "\n".join(details),
                "report": reports,
            }
        )
    return verdicts


def _driver_check(
    cid: str, records: list[dict[str, Any]], proc: dict[str, Any] | None
) -> dict[str, Any]:
    """T13b and T13c, judged from outside part C's process: its output and its exit."""
    if proc is None:
        return {"id": cid, "status": "FAIL", "detail": "the part was cut off", "report": {}}
    if cid == "T13b":
        log = proc["log"].lower()
        marks = (
            "has not been destroyed",
            "destroyed without",
            "without shutdown",
            "was not shut down",
        )
        found = [m for m in marks if m in log]
        lines = [line for line in proc["log"].splitlines() if any(m in line.lower() for m in marks)]
        ok = not found and not proc["timed_out"]
        detail = "" if ok else f"found {found} in the output: {lines[:3]}" if found else "timed out"
        return {
            "id": cid,
            "status": "PASS" if ok else "FAIL",
            "detail": detail,
            "report": {"lines": lines[:3]},
        }
    done = [r["time"] for r in records if r.get("event") == "done"]
    if not done or proc["ended"] is None:
        return {"id": cid, "status": "FAIL", "detail": "the part did not finish", "report": {}}
    lag = proc["ended"] - done[0]
    ok = lag < 30.0 and proc["rc"] == 0
    detail = "" if ok else f"exited {lag:.1f} s after its last check, rc={proc['rc']}"
    return {
        "id": cid,
        "status": "PASS" if ok else "FAIL",
        "detail": detail,
        "report": {"exit_s": round(lag, 2)},
    }


def _describe_device(out: Path | None = None) -> dict[str, Any]:
    """The machine, from ``device_run.sh``'s ``env.json`` in ``out`` when there is one: a
    driver that asks CUDA itself holds a context while its parts run, and on a GPU in
    EXCLUSIVE_PROCESS mode every part's process would then fail to get one."""
    env = _load(out / "env.json") if out is not None else None
    if isinstance(env, dict) and env.get("device"):
        keys = ("torch", "cuda", "device", "nccl", "python", "compute_mode")
        return {key: env.get(key) for key in keys}
    nccl: Any = None
    with contextlib.suppress(Exception):
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "nccl": nccl,
        "python": platform.python_version(),
    }


def plan_text() -> str:
    """The parts, their limits and their checks."""
    lines = []
    for part, checks in CHECKS.items():
        lines.append(f"part {part}  {PART_TIMEOUT_S[part]:>4} s  {PART_SETUP[part]}")
        lines += [f"    {cid:<5} {name}" for cid, name in checks.items()]
    lines.append(f"total: {sum(PART_TIMEOUT_S.values())} s")
    return "\n".join(lines)


def _load(path: Path) -> Any:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text(encoding="utf-8"))
    return None


def _first_line(text: str, width: int = 150) -> str:
    line = next((x.strip() for x in str(text).splitlines() if x.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def _num(value: Any, fmt: str = ".3g") -> str:
    return "n/a" if not isinstance(value, (int, float)) else format(value, fmt)


def summarize(out: Path) -> str:
    """The summary of a run's folder (``device_run.sh``'s ``OUTDIR``): every check's
    status, then the overlap benchmark's share and H2D bandwidth; from whatever the run
    left there, a run cut off included."""
    lines = []
    env = _load(out / "env.json") or {}
    dev = env.get("device") or "an unknown device"
    lines.append(
        f"tensorcast GPU run on {dev}: torch {env.get('torch', '?')}, CUDA "
        f"{env.get('cuda', '?')}, NCCL {env.get('nccl', '?')}, python {env.get('python', '?')}"
    )
    counts: collections.Counter[str] = collections.Counter()
    failed: list[str] = []
    for part in CHECKS:
        doc = _load(out / f"part-{part}.json")
        if doc is not None:
            verdicts = doc.get("checks", [])
            o = doc.get("outcome", {})
            rcs = ", ".join(
                f"{t} rc={p.get('rc')}{' timed out' if p.get('timed_out') else ''}"
                for t, p in o.get("processes", {}).items()
            )
            lines.append(f"part {part}: {o.get('seconds')} s of {o.get('limit_s')} s ({rcs})")
        else:
            records = [
                r for f in sorted(out.glob(f"part-{part}.*.jsonl")) for r in _read_records(f)
            ]
            started = any(out.glob(f"part-{part}.*"))
            verdicts = _verdicts(part, records, None)
            if not started:
                for v in verdicts:
                    v["detail"] = "not run: the part did not start"
            lines.append(
                f"part {part}: "
                + ("cut off; verdicts from the records it wrote" if started else "not run")
            )
        for v in verdicts:
            counts[v["status"]] += 1
            if v["status"] == "FAIL":
                failed.append(v["id"])
            line = f"  {v['status']:<4}  {v['id']:<5} {v['name']}"
            if v["status"] != "PASS" and v.get("detail"):
                line += f": {_first_line(v['detail'])}"
            lines.append(line)
    overlap = _load(out / "overlap.json")
    if overlap is None:
        lines.append("overlap: not run (no overlap.json)")
    elif "error" in overlap or "skipped" in overlap:
        lines.append(f"overlap: {_first_line(overlap.get('error') or overlap.get('skipped'))}")
    else:
        prof = overlap.get("profiler") or {}
        plain = overlap.get("plain_pinned_copy_GBps") or {}
        lines.append(
            f"overlap: hidden share {_num(prof.get('hidden_share'))} (profiler), "
            f"{_num(overlap.get('hidden_share_from_step_times'))} (step times); step "
            f"{_num(overlap.get('step_ms_compute_only'))} ms alone, "
            f"{_num(overlap.get('step_ms_with_loader'))} ms with the loader"
        )
        lines.append(
            f"H2D: loader {_num(prof.get('upload_GBps'))} GB/s against a plain pinned copy_ "
            f"{_num(plain.get('idle'))} GB/s idle ({_num(plain.get('under_the_matmuls'))} GB/s "
            f"under the matmuls): ratio {_num(overlap.get('h2d_bandwidth_ratio'))}"
        )
    lines.append(
        f"checks: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP"
        + (f"; failed: {' '.join(failed)}" if failed else "")
    )
    return "\n".join(lines) + "\n"


def write_summary(out: Path) -> str:
    text = summarize(out)
    (out / "summary.txt").write_text(text, encoding="utf-8")
    return text


def _end_by(deadline: float) -> None:
    """End this process at ``deadline`` (``time.time()``) whatever it is doing: a part's
    process outlives a driver that was killed (it has a session of its own)."""

    def watch() -> None:
        time.sleep(max(0.0, deadline - time.time()))
        print("past the part's deadline: this process ends itself", flush=True)
        os._exit(124)

    threading.Thread(target=watch, name="gpu-check-deadline", daemon=True).start()


def _no_cuda_reason() -> str:
    built = "a CPU-only build" if torch.version.cuda is None else "no visible CUDA device"
    return f"needs CUDA: torch {torch.__version__} has {built}; nothing was checked"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--parts", default="A,B,C", help="which parts to run (default: A,B,C)")
    parser.add_argument(
        "--out", metavar="DIR", help="write each part's verdicts, records and logs here as it ends"
    )
    parser.add_argument("--json", help="also write every check's verdict and report here")
    parser.add_argument(
        "--deadline",
        type=float,
        metavar="EPOCH",
        help="the time (seconds since the epoch) by which a part must be done, at the latest",
    )
    parser.add_argument("--plan", action="store_true", help="print the parts and checks; exit")
    parser.add_argument("--summary", metavar="DIR", help="write DIR/summary.txt of a run; exit")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # a part's own process
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--store-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plan:
        print(plan_text())
        return 0
    if args.summary:
        print(write_summary(Path(args.summary)), end="")
        return 0
    parts = [p.strip().upper() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in CHECKS]
    if unknown:
        parser.error(f"unknown parts {unknown}; the parts are {sorted(CHECKS)}")
    if not torch.cuda.is_available():
        reason = _no_cuda_reason()
        print(reason)
        print(plan_text())
        for path in (args.json, args.out and Path(args.out) / "skipped.json"):
            if path:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).write_text(json.dumps({"skipped": reason}, indent=1) + "\n")
        return SKIPPED
    if args.part is not None:  # inside a part's process
        if args.deadline:
            _end_by(args.deadline)
        rec = Recorder(args.results, args.part, args.rank)
        if args.part == "A":
            part_a(rec)
        elif args.part == "B":
            part_b(rec, args.rank, args.store_dir)
        else:
            part_c(rec, args.store_dir)
        return 0
    with tempfile.TemporaryDirectory(prefix="tensorcast-gpu-") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        device = _describe_device(out)
        document: dict[str, Any] = {**device, "parts": {}, "checks": []}
        print(f"tensorcast GPU checks on {device['device']} (torch {device['torch']})", flush=True)
        for i, part in enumerate(parts):
            # The first part's clock started with this process (its imports count).
            spent = time.monotonic() - _STARTED if i == 0 else 0.0
            deadline = time.time() - spent + PART_TIMEOUT_S[part] - DRIVER_MARGIN_S
            if args.deadline:  # device_run.sh's: its hard limit less what writing takes
                deadline = min(deadline, args.deadline - 5)
            records, outcome = _run_part(part, out, Path(tmp), deadline)
            verdicts = _verdicts(part, records, outcome["processes"])
            for p in outcome["processes"].values():
                del p["log"]
            document["parts"][part] = outcome
            document["checks"] += verdicts
            part_doc = {**device, "part": part, "outcome": outcome, "checks": verdicts}
            (out / f"part-{part}.json").write_text(
                json.dumps(part_doc, indent=1, default=str) + "\n"
            )
            if args.json:
                Path(args.json).write_text(json.dumps(document, indent=1, default=str) + "\n")
            for v in verdicts:
                print(f"{v['status']:<4}  {v['id']:<5} {v['name']}", flush=True)
                if v["status"] != "PASS":
                    print("      " + v["detail"].replace("\n", "\n      "))
            if any(p["timed_out"] or p["rc"] for p in outcome["processes"].values()):
                for tag, p in outcome["processes"].items():
                    print(f"--- {tag}: rc={p['rc']}, timed out: {p['timed_out']}; its output ends:")
                    print(p["log_tail"][-2000:])
            if args.out:
                write_summary(out)
    document["passed"] = all(v["status"] != "FAIL" for v in document["checks"])
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1, default=str) + "\n")
    statuses = collections.Counter(v["status"] for v in document["checks"])
    failed = [v["id"] for v in document["checks"] if v["status"] == "FAIL"]
    print(
        f"{statuses['PASS']} passed, {statuses['FAIL']} failed, {statuses['SKIP']} skipped "
        f"{failed or ''}".rstrip()
    )
    return 0 if document["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
