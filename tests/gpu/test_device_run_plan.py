"""The one-command GPU run, on a machine without CUDA: its plan, its exit, its summary.

``bash tests/gpu/device_run.sh OUTDIR`` must say within seconds that there is nothing to
run here (exit 77), with a plan whose hard limits add up to what its last line says, and
to at most 480 s (one command on the GPU machine may take 600 s; the rest is start-up
and slack). The parts' limits are ``gpu_stream_check.PART_TIMEOUT_S`` and the plan names
every check. The summary a run ends with is checked on a folder made by hand.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from gpu_stream_check import CHECKS, PART_TIMEOUT_S, SKIPPED, _verdicts, summarize

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = HERE / "device_run.sh"
BUDGET_S = 480
_LINE = re.compile(r"^  (?P<part>\S+)\s+(?P<limit>\d+) s  (?P<what>.*)$")


def _no_cuda_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHON"] = sys.executable  # the interpreter with torch, as python3 is there
    env["CUDA_VISIBLE_DEVICES"] = ""  # even on a GPU machine: the no-device path
    return env


def _run(*args: str, timeout: float = 120.0) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        env=_no_cuda_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started


def _plan(out: str) -> tuple[dict[str, tuple[int, str]], int]:
    """The plan's parts (limit, what) and its total, which must be its last line."""
    lines = [line for line in out.splitlines() if line.strip()]
    total = re.fullmatch(r"total: (\d+) s", lines[-1])
    assert total, f"the last line is not 'total: N s': {lines[-1]!r}"
    parts = {m["part"]: (int(m["limit"]), m["what"]) for m in map(_LINE.match, lines) if m}
    return parts, int(total[1])


def test_without_cuda_it_prints_its_plan_and_exits_77(tmp_path: Path) -> None:
    rc, out, took = _run(str(tmp_path / "out"))
    assert rc == SKIPPED, out
    assert took < 30, f"took {took:.1f} s to find there is no GPU"
    assert "needs a CUDA device" in out
    parts, total = _plan(out)
    assert total == sum(limit for limit, _ in parts.values()), parts
    assert total <= BUDGET_S, f"the parts' limits add up to {total} s, over {BUDGET_S} s"
    assert list(parts) == ["env", "A", "B", "C", "overlap", "summary"]
    for part, limit in PART_TIMEOUT_S.items():
        assert parts[part][0] == limit, f"part {part}: {parts[part][0]} s in the plan, {limit} s"
        named = set(parts[part][1].split(": ", 1)[-1].split())
        assert named == set(CHECKS[part]), f"part {part}: the plan names {sorted(named)}"
    env = json.loads((tmp_path / "out" / "env.json").read_text())
    assert env["cuda_available"] is False
    assert (tmp_path / "out" / "plan.txt").read_text().splitlines()[-1] == f"total: {total} s"


def test_a_python_without_torch_says_so_and_is_not_a_skip(tmp_path: Path) -> None:
    """``PYTHON`` without torch (here: without its site-packages) is a failure to report,
    not the "no GPU here" of exit 77, which would pass for a run with nothing to check."""
    bare = tmp_path / "python-without-site"
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    env = {**_no_cuda_env(), "PYTHON": str(bare)}
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, SKIPPED), out
    assert "needs torch" in out and "cannot import torch" in out, out
    assert time.monotonic() - started < 30
    assert _plan(out)[1] <= BUDGET_S


def test_plan_only() -> None:
    rc, out, _ = _run("--plan")
    assert rc == 0, out
    parts, total = _plan(out)
    assert total == sum(limit for limit, _ in parts.values()) <= BUDGET_S


def test_check_script_without_cuda(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(HERE / "gpu_stream_check.py"), "--out", str(tmp_path)],
        cwd=tmp_path,  # the script finds the repository itself
        env={k: v for k, v in _no_cuda_env().items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == SKIPPED, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == f"total: {sum(PART_TIMEOUT_S.values())} s"
    assert "skipped" in json.loads((tmp_path / "skipped.json").read_text())


def _record(cid: str, status: str, rank: int | None = None, detail: str = "") -> dict:
    return {"id": cid, "rank": rank, "status": status, "detail": detail, "report": {}}


def test_verdicts_fail_over_skip_over_pass() -> None:
    procs = {"B0": {"rc": 0, "timed_out": False}, "B1": {"rc": 0, "timed_out": False}}
    records = [
        _record("R7", "PASS", 0),
        _record("R7", "PASS", 1),
        _record("T7", "PASS", 0),
        _record("T7", "SKIP", 1, "the trace's thread ids are not the system's"),
        _record("T15", "SKIP", 0),
        _record("T15", "FAIL", 1, "different orders"),
        _record("T4", "PASS", 0),  # rank 1 never got there
    ]
    got = {v["id"]: v["status"] for v in _verdicts("B", records, procs)}
    assert got["R7"] == "PASS"
    assert got["T7"] == "SKIP"
    assert got["T15"] == "FAIL"
    assert got["T4"] == "FAIL"  # did not run everywhere
    assert got["T6"] == "FAIL"  # did not run at all
    assert set(got) == set(CHECKS["B"])


def test_summary_of_a_run_cut_off(tmp_path: Path) -> None:
    """Part A ended and wrote its verdicts; part B was cut off after a few records; part
    C never started; the overlap benchmark wrote its figures."""
    env = {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "cuda": "13.0", "python": "3.12.3"}
    (tmp_path / "env.json").write_text(json.dumps(env))
    checks_a = [
        {"id": cid, "name": name, "status": "PASS", "detail": ""}
        for cid, name in CHECKS["A"].items()
    ]
    checks_a[-1].update(status="SKIP", detail="tc.pack has no trim= keyword yet")
    outcome = {"seconds": 31.5, "limit_s": 75, "processes": {"A": {"rc": 0, "timed_out": False}}}
    (tmp_path / "part-A.json").write_text(json.dumps({"checks": checks_a, "outcome": outcome}))
    for rank in (0, 1):
        with open(tmp_path / f"part-B.B{rank}.jsonl", "w") as f:
            f.write(json.dumps(_record("R7", "PASS", rank)) + "\n")
            f.write('{"id": "T4", "rank"')  # a line cut off by the kill
    overlap = {
        "profiler": {"hidden_share": 0.93, "upload_GBps": 41.0},
        "hidden_share_from_step_times": 0.9,
        "plain_pinned_copy_GBps": {"idle": 50.0, "under_the_matmuls": 45.0},
        "h2d_bandwidth_ratio": 0.82,
        "step_ms_compute_only": 40.0,
        "step_ms_with_loader": 40.5,
    }
    (tmp_path / "overlap.json").write_text(json.dumps(overlap))
    text = summarize(tmp_path)
    lines = text.splitlines()
    assert "NVIDIA H200" in lines[0] and "torch 2.11.0+cu130" in lines[0]
    assert "part A: 31.5 s of 75 s" in text
    assert "part B: cut off" in text
    assert "part C: not run" in text
    status = {m[2]: m[1] for m in re.finditer(r"^  (PASS|FAIL|SKIP)\s+(\S+)", text, re.M)}
    assert status["R1"] == "PASS" and status["T18a"] == "SKIP"
    assert status["R7"] == "PASS" and status["T4"] == "FAIL"
    assert all(status[cid] == "FAIL" for cid in CHECKS["C"])
    assert "hidden share 0.93 (profiler)" in text
    assert "loader 41 GB/s against a plain pinned copy_ 50 GB/s idle" in text
    n = sum(len(c) for c in CHECKS.values())
    fails = n - len(CHECKS["A"]) - 1  # A's checks and B's R7 passed or skipped
    assert lines[-1].startswith(f"checks: {len(CHECKS['A']) - 1 + 1} PASS, {fails} FAIL, 1 SKIP")
