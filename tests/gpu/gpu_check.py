"""Check the CUDA code paths on a machine with one GPU (prints PASS / FAIL per check).

One GPU cannot host a multi-rank NCCL group, so this checks what one GPU can:

1. single process: pack / unpack of CUDA trees of every dtype, a CPU tree packed onto
   the GPU (pinned staging), unpack onto the GPU, numpy leaves of a GPU buffer coming
   back as CPU arrays, ``Packed.pin_memory``;
2. gloo ranks sharing the GPU: ``tc.broadcast`` and a ``BroadcastingDataLoader`` pass of
   CUDA batches, receivers asking for ``device="cuda"`` and running under
   ``torch.cuda.set_sync_debug_mode("error")``: no host-device sync on receivers;
3. an NCCL group of one rank: the source's side of the NCCL path (the gloo group for
   headers, the payload on NCCL, CPU trees staged through pinned memory).

    python tests/gpu/gpu_check.py [--world-size 2]

Exit code 0 when every check passes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tensorcast as tc
from tensorcast.codec.dtypes import TORCH_CODES


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


def _same(a: object, b: object) -> bool:
    diff = _diff(a, b)
    if diff is not None:
        raise AssertionError(diff)  # the check's report shows where
    return True


def _batch(device: str, step: int = 0) -> dict[str, object]:
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


def single_process() -> list[tuple[str, bool, str]]:
    results = []

    def check(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        try:
            ok = bool(fn())
            results.append((name, ok, ""))
        except Exception:
            results.append((name, False, traceback.format_exc()))

    cuda_tree = _batch("cuda")
    cpu_tree = _batch("cpu")
    check("pack/unpack a CUDA tree", lambda: _same(cuda_tree, tc.unpack(tc.pack(cuda_tree))))
    check(
        "unpacked CUDA leaves view the buffer",
        lambda: tc.unpack(p := tc.pack(cuda_tree))["audio"].data_ptr() >= p.buffer.data_ptr(),
    )
    check(
        "CPU tree packed onto the GPU",
        lambda: _same(cpu_tree, tc.unpack(tc.pack(cpu_tree, device="cuda"), device="cpu")),
    )
    check(
        "unpack onto the GPU",
        lambda: tc.unpack(tc.pack(cpu_tree), device="cuda")["audio"].is_cuda,
    )
    check(
        "numpy leaves of a GPU buffer come back on the CPU",
        lambda: isinstance(tc.unpack(tc.pack({"a": np.arange(5)}, device="cuda"))["a"], np.ndarray),
    )
    check("Packed.pin_memory", lambda: tc.pack(cpu_tree).pin_memory().buffer.is_pinned())
    return results


def _rank(rank: int, world: int, store_path: str, queue: object) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    results = []
    try:
        for step in range(3):  # warm up pools and the caching allocators
            tc.broadcast(_batch("cuda", step) if rank == 0 else None, 0, device="cuda")
        torch.cuda.synchronize()
        if rank != 0:
            torch.cuda.set_sync_debug_mode("error")
        for step in range(3, 8):
            out = tc.broadcast(_batch("cuda", step) if rank == 0 else None, 0, device="cuda")
            results.append(out["audio"].is_cuda)
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        ok = all(results) and _same(_batch("cuda", 7), out)
        loader = tc.BroadcastingDataLoader(
            source=[_batch("cuda", s) for s in range(4)] if rank == 0 else None,
            group=dist.group.WORLD,
            src=0,
            prefetch=1,
            device="cuda",
        )
        got = list(loader)
        ok = ok and all(_same(_batch("cuda", s), b) for s, b in enumerate(got))
        queue.put((rank, ok, ""))  # type: ignore[attr-defined]
    except Exception:
        queue.put((rank, False, traceback.format_exc()))  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def shared_gpu(world: int) -> list[tuple[str, bool, str]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"), queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out = []
        for _ in range(world):
            rank, ok, err = queue.get(timeout=300)
            out.append((f"gloo rank {rank} sharing the GPU (receivers sync-free)", ok, err))
        for p in procs:
            p.join(30)
    return sorted(out)


def _nccl_rank(store_path: str, queue: object) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    try:
        out = []
        for step in range(3):
            for device in ("cuda", "cpu"):
                batch = _batch(device, step)
                got = tc.broadcast(batch, 0)
                diff = _diff(batch, got) or ("" if got["audio"].is_cuda else "not on cuda")
                out.append((f"NCCL group of one: a {device} tree, step {step}", not diff, diff))
        big = {"audio": torch.randn(4, 1 << 20, device="cuda"), "lens": torch.arange(4)}
        big["lens"] = big["lens"].cuda()
        for step in range(2):  # a large tree: the source's own tree must be a copy, never its input
            got = tc.broadcast(big, 0)
            diff = _diff(big, got) or ""
            if not diff and got["audio"].data_ptr() == big["audio"].data_ptr():
                diff = "the source's tree aliases its input"
            out.append((f"NCCL group of one: direct leaves, step {step}", not diff, diff))
        got = tc.broadcast(tc.pack(_batch("cpu", 9)), 0, device="cpu")
        diff = _diff(_batch("cpu", 9), got) or ""
        out.append(("NCCL group of one: a pre-packed batch, device='cpu'", not diff, diff))
        queue.put(out)  # type: ignore[attr-defined]
    except Exception:
        queue.put([("NCCL group of one", False, traceback.format_exc())])  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def nccl_single_rank() -> list[tuple[str, bool, str]]:
    """One NCCL rank cannot test receivers, but it runs every step of the source's side."""
    if not dist.is_nccl_available():
        return [("NCCL group of one", False, "NCCL is not available in this torch build")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        proc = ctx.Process(target=_nccl_rank, args=(os.path.join(tmp, "store"), queue))
        proc.start()
        out = queue.get(timeout=300)
        proc.join(30)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    results = single_process() + shared_gpu(args.world_size) + nccl_single_rank()
    for name, ok, err in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
        if err:
            print(err)
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
