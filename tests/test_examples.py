"""The examples, run end to end as a user runs them: 4 ranks on gloo, each in a subprocess.

Each run has a hard timeout; on a hang the whole process group of the launcher (torchrun,
or the ranks Lightning starts) is killed and the test fails with what the run printed. The
assertions read the summary lines the examples print on rank 0.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from subprocs import LAUNCHER_ENV, run_killable

pytestmark = pytest.mark.dist  # multi-process, like the rank-pool tests

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TORCHRUN = [
    str(Path(sys.executable).with_name("torchrun")),
    "--standalone",
    "--nproc_per_node",
    "4",
]
TIMEOUT = 240.0


def run(args: list[str], cwd: Path) -> str:
    """Run ``args`` to the end within ``TIMEOUT`` seconds; its output, checked for rc 0."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    env.pop("TENSORCAST_LIGHTNING_EXAMPLE_DIR", None)
    rc, out = run_killable(args, cwd, env, TIMEOUT)
    assert rc == 0, f"{' '.join(args)} exited with {rc}:\n{out[-6000:]}"
    return out


def summary(out: str) -> set[str]:
    return {line.strip() for line in out.splitlines()}


def test_torchrun_train(tmp_path: Path) -> None:
    out = run([*TORCHRUN, str(EXAMPLES / "torchrun_train.py"), "--quick"], tmp_path)
    lines = summary(out)
    assert "ranks: 4, mesh (dp=2, tp=2), 2 epochs x 4 steps, one source rank per dp slot" in lines
    assert "same batches within each tp group: True" in lines
    assert "dp slots disjoint, together the whole data set each epoch: True" in lines
    assert "epochs reshuffled: True" in lines
    assert "resume exact: True (checkpoint after 2 steps)" in lines


def test_lightning_datamodule(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    out = run([sys.executable, str(EXAMPLES / "lightning_datamodule.py"), "--quick"], tmp_path)
    lines = summary(out)
    assert "ranks: 4, mesh (dp=2, tp=2), 2 epochs x 4 steps, checkpoint at step 6" in lines
    # the sampler's position after 2 of epoch 1's 4 batches of 2, saved by Lightning's fit loop
    assert "loader state in checkpoint: [{'epoch': 1, 'yielded': 4}]" in lines
    assert "epochs reshuffled: True" in lines
    assert "same batches within each tp pair: True" in lines
    assert "validation batches per loader: {'clean': 4, 'noisy': 6}" in lines
    assert "resume exact: True (2 steps after resuming)" in lines
    # the data stall, logged with self.log at every step and by log_every at every epoch's end
    assert "data stall logged with self.log: True" in lines
    assert any(line.startswith("data stall over epoch 1's 4 steps: ") for line in lines)
    assert any(line.startswith("tensorcast: loader step 4: data stall") for line in lines)
    assert not list(tmp_path.iterdir())  # no logs or checkpoints left behind


@pytest.mark.parametrize(
    ("layout", "mesh"),
    [
        (["--cp", "1", "--tp", "2"], "(dp=2, cp=1, tp=2)"),
        (["--cp", "2", "--tp", "1"], "(dp=2, cp=2, tp=1)"),
    ],
    ids=["tp-pairs", "cp-pairs"],
)
def test_nemo_style_datamodule(tmp_path: Path, layout: list[str], mesh: str) -> None:
    out = run([*TORCHRUN, str(EXAMPLES / "nemo_style_datamodule.py"), "--quick", *layout], tmp_path)
    lines = summary(out)
    assert f"ranks: 4, mesh {mesh}, 24 training cuts" in lines
    assert "len(train loader) raises TypeError on every rank: True" in lines
    assert "same batches within each (cp, tp) sub-mesh: True" in lines
    assert "dp slots disjoint: True" in lines
    assert "epochs reshuffled: True" in lines
    assert "state_dict held by: DynamicBucketingSampler (13 keys)" in lines
    assert "resume exact: True (checkpoint after 2 batches)" in lines
