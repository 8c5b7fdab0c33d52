"""What a run reports: per method, ms (median, p90), GB/s and the multiple of the floor;
a table for the terminal or a README, a JSON document, a chart, and a progress bar."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

__all__ = [
    "COLUMNS",
    "Progress",
    "checked_line",
    "markdown_table",
    "rows",
    "text_table",
    "trim_line",
    "trim_ratios",
    "write_png",
]

#: What the table's columns mean, printed under it and in ``--help``.
COLUMNS = """\
columns: median and p90 ms of the slowest rank's time per iteration, GB/s of tensor bytes;
  x floor  the method's median over the floor's median, in the same run (the floor: one
           broadcast of a preallocated buffer of the batch's bytes);
  paired   the median of the method's per-iteration ratios to the floor's time in the same
           iteration, which a drift of the machine's load during the run cannot move;
  wire     the bytes of the buffer a tensorcast method sent per batch (padding trimmed,
           or every leaf whole with trim=False), and the floor's: the batch's tensor bytes;
  trim on / off  a method's median trimmed over its median with trim=False (below 1x:
           trimming pays), paired, and the spread (p10-p90) of the per-iteration ratios;
           "nothing trimmed" where both sent the same bytes;
  trim's decision  the source's encode of the batch with trim on less with trim off, timed
           in-process beside the run: what trimming adds where it trims nothing"""

# How the chart names and colours each method: tensorcast in blues, the peers apart.
LABELS = {
    "tc.broadcast": ("tc.broadcast", "#08519c"),
    "tc.loader": ("tc.loader", "#3182bd"),
    "tc.loader+packed": ("tc.loader + packed_collate", "#9ecae1"),
    "tc.broadcast(trim=False)": ("tc.broadcast, trim=False", "#31a354"),
    "tc.loader(trim=False)": ("tc.loader, trim=False", "#74c476"),
    "tc.loader+packed(trim=False)": ("tc.loader + packed_collate, trim=False", "#c7e9c0"),
    "tc.broadcast(shm=False)": ("tc.broadcast, shm=False", "#756bb1"),
    "tc.loader(shm=False)": ("tc.loader, shm=False", "#9e9ac8"),
    "pickled_packet": ("pickled packet (NeMo)", "#e6550d"),
    "object_list": ("broadcast_object_list", "#a50f15"),
    "per_tensor": ("one broadcast per tensor", "#969696"),
    "memcpy": ("memcpy (one copy of the bytes)", "#252525"),
}


def rows(
    times: dict[str, list[float]], nbytes: int, wire: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """One row per method: medians and p90 in ms, GB/s (of the batch's tensor bytes,
    whatever was sent), x floor (medians of the same run, and paired: the median of
    per-iteration ratios to the floor), and the bytes on the wire per batch where known
    (``wire``: by method; None for the peers' ways)."""
    wire = wire or {}
    floor = times.get("floor")
    floor_ms = float(np.median(floor)) * 1e3 if floor else None
    out = []
    for name, seconds in times.items():
        p50, p90 = np.percentile(np.asarray(seconds) * 1e3, [50, 90])
        paired = None
        if floor:
            paired = statistics.median(t / max(f, 1e-9) for t, f in zip(seconds, floor))
        out.append(
            {
                "method": name,
                "median_ms": float(p50),
                "p90_ms": float(p90),
                "gbps": nbytes / max(float(p50), 1e-9) / 1e6,
                "x_floor": float(p50) / floor_ms if floor_ms else None,
                "x_floor_paired": paired,
                "wire_bytes": wire.get(name),
                "wire_share": wire[name] / nbytes if name in wire and nbytes else None,
                "times_ms": [s * 1e3 for s in seconds],
            }
        )
    return out


def trim_ratios(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per tensorcast method run both ways: its time with trimmed leaves over its time
    with ``trim=False``, as the ratio of medians and paired (the median of per-iteration
    ratios, the same iteration's); below 1 where trimming pays."""
    out = {}
    for whole, seconds in times.items():
        if not whole.endswith("(trim=False)") or not seconds:
            continue
        trimmed = times.get(whole.removesuffix("(trim=False)"))
        if not trimmed:
            continue
        each = [t / max(w, 1e-12) for t, w in zip(trimmed, seconds)]
        low, high = np.percentile(each, [10, 90])
        out[whole.removesuffix("(trim=False)")] = {
            "median": float(np.median(trimmed)) / max(float(np.median(seconds)), 1e-12),
            "paired": statistics.median(each),
            "p10": float(low),  # the spread of the per-iteration ratios
            "p90": float(high),
        }
    return out


def trim_line(wl: dict[str, Any]) -> str | None:
    """The "trim on / off" line of a workload: per method run both ways, "nothing trimmed"
    where both sent the same bytes (their ratio is noise), else the ratio of medians,
    paired, and the spread of the per-iteration ratios (p10-p90)."""
    ratios = wl.get("trim_over_untrimmed") or {}
    if not ratios:
        return None
    wire = {r["method"]: r.get("wire_bytes") for r in wl["rows"]}
    said = []
    for m, r in ratios.items():
        on, off = wire.get(m), wire.get(f"{m}(trim=False)")
        if on is not None and on == off:
            said.append(f"{m} nothing trimmed")
            continue
        spread = f", p10-p90 {_x(r['p10'])}-{_x(r['p90'])}" if "p10" in r else ""
        said.append(f"{m} {_x(r['median'])} (paired {_x(r['paired'])}{spread})")
    return "  trim on / off: " + ", ".join(said)


def checked_line(report: dict[str, Any]) -> str:
    """What a run checked, said when every check passed."""
    per_rank = [sum(n) for n in zip(*(wl["checked"] for wl in report["workloads"]))]
    return (
        f"checked: on every one of the {len(per_rank)} ranks, every batch each method handed "
        f"it, every iteration ({sum(per_rank)} batches in all, at least {min(per_rank)} per "
        f"rank), equals its source's batch of that iteration, bit for bit"
    )


def size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def _x(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" if value < 10 else f"{value:.0f}x"


def text_table(report: dict[str, Any]) -> str:
    """Every workload's rows: ms (median, p90), GB/s and x floor per method."""
    lines = []
    for wl in report["workloads"]:
        lines.append(f"\n{wl['workload']} ({size(wl['nbytes'])}, {wl['iters']} iterations)")
        lines.append(
            f"  {'method':<28} {'median ms':>10} {'p90 ms':>9} {'GB/s':>8} "
            f"{'x floor':>8} {'paired':>7} {'wire':>9}"
        )
        for r in wl["rows"]:
            lines.append(
                f"  {r['method']:<28} {r['median_ms']:>10.3f} {r['p90_ms']:>9.3f} "
                f"{r['gbps']:>8.3f} {_x(r['x_floor']):>8} {_x(r['x_floor_paired']):>7} "
                f"{_wire(r.get('wire_bytes')):>9}"
            )
        trim = trim_line(wl)
        if trim is not None:
            lines.append(trim)
        decision = wl.get("trim_decision_ms")
        if decision:
            floor = next((r["median_ms"] for r in wl["rows"] if r["method"] == "floor"), None)
            extra = decision["on"] - decision["off"]
            share = f", {100 * extra / floor:.2g}% of the floor" if floor else ""
            lines.append(
                f"  trim's decision on the source: {extra:+.3f} ms a batch (encode "
                f"{decision['on']:.3f} ms on, {decision['off']:.3f} off{share})"
            )
    return "\n".join(lines)


def _wire(nbytes: int | None) -> str:
    return "-" if nbytes is None else size(nbytes)


def markdown_table(report: dict[str, Any]) -> str:
    """x floor per workload (rows) and method (columns), with the floor's own ms and the
    bytes tc.loader sent per batch (trimmed, and whole where the run has both)."""
    methods = [m for m in LABELS if any(r["method"] == m for r in report["workloads"][0]["rows"])]
    sent = [m for m in ("tc.loader", "tc.loader(trim=False)") if m in methods]
    head = ["workload", "floor ms", *(LABELS[m][0] for m in methods)]
    head += [f"bytes sent, {LABELS[m][0]}" for m in sent]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for wl in report["workloads"]:
        by = {r["method"]: r for r in wl["rows"]}
        floor = by.get("floor")
        cells = [
            f"{wl['workload']} ({size(wl['nbytes'])})",
            f"{floor['median_ms']:.3f}" if floor else "-",
        ]
        cells += [_x(by[m]["x_floor"]) if m in by else "-" for m in methods]
        cells += [_wire(by[m].get("wire_bytes")) if m in by else "-" for m in sent]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


class Progress:
    """A one-line progress bar on a terminal; silent when ``stream`` is not a TTY."""

    def __init__(self, total: int, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.total, self.done = max(total, 1), 0
        self.last = 0.0

    def advance(self, what: str, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.1 and self.done < self.total):
            return
        self.last = now
        filled = int(30 * self.done / self.total)
        bar = "#" * filled + "." * (30 - filled)
        self.stream.write(f"\r[{bar}] {100 * self.done // self.total:3d}% {what:<40.40}")
        self.stream.flush()

    def clear(self) -> None:
        """Clear the bar's line (before other output; the next advance draws it again)."""
        if self.enabled:
            self.stream.write("\r" + " " * 80 + "\r")
            self.stream.flush()

    def close(self) -> None:
        self.clear()


def write_png(report: dict[str, Any], path: str) -> None:
    """A bar chart of each method's median over the floor's, per workload (log scale).

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    methods = [m for m in LABELS if any(r["method"] == m for r in workloads[0]["rows"])]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    width = 0.8 / max(1, len(methods))
    for k, method in enumerate(methods):
        label, color = LABELS[method]
        for j, wl in enumerate(workloads):
            row = next((r for r in wl["rows"] if r["method"] == method), None)
            if row is None or row["x_floor"] is None:
                continue
            ax.bar(
                j - 0.4 + width * (k + 0.5),
                row["x_floor"],
                width,
                color=color,
                label=label if j == 0 else None,
            )
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="floor")
    ax.set_yscale("log")
    ax.set_ylabel("median time per batch / floor (log scale)")
    ax.set_xticks(
        range(len(workloads)),
        [f"{wl['workload']}\n{size(wl['nbytes'])}" for wl in workloads],
        fontsize=8,
    )
    ax.legend(fontsize=7, ncol=2, frameon=False)
    ax.set_title(report["where"], fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
