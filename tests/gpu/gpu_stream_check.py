"""Check the CUDA paths on a machine with one GPU: PASS / FAIL per check.

    python tests/gpu/gpu_stream_check.py [--json out.json] [--parts A,B,C]

Exit status: 0 when every check passed; 1 when a check failed or a part did not finish
within its time; 77 when no CUDA device is visible (nothing is checked: 77 is the
"skipped" status of test drivers).

Each part runs in processes of its own under a hard timeout, so a hang fails that part
and the next one still runs; every check's outcome is written as soon as it is known, so
a part killed half-way keeps what it had. GPU streams are made busy with
``torch.cuda._sleep``, calibrated once per process (cycles per millisecond). A batch's
device work is posted on the caller's thread, on tensorcast's transfer stream, which
first waits on the caller's current stream; the caller's current stream then waits on an
event, and the buffer is recorded on it (see ``transport/device.py``). These checks hold
the library to that, on a real device. One GPU cannot hold a multi-rank NCCL group, so
they check what one GPU can (``benchmarks/multi_gpu_check.py`` has the rest):

Part A, one process, no process group:

- R1-R6: round trips: pack / unpack of CUDA trees of every dtype, leaves that view the
  buffer, a CPU tree packed onto the GPU, unpack onto the GPU, numpy leaves of a GPU
  buffer, ``Packed.pin_memory``.
- T1: a real sender and receiver (over the shipped in-memory wire) that hand out CUDA
  trees: a tree read on a side stream behind a 200 ms sleep, then dropped, is not
  overwritten by the next frame; with a consumer on one side stream and the next frame
  taken on another, and with an explicit ``record_stream`` on a third.
- T2: host syncs of ``tc.pack`` / ``tc.unpack``, counted under
  ``set_sync_debug_mode("warn")``: none for a tensor-only CUDA tree, none for a CPU tree
  packed onto the GPU; the counts with an ndarray leaf and a 4 KiB str reported.
- T3: pinned staging (``BufferPool`` over ``CudaStreams.host``, uploads held until their
  event is seen done): a steady size reuses its buffers; 50 sizes from 1-64 MiB keep the
  pinned memory bounded by the size classes, not by the number of frames.

Part B, two gloo ranks sharing the GPU (a FileStore; a new process group per check):

- R7: ``tc.broadcast`` and a loader pass of CUDA batches of every dtype, received on the GPU.
- T4: a consumer on a side stream, with a 300 ms sleep queued on the *default* stream
  before every ``next()`` / ``broadcast()``: each batch it snapshots on its stream is that
  step's, for ``tc.broadcast`` inline, the loader at ``prefetch`` 1 and 2, and a
  ``tc.broadcast`` made while a loader step is on the lane (so its host work runs on the
  lane's worker).
- T5: whole passes of tensor-only batches under ``set_sync_debug_mode("error")`` at
  ``prefetch`` 0, 1 and 2 raise nothing; syncs per batch with ``verify=True`` and with an
  ndarray leaf reported (``"warn"``).
- T6: a CUDA graph captured on the main thread after every ``next()`` while the loader
  prefetches (the source sleeps 20 ms per batch), 20 steps at ``prefetch`` 1 and 2: no
  capture error, the lane not broken, every batch right.
- T7: under ``torch.profiler``, a receiver's lane worker makes no CUDA stream, event,
  copy or memory call (every one comes from the training thread); the source iterator's
  current device and stream (it runs on the worker) reported, the stream the default one.

Part C, an NCCL group of one (``init_process_group("nccl", world_size=1, device_id=...)``):

- R8: CUDA and CPU trees of every dtype, a large tree that is a copy of the source's
  input, a pre-packed batch with ``device="cpu"``.
- T8: with the default stream busy for 1 s, a 64 MiB CPU tree broadcast from inside
  ``torch.cuda.stream(s)`` returns in under 50 ms and is ready on ``s`` in under 100 ms
  (the default stream still busy); the same with the host work forced onto the worker.
- T9: the source's own tree, read on a side stream behind a 200 ms sleep and dropped, is
  not overwritten by the next broadcast (the library's hand-over, and an explicit
  ``record_stream``).
- T10: a CPU ``tc.pack`` broadcasts to CUDA leaves with equal bytes; with ``device="cpu"``
  equal bytes, its syncs reported.
- T11: syncs per broadcast: none for a CUDA tensor-only tree; reported for a CUDA tree
  with an ndarray and a 4 KiB str (and how long it returns when the stream is busy), a
  CPU tree with an ndarray, and a channel with ``verify=True``, where a CUDA batch is a
  ``ValueError`` and the channel goes on.
- T12: a real ``Sender`` and ``Receiver`` on real lanes, over a wire whose heads move in
  memory and whose payloads are CUDA copies with NCCL's stream contract (posted behind the
  posting thread's current stream, on a stream of their own; waiting makes the current
  stream wait): consumers on alternating side streams, the default stream busy before
  every step, ``prefetch`` 1 and 2: every snapshot that step's, a late read of a dropped
  tree still that step's, every payload posted by a consumer thread.
- T13: the process's thread count after ``destroy_process_group`` and ``gc.collect()``
  is within 2 of a plain NCCL cycle's, twice; no "destroyed without shutdown" warning;
  the process exits within 30 s of its last check; the first broadcast's time reported.
- T14: ``lane.break_`` with a payload queued behind a 2 s sleep returns within 10 s, the
  next ``tc.broadcast`` raises ``PeerError`` within 10 s, and the device drains (weak on
  one rank: the collective has no peer to wait for).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import gc
import itertools
import json
import os
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
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

import tensorcast as tc
from tensorcast.codec.dtypes import TORCH_CODES
from tensorcast.transport import groups as _groups
from tensorcast.transport.agreement import ranks_name
from tensorcast.transport.channel import open_channel
from tensorcast.transport.device import CudaStreams, DevicePart, Inflight, Streams
from tensorcast.transport.frame import Kind, Stamp
from tensorcast.transport.groups import Group
from tensorcast.transport.lane import Lane
from tensorcast.transport.pool import BufferPool
from tensorcast.transport.receiver import Receiver
from tensorcast.transport.sender import Sender
from tensorcast.transport.testing import FakeWire
from tensorcast.transport.wire import Wire

SKIPPED = 77
ROOT = Path(__file__).resolve().parents[2]
#: each part's hard limit, its processes' start-up included
PART_TIMEOUT_S = {"A": 120.0, "B": 240.0, "C": 300.0}
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
    },
    "B": {
        "R7": "gloo ranks sharing the GPU: CUDA batches of every dtype",
        "T4": "a consumer on a side stream sees each step's batch, the default stream busy",
        "T5": "whole passes under sync-debug 'error'; syncs with verify / ndarray",
        "T6": "CUDA graph capture between next() calls while prefetching",
        "T7": "the lane's worker makes no CUDA stream call on a receiver",
    },
    "C": {
        "R8": "NCCL group of one: trees, a copy of the input, a pre-packed batch",
        "T8": "a broadcast is independent of the default stream and returns at once",
        "T9": "the source's own tree is not overwritten under a side-stream read",
        "T10": "a CPU Packed broadcasts to CUDA leaves",
        "T11": "host syncs per broadcast",
        "T12": "sender / receiver on real lanes over CUDA-stream payloads",
        "T13a": "no thread left after destroy_process_group",
        "T13b": "no 'destroyed without shutdown' warning",
        "T13c": "the process exits within 30 s of its last check",
        "T14": "lane.break_ returns, the next broadcast raises PeerError",
    },
}
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


# -- recording ------------------------------------------------------------------------


class Failed(AssertionError):
    """A check's assertion, with what it measured."""

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

    def run(self, cid: str, fn: Callable[[], Any]) -> bool:
        started = time.perf_counter()
        report: Any = {}
        try:
            report = fn()
            status, detail = "PASS", ""
        except Failed as e:
            status, detail, report = "FAIL", str(e), e.report
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
        print(f"[part {self.part}{who}] {status} {cid}", flush=True)
        return status == "PASS"


# -- streams, events and syncs ---------------------------------------------------------


class Sleeper:
    """``torch.cuda._sleep`` in milliseconds, calibrated once on this device."""

    def __init__(self) -> None:
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
        self.cycles_per_ms = cycles / statistics.median(times)

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
    thread of this process, and the Python lines that made them."""

    def __init__(self) -> None:
        self.count = 0
        self.sites: dict[str, int] = {}

    def __enter__(self) -> SyncCount:
        torch.cuda.synchronize()
        self._catch = warnings.catch_warnings(record=True)
        self._log = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(None, None, None)
        syncs = [w for w in self._log if "synchroniz" in str(w.message)]
        self.count = len(syncs)
        self.sites = dict(collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs))


def cuda_calls_by_thread(trace_path: str) -> dict[int, dict[str, int]]:
    """The CUDA runtime and driver calls of a ``torch.profiler`` chrome trace, by thread
    (the system thread id, as ``threading.get_native_id`` gives it)."""
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


def t1_dropped_tree_not_overwritten(dev: torch.device, sleeper: Sleeper) -> dict[str, Any]:
    """The gloo path with ``device="cuda"`` (the source's own tree and a receiver's, each
    uploaded from pinned staging), on a real Sender and Receiver over the in-memory wire."""
    n = 32 << 20
    wires = FakeWire.pair()
    lanes = [Lane(f"check-a{w.rank}", w.abort) for w in wires]
    # (FakeWire's streams are the host fake's type; these ends have none)
    groups = [Group((0, 1), cast(Wire, w), lane) for w, lane in zip(wires, lanes)]
    sender = Sender(groups[0], 0, timeout=TD)
    receiver = Receiver(groups[1], 0, 0, lambda *_: "the in-memory source is fine")
    report: dict[str, Any] = {}

    def frame(step: int) -> dict[str, DevicePart]:
        out, own = sender.data(
            {"x": torch.full((n,), step, dtype=torch.uint8)}, Stamp(1, 0, step), dev
        )
        sender.send(out, TD)  # the in-memory source posts at once; the receiver reads after
        kind, part = receiver.recv(Stamp(1, 0, step), dev, TD)
        expect(kind == Kind.DATA, f"step {step}: a {kind!r} frame")
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
                lambda buffer: buffer,
                fill=upload,
                kept=staging,
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
    if stats is not None and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
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
    if stats is not None and before is not None:
        grew = stats().get("allocated_bytes.peak", 0) - before
        report["host_allocated_bytes_growth_peak"] = grew
        # The pool keeps 4 idle buffers and two more are in flight: at most 6 alive, each
        # in one power-of-two class from 1 to 64 MiB (the host allocator rounds to those).
        bound = 6 * sum(1 << k for k in range(20, 27))
        report["bound_bytes"] = bound
        expect(grew <= bound, f"pinned memory grew by {grew} bytes (bound {bound})", report)
    return report


# -- part B: two gloo ranks sharing the GPU ---------------------------------------------


def part_b(rec: Recorder, rank: int, store_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.cuda.set_device(0)
    sleeper = Sleeper()
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
    rec.run("T6", in_world(lambda: t6_graph_capture(rank)))
    rec.run("T7", in_world(lambda: t7_worker_cuda_calls(rank, store_dir)))


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

    def with_array(step: int) -> dict[str, Any]:
        return {**small(step), "feats": np.full(1000, step, dtype=np.float32)}

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
    for name, passes in (
        ("verify=True", loader(1, small, verify=True)),
        ("one ndarray leaf", loader(1, with_array)),
    ):
        with SyncCount() as syncs:
            got = [b["x"][:4096].clone() for b in passes]
        expect(len(got) == 6, f"{name}: {len(got)} batches")
        report[name] = {"syncs_per_batch": syncs.count / 6, "sites": syncs.sites}
    return report


def t6_graph_capture(rank: int) -> dict[str, Any]:
    static = torch.zeros(1 << 16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch's docs ask
        for _ in range(3):
            static * 2
    torch.cuda.current_stream().wait_stream(side)
    report: dict[str, Any] = {}
    for prefetch in (1, 2):
        loader = tc.BroadcastingDataLoader(
            Source(20, step_batch, sleep_s=0.02) if rank == 0 else None,
            group=dist.group.WORLD,
            src=0,
            prefetch=prefetch,
            device="cuda",
            timeout=TIMEOUT_S,
        )
        errors: list[str] = []
        snaps = []
        try:
            for step, batch in enumerate(loader):
                snaps.append((step, batch["x"][:4096].clone()))
                del batch
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph):
                        y = static
                        for _ in range(50):
                            y = y * 1.0001
                    graph.replay()
                except RuntimeError as e:
                    errors.append(f"step {step}: capture: {e}")
        except Exception as e:
            errors.append(f"the pass: {type(e).__name__}: {e}")
        torch.cuda.synchronize()
        broken = _lane().broken
        report[f"prefetch={prefetch}"] = {
            "steps": len(snaps),
            "errors": errors[:3],
            "broken": repr(broken),
        }
        expect(not errors, f"prefetch {prefetch}: {errors[:3]}", report)
        expect(broken is None, f"prefetch {prefetch}: the lane broke: {broken!r}", report)
        expect(len(snaps) == 20, f"prefetch {prefetch}: {len(snaps)} steps", report)
        bad = wrong_steps(snaps)
        expect(not bad, f"prefetch {prefetch}: wrong batches {bad}", report)
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
    expect(
        main in calls,
        "the trace attributes no CUDA call to the training thread: its thread ids cannot be "
        "compared here",
        report,
    )
    expect(not others, f"threads other than the training thread made CUDA calls: {others}", report)
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
            if cid not in ("T13b", "T13c"):
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
    _init_nccl(store_dir, "world-3")
    rec.run("T14", lambda: t14_break(sleeper))
    dist.destroy_process_group()
    rec.run("T12", lambda: t12_sender_receiver_on_cuda_streams(sleeper))
    rec.write({"event": "done", "time": time.time()})


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
                lane.submit(lambda: time.sleep(0.05))  # the broadcast's job queues behind
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
    # (d) a channel with verify=True: a CPU batch travels; a CUDA batch is a ValueError
    channel, _ = open_channel(
        ranks_name((0,)), (0,), 0, "the verify check", {"check": "verify"}, verify=True
    )
    lane = channel.group.lane

    def send(tree: Any) -> Any:
        return channel.hand_out(
            lane.run(lambda: channel.send_batch(tree, None), lambda: channel.step)
        )

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
    expect(lane.broken is None, f"(d) the channel broke: {lane.broken!r}", report)
    same(cpu, send(cpu), "(d) after the refused batch")
    expect(per == 0, f"(a) a CUDA tensor-only tree: {per} syncs per broadcast", report)
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
    streams: Streams | None

    def __init__(self, heads: FakeWire, payloads: queue.Queue[Any], device: torch.device) -> None:
        self._heads = heads
        self._payloads = payloads
        self.rank = heads.rank
        self.device = device
        self.streams = CudaStreams(device)  # each end its own transfer stream, as two ranks
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


def t12_sender_receiver_on_cuda_streams(sleeper: Sleeper) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for ahead in (1, 2):
        report[f"ahead={ahead}"] = _t12_pair(sleeper, ahead, report)
    return report


def _t12_pair(sleeper: Sleeper, ahead: int, report: dict[str, Any]) -> dict[str, Any]:
    """One source and one receiver, each a consumer thread that keeps ``ahead`` steps
    submitted to its lane (with 2, it posts the next batch's device work at each step, as
    a loader at ``prefetch=2`` does)."""
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
    receiver = Receiver(groups[1], 0, 0, lambda *_: "the in-memory source is fine")

    def send(i: int) -> Any:
        # odd steps: a CUDA batch made on the lane's worker, as a source iterator makes it
        frame, own = sender.data(
            step_batch(i + 1, "cuda" if i % 2 else "cpu"), Stamp(1, 0, i), None
        )
        sender.send(frame, TD)
        return own

    def recv(i: int) -> Any:
        kind, part = receiver.recv(Stamp(1, 0, i), None, TD)
        expect(kind == Kind.DATA, f"step {i}: a {kind!r} frame")
        return part

    out: dict[str, Any] = {}

    def consumer(name: str, lane: Lane, step_fn: Callable[[int], Any]) -> None:
        try:
            side = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))
            jobs: list[Any] = []

            def submit() -> None:
                i = len(jobs)
                jobs.append(lane.submit(lambda: step_fn(i)))

            for _ in range(ahead):
                submit()
            snaps: list[tuple[int, torch.Tensor]] = []
            lates: list[tuple[int, torch.Tensor]] = []
            for i in range(steps):
                part = jobs[i].result()
                sleeper.sleep(300)  # this thread's default stream, before each step
                with torch.cuda.stream(side[i % 2]):  # the next step is taken on the other
                    tree = part.take()
                    snaps.append((i + 1, tree["x"][:4096].clone()))
                    if ahead >= 2 and i + 1 < len(jobs):  # as a loader posts ahead
                        jobs[i + 1].result().post()
                    sleeper.sleep(200)
                    lates.append((i + 1, tree["x"][-4096:].clone()))
                del tree, part
                jobs[i] = None
                if len(jobs) < steps:
                    submit()
            torch.cuda.synchronize()
            out[name] = (wrong_steps(snaps), wrong_steps(lates))
        except BaseException as e:
            out[name] = e

    threads = [
        threading.Thread(target=consumer, args=("source", lanes[0], send), name="source-main"),
        threading.Thread(target=consumer, args=("receiver", lanes[1], recv), name="receiver-main"),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
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


# -- the driver ---------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _run_part(part: str, tmp: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run one part's processes under its timeout; every record they wrote, and how they ended."""
    ranks: list[int | None] = [0, 1] if part == "B" else [None]
    stores = tmp / f"stores-{part}"
    stores.mkdir()
    procs = []
    for rank in ranks:
        tag = part if rank is None else f"{part}{rank}"
        results, log = tmp / f"{tag}.jsonl", tmp / f"{tag}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part]
        cmd += ["--results", str(results), "--store-dir", str(stores)]
        if rank is not None:
            cmd += ["--rank", str(rank)]
        with open(log, "w", encoding="utf-8") as out:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=_child_env(), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # one process group each: killed whole on a hang
            )  # fmt: skip
        procs.append((tag, proc, results, log))
    started = time.monotonic()
    deadline = started + PART_TIMEOUT_S[part]
    ended: dict[str, float] = {}
    while len(ended) < len(procs) and time.monotonic() < deadline:
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
    outcome: dict[str, Any] = {"seconds": round(time.monotonic() - started, 1), "processes": {}}
    for tag, proc, results, log in procs:
        text = log.read_text(encoding="utf-8", errors="replace")
        if results.exists():
            for line in results.read_text(encoding="utf-8").splitlines():
                records.append(json.loads(line))
        outcome["processes"][tag] = {
            "rc": proc.returncode,
            "timed_out": tag in timed_out,
            "ended": ended.get(tag),
            "log_tail": text[-4000:],
            "log": text,
        }
    return records, outcome


def _verdicts(
    part: str, records: list[dict[str, Any]], outcome: dict[str, Any]
) -> list[dict[str, Any]]:
    """One verdict per check of ``part``: PASS only where every process that runs it passed."""
    procs = outcome["processes"]
    expected_ranks = 2 if part == "B" else 1
    verdicts = []
    for cid, name in CHECKS[part].items():
        mine = [r for r in records if r.get("id") == cid]
        if part == "C" and cid in ("T13b", "T13c"):
            mine = [_driver_check(cid, records, procs["C"])]
        status = "PASS"
        details = []
        if len(mine) < expected_ranks:
            status = "FAIL"
            how = ", ".join(
                f"{tag}: rc={p['rc']}{' (timed out)' if p['timed_out'] else ''}"
                for tag, p in procs.items()
            )
            details.append(f"did not run everywhere ({how})")
        for r in mine:
            if r["status"] != "PASS":
                status = "FAIL"
                who = "" if r.get("rank") is None else f"rank {r['rank']}: "
                details.append(who + r["detail"])
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


def _driver_check(cid: str, records: list[dict[str, Any]], proc: dict[str, Any]) -> dict[str, Any]:
    """T13b and T13c, judged from outside part C's process: its output and its exit."""
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


def _describe_device() -> dict[str, Any]:
    nccl: Any = None
    with contextlib.suppress(Exception):
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "nccl": nccl,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", help="write every check's verdict and report here")
    parser.add_argument("--parts", default="A,B,C", help="which parts to run (default: A,B,C)")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # a part's own process
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--store-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        built = "a CPU-only build" if torch.version.cuda is None else "no visible CUDA device"
        reason = f"needs CUDA: torch {torch.__version__} has {built}; nothing was checked"
        print(reason)
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": reason}, indent=1) + "\n")
        return SKIPPED
    if args.part is not None:  # inside a part's process
        rec = Recorder(args.results, args.part, args.rank)
        if args.part == "A":
            part_a(rec)
        elif args.part == "B":
            part_b(rec, args.rank, args.store_dir)
        else:
            part_c(rec, args.store_dir)
        return 0
    parts = [p.strip().upper() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in CHECKS]
    if unknown:
        parser.error(f"unknown parts {unknown}; the parts are {sorted(CHECKS)}")
    document: dict[str, Any] = {**_describe_device(), "parts": {}, "checks": []}
    print(f"tensorcast GPU checks on {document['device']} (torch {document['torch']})", flush=True)
    with tempfile.TemporaryDirectory(prefix="tensorcast-gpu-") as tmp:
        for part in parts:
            records, outcome = _run_part(part, Path(tmp))
            verdicts = _verdicts(part, records, outcome)
            for p in outcome["processes"].values():
                del p["log"]
            document["parts"][part] = outcome
            document["checks"] += verdicts
            for v in verdicts:
                print(f"{v['status']}  {v['id']:<5} {v['name']}", flush=True)
                if v["status"] != "PASS":
                    print("      " + v["detail"].replace("\n", "\n      "))
            if any(p["timed_out"] or p["rc"] for p in outcome["processes"].values()):
                for tag, p in outcome["processes"].items():
                    print(
                        f"--- part {tag}: rc={p['rc']}, timed out: {p['timed_out']}; its output ends:"
                    )
                    print(p["log_tail"][-2000:])
    document["passed"] = all(v["status"] == "PASS" for v in document["checks"])
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1, default=str) + "\n")
    failed = [v["id"] for v in document["checks"] if v["status"] != "PASS"]
    print(f"{len(document['checks']) - len(failed)} passed, {len(failed)} failed {failed or ''}")
    return 0 if document["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
