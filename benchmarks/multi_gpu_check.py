"""Checks of the NCCL path that need a GPU per rank, run under torchrun.

One GPU cannot hold a multi-rank NCCL group, so these are apart from
``tests/gpu/gpu_stream_check.py``. One check per run, on every rank:

- ``hang``: a ``(dp, tp=2)`` mesh, a loader at ``--prefetch`` (1 by default) over the tp
  axis, the model's ``all_reduce`` on the mesh's tp group every step, and random CPU
  delays of up to 20 ms at random points of every step on every rank (some steps also
  wait for the GPU): ``--steps`` steps (200) without a hang (a watchdog ends a rank that
  takes longer than ``--limit`` seconds, printing every thread's stack), every batch and
  every all_reduce right.
- ``binding``: the rank's GPU given only by ``init_process_group(device_id=...)``
  (``--binding device_id``) or by a ``torch.cuda.set_device`` made after
  ``init_process_group`` (``--binding late``): tensorcast's device, a broadcast's tree,
  every loader batch and the lane's worker on ``cuda:LOCAL_RANK``, and this process holds
  a CUDA context on that GPU only (asked of the driver; ``nvidia-smi``'s view reported).
- ``kill``: the source dies (``os._exit``, no clean-up) after its gloo head went out and
  before it posts its NCCL payload. Receivers get that broadcast's tree (its payload never
  completes); their next ``tc.broadcast`` raises ``PeerError`` within ``--timeout``. With
  ``--kill-wait`` they call nothing and the lane must break by itself within the timeout
  (its deadline), before NCCL's own watchdog ends the process; the next call then raises
  ``PeerError`` at once. The source exits with status 0 so that torchrun leaves the
  receivers running.

    torchrun --standalone --nproc_per_node 2 benchmarks/multi_gpu_check.py --check hang
    torchrun --standalone --nproc_per_node 4 benchmarks/multi_gpu_check.py --check hang --prefetch 2
    torchrun --standalone --nproc_per_node 2 benchmarks/multi_gpu_check.py --check binding --binding device_id
    torchrun --standalone --nproc_per_node 2 benchmarks/multi_gpu_check.py --check binding --binding late
    torchrun --standalone --nproc_per_node 2 benchmarks/multi_gpu_check.py --check kill
    torchrun --standalone --nproc_per_node 2 benchmarks/multi_gpu_check.py --check kill --kill-wait

Every rank prints one ``RESULT {...}`` line (``--json-dir DIR``: also
``DIR/<check>-rank<r>.json``) and exits 0 when its check passed, 1 when not; 77 (nothing
checked) with fewer GPUs than ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import faulthandler
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a plain copy: nothing installed

import torch
import torch.distributed as dist

import tensorcast as tc
from tensorcast.codec import resolve_device
from tensorcast.transport import groups as _groups

SKIPPED = 77


def _primary_contexts() -> dict[int, bool] | None:
    """Which GPUs this process holds a primary CUDA context on, asked of the driver
    (creates none); None where the driver cannot be asked."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if cuda.cuInit(0) != 0:
        return None
    count = ctypes.c_int()
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return None
    out = {}
    for i in range(count.value):
        dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(dev), i) != 0:
            return None
        if cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) != 0:
            return None
        out[i] = bool(active.value)
    return out


def _nvidia_smi_apps() -> list[dict[str, str]] | None:
    """``nvidia-smi``'s compute processes and their GPU index (its PIDs may be another PID
    namespace's: reported, not asserted)."""
    try:
        gpus = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    index: dict[str, str] = {}
    for line in gpus.splitlines():
        if line:
            gpu, uuid = (s.strip() for s in line.split(",", 1))
            index[uuid] = gpu
    rows = [[s.strip() for s in line.split(",")] for line in apps.splitlines() if line]
    return [{"pid": pid, "gpu": index.get(uuid, uuid)} for pid, uuid in rows]


def _init(local: int, timeout_s: float, *, device_id: bool = True) -> None:
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if device_id:
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group("nccl", **kwargs)


class _Batches:
    """A DP slot's batches; every fifth is made on the GPU inside the source iterator,
    which runs on the lane's worker. Records the device the iterator runs on."""

    def __init__(self, steps: int, slot: int, nbytes: int) -> None:
        self.steps = steps
        self.slot = slot
        self.nbytes = nbytes
        self.devices: set[int] = set()

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Any:
        for step in range(self.steps):
            self.devices.add(torch.cuda.current_device())
            device = "cuda" if step % 5 == 4 else "cpu"
            value = expected(self.slot, step)
            yield {
                "x": torch.full((self.nbytes,), value, dtype=torch.uint8, device=device),
                "step": step,
            }


def expected(slot: int, step: int) -> int:
    return (37 * slot + step) % 256


def check_hang(args: argparse.Namespace, rank: int, local: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    if world % 2:
        raise SystemExit("the hang check needs an even number of ranks (tp=2)")
    torch.cuda.set_device(local)
    _init(local, args.timeout)
    mesh = init_device_mesh("cuda", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    tp_ranks = dist.get_process_group_ranks(tp)
    slot = mesh["dp"].get_local_rank()
    rng = random.Random(1000 + rank)
    source = _Batches(args.steps, slot, 4 << 20) if tc.is_dp_source_rank(mesh, ("tp",)) else None
    loader = tc.BroadcastingDataLoader(
        source, device_mesh=mesh, axes=("tp",), prefetch=args.prefetch, timeout=args.timeout
    )
    faulthandler.dump_traceback_later(args.limit, exit=True)  # a hang: stacks, then exit
    wrong = torch.zeros((), dtype=torch.int64, device="cuda")
    reduced = torch.zeros((), dtype=torch.float64, device="cuda")
    steps = 0
    started = time.perf_counter()

    def pause() -> None:
        if rng.random() < 0.5:
            time.sleep(rng.uniform(0.0, 0.02))

    for step, batch in enumerate(loader):
        pause()
        x = batch["x"]
        wrong += (x[:4096] != expected(slot, step)).sum() + int(batch["step"] != step)
        pause()
        grad = torch.full((1024,), float(rank), device="cuda")
        dist.all_reduce(grad, group=tp)  # the model's own collective, on the mesh's group
        reduced += grad[0].double()
        if rng.random() < 0.1:
            torch.cuda.synchronize()  # a step that waits for the GPU (a logged loss)
        pause()
        steps = step + 1
    torch.cuda.synchronize()
    faulthandler.cancel_dump_traceback_later()
    want = float(sum(tp_ranks)) * steps
    result = {
        "steps": steps,
        "wall_s": round(time.perf_counter() - started, 2),
        "wrong_bytes": int(wrong.item()),
        "all_reduce_sum": float(reduced.item()),
        "all_reduce_expected": want,
        "source_iterator_devices": sorted(source.devices) if source is not None else None,
    }
    result["ok"] = (
        steps == args.steps
        and result["wrong_bytes"] == 0
        and result["all_reduce_sum"] == want
        and (source is None or source.devices == {local})
    )
    dist.barrier()
    dist.destroy_process_group()
    return result


def check_binding(args: argparse.Namespace, rank: int, local: int, world: int) -> dict[str, Any]:
    want = torch.device("cuda", local)
    if args.binding == "device_id":
        _init(local, args.timeout)  # the GPU named here only: no set_device anywhere
    else:
        _init(local, args.timeout, device_id=False)
        torch.cuda.set_device(local)  # late: after init_process_group, before tensorcast
    out = tc.broadcast({"x": torch.arange(4096) + 7} if rank == 0 else None, 0)
    source = _Batches(8, 0, 1 << 20) if rank == 0 else None
    loader = tc.BroadcastingDataLoader(source, group=dist.group.WORLD, src=0, prefetch=2)
    batches = [(b["x"].device, b["step"]) for b in loader]
    state = _groups.world()
    lane = state.group(tuple(range(world))).lane
    ok_values = bool((out["x"].cpu() == torch.arange(4096) + 7).all())
    dist.barrier(device_ids=[local])
    contexts = _primary_contexts()  # before anything of this check's own touches a GPU
    apps = _nvidia_smi_apps()  # no object collective: it would use the current device
    result: dict[str, Any] = {
        "binding": args.binding,
        "tensorcast_device": str(state.device),
        "broadcast_tree_device": str(out["x"].device),
        "loader_devices": sorted({str(d) for d, _ in batches}),
        "lane_worker_device": lane._cuda_device,
        "source_iterator_devices": sorted(source.devices) if source is not None else None,
        "current_device_on_main": torch.cuda.current_device(),
        "device_cuda_means": str(resolve_device("cuda")),
        "primary_contexts": contexts,
        "pid": os.getpid(),
        "nvidia_smi_apps": apps,
    }
    result["ok"] = (
        state.device == want
        and out["x"].device == want
        and ok_values
        and all(d == want for d, _ in batches)
        and [s for _, s in batches] == list(range(8))
        and lane._cuda_device == local
        and (source is None or source.devices == {local})
        and contexts is not None
        and all(active == (i == local) for i, active in contexts.items())
    )
    dist.barrier(device_ids=[local])
    dist.destroy_process_group()
    return result


class _DieAtPayload:
    """The source's wire, ending the process as it is about to post its ``nth`` payload:
    that frame's gloo head has gone out, its NCCL payload never will."""

    def __init__(self, wire: Any, nth: int) -> None:
        self._wire = wire
        self._nth = nth
        self._calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wire, name)

    def head(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Any:
        return self._wire.head(tensor, root, timeout)

    def payload(self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta) -> Any:
        self._calls += 1
        if self._calls == self._nth:
            print(f"RESULT {json.dumps({'rank': 0, 'check': 'kill', 'died': True})}", flush=True)
            os._exit(0)  # status 0: torchrun then leaves the other ranks running
        return self._wire.payload(tensor, root, timeout)


def check_kill(args: argparse.Namespace, rank: int, local: int, world: int) -> dict[str, Any]:
    torch.cuda.set_device(local)
    _init(local, args.timeout)
    batch = {"x": torch.full((8 << 20,), 5, dtype=torch.uint8)}
    wrap = (lambda wire: _DieAtPayload(wire, 3)) if rank == 0 else (lambda wire: wire)
    with _groups.wrapping_wires(wrap):
        for _ in range(2):
            out = tc.broadcast(batch if rank == 0 else None, 0, timeout=args.timeout)
    if rank == 0:
        tc.broadcast(batch, 0, timeout=args.timeout)  # dies posting this payload
        raise AssertionError("the source outlived its payload")
    ok_before = bool((out["x"] == 5).all())
    lane = _groups.world().group(tuple(range(world))).lane
    out = tc.broadcast(None, 0, timeout=args.timeout)  # its head came; its payload never will
    returned = time.perf_counter()
    pending = torch.cuda.Event()
    pending.record()
    result: dict[str, Any] = {
        "mode": "wait" if args.kill_wait else "next call",
        "timeout": args.timeout,
    }
    if args.kill_wait:
        while lane.broken is None and time.perf_counter() - returned < args.timeout + 15:
            time.sleep(0.05)
        result["lane_broke_after_s"] = (
            round(time.perf_counter() - returned, 2) if lane.broken is not None else None
        )
        result["broken_by"] = repr(lane.broken)
    started = time.perf_counter()
    try:
        tc.broadcast(None, 0, timeout=args.timeout)
    except tc.PeerError as e:
        result["peer_error_after_s"] = round(time.perf_counter() - started, 2)
        result["peer_error"] = str(e)[:300]
    except Exception as e:
        result["other_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    drain_started = time.perf_counter()
    while not pending.query() and time.perf_counter() - drain_started < 10:
        time.sleep(0.05)
    result["pending_payload_drained"] = bool(pending.query())
    del out
    limit = args.timeout + 10
    raised = result.get("peer_error_after_s")
    result["ok"] = ok_before and raised is not None and raised <= limit
    if args.kill_wait:
        broke = result["lane_broke_after_s"]
        result["ok"] = (
            result["ok"]
            and broke is not None
            and broke <= args.timeout + 5
            and raised is not None
            and raised < 5
        )
    return result


CHECKS = {"hang": check_hang, "binding": check_binding, "kill": check_kill}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--check", choices=sorted(CHECKS), required=True)
    p.add_argument("--prefetch", type=int, default=1, help="hang: the loader's prefetch")
    p.add_argument("--steps", type=int, default=200, help="hang: steps")
    p.add_argument(
        "--limit", type=float, default=600.0, help="hang: seconds before a rank is ended"
    )
    p.add_argument("--binding", choices=("device_id", "late"), default="device_id")
    p.add_argument("--kill-wait", action="store_true", help="kill: receivers call nothing")
    p.add_argument("--timeout", type=float, default=30.0, help="every wait's timeout (s)")
    p.add_argument("--json-dir", type=Path, help="also write each rank's result here")
    args = p.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        p.error("run it under torchrun (see the commands at the top of this file)")
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible <= local:
        print(
            f"needs a GPU per rank: local rank {local}, {visible} GPU(s) visible; nothing checked"
        )
        return SKIPPED
    result: dict[str, Any] = {"rank": rank, "check": args.check}
    try:
        result.update(CHECKS[args.check](args, rank, local, world))
    except Exception as e:
        result.update(ok=False, error=f"{type(e).__name__}: {e}")
    result["threads"] = sorted(t.name for t in threading.enumerate())
    print(f"RESULT {json.dumps(result, default=str)}", flush=True)
    if args.json_dir is not None:
        args.json_dir.mkdir(parents=True, exist_ok=True)
        name = f"{args.check}-rank{rank}.json"
        (args.json_dir / name).write_text(json.dumps(result, indent=1, default=str) + "\n")
    code = 0 if result.get("ok") else 1
    if args.check == "kill":
        sys.stdout.flush()
        os._exit(code)  # a dead peer in the default group: no clean-up that waits on it
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
