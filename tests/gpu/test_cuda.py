"""The CUDA paths, on a machine with a GPU (skipped elsewhere).

The checks live in ``tests/gpu/gpu_stream_check.py``, a script that can also be run by
hand; here each of its parts runs under pytest wherever CUDA is available, through the
script itself (each part in processes of its own, under the script's hard timeouts), and
every check of the part must pass.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from gpu_stream_check import PART_TIMEOUT_S
from subprocs import run_killable

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SCRIPT = Path(__file__).with_name("gpu_stream_check.py")
ROOT = SCRIPT.parents[2]


@pytest.mark.parametrize("part", sorted(PART_TIMEOUT_S))
def test_gpu_stream_check_part(part: str, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    rc, out = run_killable(
        [sys.executable, str(SCRIPT), "--parts", part, "--json", str(report)],
        cwd=ROOT,
        env=env,
        timeout=PART_TIMEOUT_S[part] + 60,  # the script kills a part at its own limit
    )
    checks = json.loads(report.read_text())["checks"] if report.exists() else []
    failed = [f"{c['id']} {c['name']}:\n{c['detail']}" for c in checks if c["status"] != "PASS"]
    assert checks, f"part {part} reported nothing (rc={rc}):\n{out[-4000:]}"
    assert not failed, "\n".join(failed) + f"\n{out[-2000:]}"
    assert rc == 0, out[-4000:]
