"""Large speech batches from a real lhotse loader, broadcast to TP/CP peers by tensorcast.

What one run does:

1. builds a synthetic corpus offline: N cuts with durations drawn in a range (10-30 s by
   default) at 16 kHz, as in-memory WAV/FLAC bytes (``Recording.from_bytes``) or as
   WAV/FLAC files on disk;
2. spawns ``dp * cp * tp`` local ranks on gloo with a ``("dp", "cp", "tp")`` DeviceMesh;
3. on the source rank of each DP slot, samples the corpus with
   ``DynamicBucketingSampler(max_duration=..., world_size=dp, rank=dp_rank)`` and collates
   padded audio + lengths + texts + ids (+ the cuts with ``--cuts``) in a ``DataLoader``
   with worker processes, packing each batch in the worker (``tc.packed_collate``);
4. wraps it in ``BroadcastingDataLoader`` and runs one epoch on every rank, with a
   progress bar on rank 0;
5. prints batches, hours of audio per second, MB/s, time per batch, and checks that every
   rank of every DP slot received bit-identical batches while different DP slots received
   different ones.

With ``--compare`` the same run then times, on the same batches and the same groups,
``tc.broadcast`` against NeMo's pickled packet and ``broadcast_object_list`` (see
``tensorcast/bench/baselines.py``) and one bare broadcast of the batch's byte count (the floor), and prints
the ratios. A batch's time is the slowest rank's; figures are medians over batches and
rounds. Every baseline's output is checked against the batch tensorcast delivered.

    python benchmarks/bench_lhotse.py --demo            # what `make demo` runs, ~1 minute
    python benchmarks/bench_lhotse.py --compare --json bench-results/lhotse.json --png lhotse.png
    python benchmarks/bench_lhotse.py --dp 1 --cp 2 --tp 2 --storage flac --cuts
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tensorcast as tc
from tensorcast.bench import baselines

AXES = ("cp", "tp")
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "tired", "owls", "sing", "softly", "near", "an", "old", "stone", "bridge")


# -- the corpus ---------------------------------------------------------------------------


def _audio(rng: np.random.Generator, num_samples: int, sr: int) -> np.ndarray:
    """A few seconds of something speech-like: gliding tones under an envelope, plus noise."""
    t = np.arange(num_samples, dtype=np.float32) / sr
    f0 = rng.uniform(90, 250)
    tone = np.sin(2 * np.pi * f0 * t * (1 + 0.05 * np.sin(2 * np.pi * 0.3 * t)))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(1.5, 4.0) * t) ** 2
    noise = rng.standard_normal(num_samples).astype(np.float32) * 0.01
    return (0.3 * tone * envelope + noise).astype(np.float32)


def build_corpus(cfg: dict[str, Any], audio_dir: Path, *, write: bool) -> Any:
    """The same CutSet on every call for the same settings (seeded).

    ``storage="memory"`` keeps encoded audio in each recording; ``"wav"`` / ``"flac"``
    refer to files under ``audio_dir``, written when ``write`` is set (once, by the parent).
    """
    import soundfile as sf
    from lhotse import CutSet, Recording, SupervisionSegment

    rng = np.random.default_rng(cfg["seed"])
    sr = cfg["sampling_rate"]
    fmt = "FLAC" if cfg["storage"] == "flac" else "WAV"
    cuts = []
    for i in range(cfg["num_cuts"]):
        duration = round(float(rng.uniform(cfg["min_duration"], cfg["max_duration"])), 2)
        num_samples = round(duration * sr)
        rec_id = f"utt{i:05d}"
        text = " ".join(rng.choice(WORDS, size=int(duration * 2.5)))
        samples = _audio(rng, num_samples, sr) if write or cfg["storage"] == "memory" else None
        if cfg["storage"] == "memory":
            buf = io.BytesIO()
            sf.write(buf, samples, sr, format=fmt, subtype="PCM_16")
            rec = Recording.from_bytes(buf.getvalue(), recording_id=rec_id)
        else:
            path = audio_dir / f"{rec_id}.{fmt.lower()}"
            if write:
                sf.write(str(path), samples, sr, format=fmt, subtype="PCM_16")
            rec = Recording.from_file(path, recording_id=rec_id)
        cut = rec.to_cut()
        cut.supervisions = [SupervisionSegment(id=rec_id, recording_id=rec_id, start=0.0,
                                               duration=rec.duration, channel=0, text=text,
                                               language="en")]
        cuts.append(cut)
    return CutSet(cuts)


class SpeechDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Padded audio + lengths + texts + ids (+ the cuts) for a sampled CutSet."""

    def __init__(self, with_cuts: bool) -> None:
        self.with_cuts = with_cuts

    def __getitem__(self, cuts: Any) -> dict[str, Any]:
        from lhotse.dataset.collation import collate_audio

        cuts = cuts.sort_by_duration(ascending=False)
        audio, audio_lens = collate_audio(cuts)
        batch: dict[str, Any] = {
            "audio": audio,
            "audio_lens": audio_lens,
            "texts": [c.supervisions[0].text for c in cuts],
            "ids": [c.id for c in cuts],
        }
        if self.with_cuts:
            batch["cuts"] = cuts
        return batch


def _as_is(batch: Any) -> Any:
    # batch_size=None: the dataset already returns the whole batch
    return batch


def _sampler(cfg: dict[str, Any], cuts: Any, dp_rank: int) -> Any:
    from lhotse.dataset import DynamicBucketingSampler

    # world_size/rank are the DP slot's: lhotse's default (the global world) would split one
    # slot's data across its TP/CP peers.
    with warnings.catch_warnings():
        # it advises a lazy manifest; this synthetic corpus lives in memory by design
        warnings.filterwarnings("ignore", "You are using DynamicBucketingSampler with an eagerly")
        return DynamicBucketingSampler(cuts, max_duration=cfg["max_batch_duration"],
                                       num_buckets=cfg["num_buckets"], shuffle=True,
                                       seed=cfg["seed"], world_size=cfg["dp"], rank=dp_rank)


def build_source(cfg: dict[str, Any], audio_dir: Path, dp_rank: int) -> tuple[Any, int]:
    """The real loader of one DP slot, and how many batches it will yield."""
    cuts = build_corpus(cfg, audio_dir, write=False)
    num_batches = sum(1 for _ in _sampler(cfg, cuts, dp_rank))  # metadata only: cheap
    collate = tc.packed_collate(_as_is) if cfg["packed_collate"] else _as_is
    loader = torch.utils.data.DataLoader(
        SpeechDataset(cfg["cuts"]), sampler=_sampler(cfg, cuts, dp_rank), batch_size=None,
        num_workers=cfg["num_workers"], collate_fn=collate,
        prefetch_factor=2 if cfg["num_workers"] else None,
        persistent_workers=False,
    )
    return loader, num_batches


# -- what every rank does --------------------------------------------------------------------


def digest(batch: Any) -> str:
    """A fingerprint of a batch: every tensor byte, every text and id, the cuts' fields."""
    h = hashlib.blake2b(digest_size=16)
    for key in ("audio", "audio_lens"):
        t = batch[key]
        h.update(f"{key}{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    h.update(json.dumps([batch["texts"], batch["ids"]]).encode())
    if "cuts" in batch:
        h.update(repr([c.to_dict() for c in batch["cuts"]]).encode())
    return h.hexdigest()


class Progress:
    """tqdm on rank 0 when it is installed (lhotse depends on it), else a plain line."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.enabled = enabled
        self.n = 0
        self.total = total
        self.bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="broadcast", unit="batch", file=sys.stdout,
                                dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, mb: float, audio_s: float) -> None:
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"{mb:.1f} MB, {audio_s:.0f} s audio", refresh=False)
            self.bar.update(1)
        else:
            print(f"  batch {self.n}/{self.total or '?'}: {mb:.1f} MB, {audio_s:.0f} s audio",
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _slot_group(mesh: Any, cfg: dict[str, Any]) -> tuple[Any, int, list[int]]:
    """This rank's (cp, tp) group for the baselines, its source (global rank), its ranks."""
    rows = mesh.mesh.reshape(cfg["dp"], cfg["cp"] * cfg["tp"]).tolist()
    group, _ = dist.new_subgroups_by_enumeration(rows)
    row = next(r for r in rows if dist.get_rank() in r)
    return group, row[0], row


def _compact(batch: Any) -> Any:
    """A copy of a rebuilt batch whose tensors own their memory.

    Rebuilt tensors are views into one buffer; pickling a view pickles its whole storage,
    which would charge the pickling baselines for bytes they need not send.
    """
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _compare(cfg: dict[str, Any], mesh: Any, kept: list[Any], sizes: list[int],
             digests: list[str]) -> dict[str, Any]:
    """Time tc.broadcast and the baselines on the same batches; check their outputs."""
    group, src, _ = _slot_group(mesh, cfg)
    is_src = dist.get_rank() == src
    methods: dict[str, Any] = {
        "tensorcast": lambda b: tc.broadcast(b, src, group),
        "pickled_packet": lambda b: baselines.pickled_packet(b, src, group),
        "object_list": lambda b: baselines.object_list(b, src, group),
    }
    times: dict[str, list[list[float]]] = {name: [] for name in [*methods, "floor"]}
    for r in range(cfg["rounds"]):
        for i, nbytes in enumerate(sizes):
            batch = kept[i] if is_src else None
            floor = baselines.Floor(nbytes)
            order: list[tuple[str, Any]] = [*methods.items(), ("floor", floor)]
            # Every rank draws the same order; a fixed one would always time a method
            # right after the same other method.
            random.Random(r * len(sizes) + i).shuffle(order)
            for name, fn in order:
                dist.barrier(group=group)
                t0 = time.perf_counter()
                out = fn(batch) if name != "floor" else fn(batch, src, group)
                dt = time.perf_counter() - t0
                if name != "floor" and digest(out) != digests[i]:
                    raise AssertionError(f"{name} delivered a different batch {i} on rank "
                                         f"{dist.get_rank()}")
                times[name].append([i, dt])  # type: ignore[list-item]
                del out
    return {"src": src, "times": times}


def _rank_main(rank: int, world: int, cfg: dict[str, Any], workdir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # the ranks share the cores
    store = dist.FileStore(os.path.join(workdir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg["pg_timeout"]))
    try:
        mesh = init_device_mesh("cpu", (cfg["dp"], cfg["cp"], cfg["tp"]),
                                mesh_dim_names=("dp", "cp", "tp"))
        dp_rank = int(mesh.get_coordinate()[0])
        is_source = tc.is_dp_source_rank(mesh, AXES)
        source, num_batches = (build_source(cfg, Path(workdir) / "audio", dp_rank)
                               if is_source else (None, None))
        loader = tc.BroadcastingDataLoader(source=source, device_mesh=mesh, axes=AXES,
                                           prefetch=cfg["prefetch"])
        progress = Progress(num_batches, enabled=rank == 0)
        digests: list[str] = []
        sizes: list[int] = []
        audio_seconds: list[float] = []
        waits: list[float] = []
        kept: list[Any] = []
        dist.barrier()
        start = t0 = time.perf_counter()
        for batch in loader:
            waits.append(time.perf_counter() - t0)
            digests.append(digest(batch))
            sizes.append(baselines.batch_nbytes(batch))
            audio_seconds.append(float(batch["audio_lens"].sum()) / cfg["sampling_rate"])
            if cfg["compare"] and len(kept) < cfg["compare_batches"]:
                kept.append(_compact(batch) if is_source else None)
            progress.update(sizes[-1] / 1e6, audio_seconds[-1])
            t0 = time.perf_counter()
        elapsed = time.perf_counter() - start
        progress.close()
        result: dict[str, Any] = {
            "rank": rank, "dp_rank": dp_rank, "source": is_source, "digests": digests,
            "sizes": sizes, "audio_seconds": audio_seconds, "waits": waits, "elapsed": elapsed,
        }
        if cfg["compare"] and cfg["cp"] * cfg["tp"] > 1:
            if rank == 0:
                print(f"comparing on {len(kept)} batches x {cfg['rounds']} rounds ...",
                      flush=True)
            n = len(kept)
            result["compare"] = _compare(cfg, mesh, kept, sizes[:n], digests[:n])
        Path(workdir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- the parent: spawn, wait, check, report ---------------------------------------------------


def run(cfg: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Spawn the ranks, wait for them (killing them past ``timeout``), return their results."""
    world = cfg["dp"] * cfg["cp"] * cfg["tp"]
    with tempfile.TemporaryDirectory(prefix="tensorcast-lhotse-") as tmp:
        if cfg["storage"] != "memory":
            (Path(tmp) / "audio").mkdir()
            build_corpus(cfg, Path(tmp) / "audio", write=True)
        deadline = time.monotonic() + timeout
        ctx = mp.spawn(_rank_main, args=(world, cfg, tmp), nprocs=world, join=False)
        assert ctx is not None
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the run passed the overall timeout of {timeout:.0f} s; "
                                       f"raise --timeout or make the corpus smaller")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def check(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank of a DP slot got the same batches; different DP slots got different ones."""
    slots: dict[int, list[dict[str, Any]]] = {}
    for r in results:
        slots.setdefault(r["dp_rank"], []).append(r)
    identical = all(r["digests"] == rs[0]["digests"] and r["digests"]
                    for rs in slots.values() for r in rs)
    seen = [set(rs[0]["digests"]) for rs in slots.values()]
    disjoint = all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1:])
    return {"identical_within_slots": identical, "different_across_slots": disjoint,
            "num_slots": len(slots)}


def _median_slowest(results: list[dict[str, Any]], name: str) -> float:
    """Median over (slot, round, batch) of the slowest rank's time."""
    worst: dict[tuple[int, int], float] = {}
    for r in results:
        for k, (_, dt) in enumerate(r["compare"]["times"][name]):
            key = (r["dp_rank"], k)
            worst[key] = max(worst.get(key, 0.0), dt)
    return statistics.median(worst.values())


def summarize(cfg: dict[str, Any], results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Figures of the epoch. The first batch waits for the DataLoader workers to start, so
    rates are over the steady state: from the first batch to the last."""
    sources = [r for r in results if r["source"]]
    batches = sum(len(r["digests"]) for r in sources)
    steady = max(1, max(len(r["digests"]) for r in sources) - 1)
    skip = 1 if steady < max(len(r["digests"]) for r in sources) else 0
    steady_s = max(r["elapsed"] - sum(r["waits"][:skip]) for r in results)
    steady_audio_h = sum(sum(r["audio_seconds"][skip:]) for r in sources) / 3600
    steady_mb = max(sum(r["sizes"][skip:]) for r in results) / 1e6
    all_sizes = [s for r in sources for s in r["sizes"]]
    waits = [w for r in results if not r["source"] for w in r["waits"][skip:]]
    summary: dict[str, Any] = {
        "batches": batches,
        "batches_per_slot": [len(r["digests"]) for r in sources],
        "audio_hours": sum(sum(r["audio_seconds"]) for r in sources) / 3600,
        "epoch_seconds": max(r["elapsed"] for r in results),
        "first_batch_seconds": max(r["waits"][0] for r in results if r["waits"]),
        "wall_seconds": wall,
        "audio_hours_per_second": steady_audio_h / steady_s,
        "mb_per_batch_median": statistics.median(all_sizes) / 1e6 if all_sizes else 0.0,
        "mb_per_second_per_rank": steady_mb / steady_s,
        "seconds_per_batch": steady_s / steady,
        "receiver_wait_median_s": statistics.median(waits) if waits else 0.0,
        **check(results),
    }
    if cfg["compare"] and cfg["cp"] * cfg["tp"] > 1:
        med = {name: _median_slowest(results, name)
               for name in ("tensorcast", "pickled_packet", "object_list", "floor")}
        summary["compare_median_s"] = med
        summary["compare_ratio_vs_tensorcast"] = {
            name: med[name] / med["tensorcast"] for name in ("pickled_packet", "object_list",
                                                               "floor")
        }
    return summary


def report(cfg: dict[str, Any], s: dict[str, Any]) -> str:
    ok = {True: "OK", False: "FAILED"}
    lines = [
        "",
        f"batches            {s['batches']} ({' + '.join(map(str, s['batches_per_slot']))} "
        f"over {s['num_slots']} DP slot(s)), median {s['mb_per_batch_median']:.1f} MB",
        f"epoch              {s['audio_hours'] * 60:.1f} min of audio in "
        f"{s['epoch_seconds']:.1f} s; first batch after {s['first_batch_seconds']:.1f} s "
        f"(worker start-up)",
        f"loader rate        {s['audio_hours_per_second']:.3f} h of audio per second, "
        f"{s['mb_per_second_per_rank']:.1f} MB/s received per rank (after the first batch)",
        f"time per batch     {s['seconds_per_batch'] * 1000:.0f} ms per step "
        f"(receivers wait {s['receiver_wait_median_s'] * 1000:.0f} ms median in next())",
        f"check              every rank of each DP slot got bit-identical batches: "
        f"{ok[s['identical_within_slots']]}",
    ]
    if s["num_slots"] > 1:
        lines.append(f"                   different DP slots got different batches: "
                     f"{ok[s['different_across_slots']]}")
    if "compare_median_s" in s:
        med, ratio = s["compare_median_s"], s["compare_ratio_vs_tensorcast"]
        lines += ["", "one batch to the (cp, tp) peers, median of the slowest rank:"]
        for name in ("tensorcast", "pickled_packet", "object_list", "floor"):
            extra = "" if name == "tensorcast" else f"  {ratio[name]:5.2f}x tensorcast"
            lines.append(f"  {name:<16} {med[name] * 1000:8.1f} ms{extra}")
    lines.append(f"total wall time    {s['wall_seconds']:.1f} s (spawn and corpus included)")
    return "\n".join(lines)


_METHOD_LABELS = {
    "tensorcast": ("tc.broadcast", "#08519c"),
    "pickled_packet": ("pickled packet (NeMo)", "#e6550d"),
    "object_list": ("broadcast_object_list", "#a50f15"),
    "floor": ("floor: one broadcast\nof the same bytes", "#404040"),
}


def _hours_per_second(results: list[dict[str, Any]], name: str) -> float:
    """Audio hours per second through one method on the compared batches: their audio over
    the time the slowest rank took, summed over slots, rounds and batches."""
    audio = {r["dp_rank"]: r["audio_seconds"] for r in results if r["source"]}
    worst: dict[tuple[int, int], tuple[int, float]] = {}
    for r in results:
        for k, (i, dt) in enumerate(r["compare"]["times"][name]):
            key = (r["dp_rank"], k)
            worst[key] = (i, max(worst.get(key, (i, 0.0))[1], dt))
    seconds = sum(dt for _, dt in worst.values())
    hours = sum(audio[slot][i] for (slot, _), (i, _) in worst.items()) / 3600
    return hours / seconds


def write_png(cfg: dict[str, Any], s: dict[str, Any], results: list[dict[str, Any]],
              path: Path) -> bool:
    """A bar chart of audio hours per second: the loader's whole epoch, and each method of
    ``--compare`` on the same batches; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        return False
    bars = [("BroadcastingDataLoader,\nwhole epoch", s["audio_hours_per_second"], "#9ecae1")]
    if "compare_median_s" in s:
        for name, (label, color) in _METHOD_LABELS.items():
            bars.append((label, _hours_per_second(results, name), color))
    fig, ax = plt.subplots(figsize=(1.6 * len(bars) + 2.4, 4.2))
    xs = range(len(bars))
    ax.bar(xs, [b[1] for b in bars], color=[b[2] for b in bars])
    for x, (_, value, _) in zip(xs, bars):
        ax.annotate(f"{value:.3g}", (x, value), xytext=(0, 2), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [b[0] for b in bars], fontsize=8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylabel("hours of audio per second (log scale)", fontsize=9)
    ax.set_title(f"lhotse batches to their (cp, tp) peers: dp={cfg['dp']} cp={cfg['cp']} "
                 f"tp={cfg['tp']}, median {s['mb_per_batch_median']:.1f} MB a batch",
                 fontsize=9)
    ax.grid(axis="y", which="major", linewidth=0.4, alpha=0.5)
    fig.text(0.5, 0.01, "whole epoch: DataLoader workers decode, collate and pack, then the "
             "loader broadcasts; the others: one batch's transfer alone, slowest rank",
             ha="center", fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--demo", action="store_true",
                   help="the light defaults `make demo` uses (~1 minute on 2 cores)")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--num-cuts", type=int, default=200)
    p.add_argument("--min-duration", type=float, default=10.0, help="seconds")
    p.add_argument("--max-duration", type=float, default=30.0, help="seconds")
    p.add_argument("--sampling-rate", type=int, default=16000)
    p.add_argument("--storage", choices=("memory", "wav", "flac"), default="memory",
                   help="in-memory WAV bytes, or WAV / FLAC files in a temp dir")
    p.add_argument("--max-batch-duration", type=float, default=300.0,
                   help="DynamicBucketingSampler(max_duration=...), seconds of audio")
    p.add_argument("--num-buckets", type=int, default=4)
    p.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per source")
    p.add_argument("--no-packed-collate", dest="packed_collate", action="store_false",
                   help="pack in the main process instead of the DataLoader workers")
    p.add_argument("--cuts", action="store_true", help="also send each batch's CutSet")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--compare", action="store_true",
                   help="also time the pickled-packet and broadcast_object_list baselines")
    p.add_argument("--compare-batches", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds for --compare")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="overall limit in seconds; the ranks are killed past it")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--png", type=Path, default=None,
                   help="draw audio hours per second per method here (needs matplotlib)")
    args = p.parse_args(argv)
    if args.demo:  # light: two DP slots, each a 2x2 (cp, tp) sub-mesh; a short corpus
        args.dp, args.cp, args.tp = 2, 2, 2
        args.num_cuts, args.max_batch_duration, args.num_buckets = 72, 120.0, 2
        args.num_workers, args.timeout = 1, min(args.timeout, 240.0)
        args.compare_batches, args.rounds = 3, 2
    for name in ("dp", "cp", "tp", "num_cuts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.min_duration <= args.max_duration:
        p.error("need 0 < --min-duration <= --max-duration")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Inherited by the spawned ranks: loopback only, one thread each (the ranks share the cores).
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = {k: v for k, v in vars(args).items() if k not in ("json", "demo", "png")}
    cfg["pg_timeout"] = min(180.0, args.timeout)
    world = args.dp * args.cp * args.tp
    print(f"tensorcast + lhotse: {world} ranks (dp={args.dp} cp={args.cp} tp={args.tp}), "
          f"{args.num_cuts} cuts of {args.min_duration:g}-{args.max_duration:g} s at "
          f"{args.sampling_rate // 1000} kHz ({args.storage}), "
          f"max_duration={args.max_batch_duration:g} s, {args.num_workers} worker(s) per source, "
          f"{'packed in workers' if args.packed_collate else 'packed on the source'}"
          f"{', with cuts' if args.cuts else ''}", flush=True)
    t0 = time.perf_counter()
    try:
        results = run(cfg, args.timeout)
    except TimeoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize(cfg, results, time.perf_counter() - t0)
    print(report(cfg, summary))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "config": cfg, "summary": summary, "results": results,
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "python": platform.python_version(), "torch": torch.__version__,
        }, indent=1))
        print(f"wrote {args.json}")
    if args.png is not None:
        if write_png(cfg, summary, results, args.png):
            print(f"wrote {args.png}")
        else:
            print("no chart: matplotlib is not installed (pip install 'tensorcast[bench]')")
    ok = summary["identical_within_slots"] and summary["different_across_slots"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
