"""One benchmark run on every rank a launcher started: the default group, the mesh's
slots, and each workload's interleaved timing and check."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

import tensorcast as tc
from tensorcast.bench import baselines, batches, workloads
from tensorcast.bench.report import Progress, rows, trim_ratios
from tensorcast.bench.timing import (
    METHODS,
    OFF_SHM,
    REFERENCES,
    UNTRIMMED,
    LoaderMethod,
    Slot,
    build_methods,
    close_methods,
    shm_supported,
    time_methods,
    trim_decision_ms,
    trim_supported,
    wire_bytes,
)

__all__ = ["init_default_group", "make_slot", "method_names", "run_workload", "where"]

_SLURM = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"}


def init_default_group(backend: str, timeout_s: float) -> str:
    """Join the default group as the launcher set it up (torchrun's RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT; srun's SLURM_PROCID and SLURM_NTASKS); its backend.

    Raises:
        RuntimeError: no launcher set this process up, or NCCL was asked without CUDA.
    """
    for ours, slurm in _SLURM.items():
        if ours not in os.environ and slurm in os.environ:
            os.environ[ours] = os.environ[slurm]
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"python -m tensorcast.bench runs under a launcher, which sets {', '.join(missing)}: "
            f"torchrun --standalone --nproc_per_node 2 -m tensorcast.bench (or srun, with "
            f"MASTER_ADDR and MASTER_PORT exported)"
        )
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if backend == "auto":
        backend = "nccl" if cuda and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        if not cuda:
            raise RuntimeError("--backend nccl needs CUDA devices; this process sees none")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def make_slot(dp: int | None, cp: int, tp: int) -> tuple[Slot, dict[str, int]]:
    """This rank's slot of a ``(dp, cp, tp)`` mesh laid out as torch's ``init_device_mesh``
    lays it out (tp fastest); every rank creates every slot's group, in the same order.

    Raises:
        ValueError: the mesh's size is not the world's.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    span = cp * tp
    if dp is None:
        dp = world // span if span and world % span == 0 else 0
    if min(dp, cp, tp) < 1 or dp * cp * tp != world:
        raise ValueError(
            f"--dp {dp} --cp {cp} --tp {tp} is a mesh of {dp * cp * tp} ranks but the world "
            f"has {world}; pick sizes whose product is {world}"
        )
    if span == 1:
        raise ValueError(
            "a slot of one rank has nobody to broadcast to: give --tp and/or --cp > 1, or "
            "leave them out to use one group of all ranks"
        )
    mine = None
    for s in range(dp):
        group = dist.new_group(list(range(s * span, (s + 1) * span)))
        if rank // span == s:
            mine = group
    control = dist.new_group(backend="gloo")
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    if mine is None:  # cannot be: every rank is in one slot
        raise RuntimeError(f"rank {rank} is in no slot of a mesh of {world} ranks")
    return Slot(mine, rank // span * span, control, device), {"dp": dp, "cp": cp, "tp": tp}


def where(backend: str, mesh: dict[str, int], slot: Slot) -> dict[str, Any]:
    """The backend, devices and world a run is on, as every report says it."""
    info: dict[str, Any] = {
        "backend": backend,
        "world_size": dist.get_world_size(),
        "mesh": mesh,
        "device": str(slot.device),
        "torch": torch.__version__,
        "tensorcast": tc.__version__,
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
    }
    if slot.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(slot.device)
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def _pinned(batch: Any) -> Any:
    """The batch as a DataLoader with ``pin_memory=True`` hands it out."""
    return tree_map(lambda x: x.pin_memory() if isinstance(x, torch.Tensor) else x, batch)


def _load(spec: str, quick: bool, slot: Slot) -> tuple[Any, int]:
    """The source's batch of ``spec`` (None elsewhere) and its tensor bytes, on every rank."""
    batch, error = None, None
    if slot.is_source:
        builtin = spec in workloads.WORKLOADS
        try:
            batch = (
                workloads.make_workload(spec, quick=quick) if builtin else batches.user_batch(spec)
            )
        except Exception as e:  # every rank learns of it below, instead of waiting
            error = e
        if slot.device.type == "cuda" and error is None:
            batch = _pinned(batch)
    told = [baselines.batch_nbytes(batch) if batch is not None else 0, int(error is not None)]
    sizes = torch.tensor(told, dtype=torch.int64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=slot.control)  # the largest slot's
    if error is not None:
        raise ValueError(f"--batch {spec}: {type(error).__name__}: {error}") from error
    if sizes[1]:
        raise ValueError(f"--batch {spec}: a source rank could not load it (see its error)")
    return batch, int(sizes[0])


def _sources(mine: Any, slot: Slot) -> Any:
    """What this rank's slot's source told every rank (its digests of its batch, one per
    iteration, its wire bytes, its trim decision's cost): ``mine`` on a source, None
    elsewhere."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (slot.src, mine), group=slot.control)
    return {src: d for src, d in everyone if d is not None}[slot.src]


def _checks(got: dict[str, list[str]], want: list[str], slot: Slot) -> list[Any]:
    """Every rank's (failures, batches checked): this rank's digests against its source's,
    gathered from every rank."""
    failures = [
        f"rank {dist.get_rank()} {n}: the batch of iteration {it} differs from the source's"
        for n, digests in got.items()
        for it, (d, w) in enumerate(zip(digests, want))
        if d != w
    ][:10]
    checked = sum(len(d) for d in got.values())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (failures, checked), group=slot.control)
    return gathered


def run_workload(
    spec: str,
    names: list[str],
    iters: int,
    warmup: int,
    quick: bool,
    slot: Slot,
    progress: Progress,
) -> dict[str, Any]:
    """Time every method on one workload; every rank checks every batch a method handed
    it (warmup included) against its source's batch of that iteration, outside the timed
    region: a digest of each, compared after timing."""
    batch, nbytes = _load(spec, quick, slot)
    methods = build_methods(batch, nbytes, slot)
    builtin = spec in workloads.WORKLOADS
    sent: list[str] = []  # on a source: its batch's digest, per iteration
    got: dict[str, list[str]] = {n: [] for n in names if n not in REFERENCES}

    def before(it: int) -> None:
        if builtin and slot.is_source:
            workloads.next_step(spec, batch, it)
            for method in methods.values():
                if isinstance(method, LoaderMethod):
                    method.feed(batch)
        if slot.is_source:
            sent.append(batches.digest(batch))

    def after(it: int, name: str, out: Any) -> None:
        progress.advance(f"{spec}: {name}")
        if name not in REFERENCES:  # their output is no batch
            got[name].append(batches.digest(out))

    try:
        times = time_methods(methods, names, warmup + iters, slot, before, after)
        wire = wire_bytes(methods, batch, nbytes, slot) if slot.is_source else None
    finally:
        close_methods(methods)
    decision = trim_decision_ms(batch, slot.device) if slot.is_source else None
    want, wire, decision = _sources((sent, wire, decision) if slot.is_source else None, slot)
    gathered = _checks(got, want, slot)
    timed = {n: t[warmup:] for n, t in times.items()}
    name = spec if builtin else os.path.basename(spec)
    return {
        "workload": name,
        "nbytes": nbytes,
        "iters": iters,
        "rows": rows(timed, nbytes, wire),
        # each tensorcast method's time trimmed over its time with trim=False
        "trim_over_untrimmed": trim_ratios(timed),
        # the source's Encoder.encode in ms with trim on and off, timed beside the run
        "trim_decision_ms": decision,
        "check_failures": [f for fs, _ in gathered for f in fs],
        # batches checked, by rank: each method's output, every iteration
        "checked": [n for _, n in gathered],
    }


def method_names(selected: list[str] | None) -> list[str]:
    """The methods to run, in table order: ``selected``, or every one this tensorcast
    has (the ``(trim=False)`` ones only where it takes ``trim=``)."""
    if selected is None:
        missing = (() if trim_supported() else UNTRIMMED) + (() if shm_supported() else OFF_SHM)
        return [m for m in METHODS if m not in missing]
    return [m for m in METHODS if m in selected]
