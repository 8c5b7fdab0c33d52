"""The CUDA paths, on a machine with a GPU (skipped elsewhere).

The checks live in ``tests/gpu/gpu_stream_check.py``, a script that can also be run by
hand (``bash tests/gpu/device_run.sh OUTDIR`` runs all of it in one command); here each
of its parts runs under pytest wherever CUDA is available, through the script itself
(each part in processes of its own, under the script's hard limits), and no check of the
part may fail. A check that cannot judge here (a feature not there yet, a profiler trace
it cannot read) is a SKIP, listed in the test's output.
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
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    rc, out = run_killable(
        [sys.executable, str(SCRIPT), "--parts", part, "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        timeout=PART_TIMEOUT_S[part] + 30,  # the script ends a part at its own limit
    )
    report = tmp_path / f"part-{part}.json"
    checks = json.loads(report.read_text())["checks"] if report.exists() else []
    assert checks, f"part {part} reported nothing (rc={rc}):\n{out[-4000:]}"
    failed = [f"{c['id']} {c['name']}:\n{c['detail']}" for c in checks if c["status"] == "FAIL"]
    skipped = [f"{c['id']}: {c['detail'][:200]}" for c in checks if c["status"] == "SKIP"]
    print(f"part {part}: skipped {skipped}" if skipped else f"part {part}: nothing skipped")
    assert not failed, "\n".join(failed) + f"\n{out[-2000:]}"
    assert rc == 0, out[-4000:]
