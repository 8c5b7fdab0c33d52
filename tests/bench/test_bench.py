"""``python -m tensorcast.bench``: a quick run under torchrun on 4 gloo ranks, checked
through its JSON, with a user's batch from a file and one from ``module:function``; and
the batch file format on its own."""

from __future__ import annotations

import io
import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from subprocs import LAUNCHER_ENV, run_killable

import tensorcast as tc
from tensorcast.bench import __main__ as bench_main
from tensorcast.bench import load_batch, save_batch
from tensorcast.bench.batches import digest, user_batch
from tensorcast.bench.report import Progress, rows, trim_line, trim_ratios
from tensorcast.bench.run import method_names
from tensorcast.bench.timing import METHODS, REFERENCES, UNTRIMMED, trim_supported
from tensorcast.bench.workloads import WORKLOADS, make_workload

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 150.0

USER_MODULE = """
import torch

def one_batch():
    return {"input_ids": torch.arange(512).reshape(4, 128), "lengths": [128, 100, 90, 64]}
"""


def user_files(tmp_path: Path) -> tuple[Path, str]:
    """A batch file saved with save_batch, and a module:function on the path."""
    path = tmp_path / "mine.tcb"
    save_batch(path, {"feats": torch.randn(8, 80, 50), "ids": ["a", "b"], "n": 8})
    (tmp_path / "my_batches.py").write_text(USER_MODULE)
    return path, "my_batches:one_batch"


@pytest.mark.dist
def test_quick_run_under_torchrun(tmp_path: Path) -> None:
    path, function = user_files(tmp_path)
    out_json = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    python_path = [str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")]
    env.update(
        OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.pathsep.join(python_path)
    )
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "4", "-m", "tensorcast.bench", "--quick", "--workloads", ",".join(WORKLOADS),
            "--batch", str(path), "--batch", function, "--json", str(out_json)]  # fmt: skip
    rc, out = run_killable(args, tmp_path, env, TIMEOUT)
    assert rc == 0, out[-6000:]
    report = json.loads(out_json.read_text())
    assert report["backend"] == "gloo" and report["world_size"] == 4
    assert report["mesh"] == {"dp": 1, "cp": 1, "tp": 4} and report["device"] == "cpu"
    names = [wl["workload"] for wl in report["workloads"]]
    assert names == [*WORKLOADS, "mine.tcb", function]
    # with trimmed leaves, tensorcast's methods run trimmed and whole in the same run
    assert report["trim_supported"] == trim_supported()
    methods = method_names(None)
    for wl in report["workloads"]:
        assert wl["check_failures"] == [], wl["check_failures"]
        assert wl["nbytes"] > 0
        assert [r["method"] for r in wl["rows"]] == methods
        for row in wl["rows"]:
            assert row["median_ms"] > 0 and row["p90_ms"] >= row["median_ms"]
            assert row["gbps"] > 0 and row["x_floor"] > 0 and row["x_floor_paired"] > 0
        wire = {r["method"]: r["wire_bytes"] for r in wl["rows"]}
        assert wire["floor"] == wl["nbytes"] and wire["per_tensor"] is None
        assert all(wire[m] > 0 for m in methods if m.startswith("tc."))
        for m in UNTRIMMED if report["trim_supported"] else ():
            assert wire[m] >= wire[m.removesuffix("(trim=False)")]  # never more trimmed
        both = {m.removesuffix("(trim=False)") for m in UNTRIMMED if m in methods}
        assert set(wl["trim_over_untrimmed"]) == both
        assert all(r["median"] > 0 and r["paired"] > 0 for r in wl["trim_over_untrimmed"].values())
        decision = wl["trim_decision_ms"]  # the source's encode, trim on and off
        assert decision is None or (decision["on"] > 0 and decision["off"] > 0)
        assert (decision is not None) == report["trim_supported"]
    if report["trim_supported"]:  # padding never travels: the bytes say so
        by = {wl["workload"]: {r["method"]: r for r in wl["rows"]} for wl in report["workloads"]}
        for name in ("audio_padded", "fbank_padded"):  # big enough for a host's rule
            # on the wire: ranks on one host read the whole leaves in shared memory instead
            trimmed = by[name].get("tc.loader(shm=False)", by[name]["tc.loader"])
            assert trimmed["wire_share"] < 0.75, (name, trimmed)
            assert by[name]["tc.loader(trim=False)"]["wire_share"] >= 1.0
    assert "| workload | floor ms | tc.broadcast |" in out  # the table for a README
    assert "[####" not in out  # no progress bar when the output is not a terminal
    # every rank checked every batch of every method, every iteration, and says so
    batches = len([m for m in methods if m not in REFERENCES])  # the floor, memcpy: none
    for wl in report["workloads"]:
        assert wl["checked"] == [batches * (wl["iters"] + 1)] * 4, wl["checked"]  # + warmup
    assert "checked: on every one of the 4 ranks, every batch each method handed it" in out
    assert "paired   the median of the method's per-iteration ratios" in out
    if report["trim_supported"]:
        assert "trim's decision on the source:" in out


@pytest.mark.dist
def test_a_batch_the_source_cannot_load_fails_every_rank(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", "-m", "tensorcast.bench", "--batch", "no_such_module_here:fn",
            "--timeout", "60"]  # fmt: skip
    rc, out = run_killable(args, tmp_path, env, 60.0)  # a hang would be the collective timeout
    assert rc != 0
    assert "error on rank 0: --batch no_such_module_here:fn: ModuleNotFoundError" in out
    assert "error on rank 1: --batch no_such_module_here:fn: a source rank could not" in out


@pytest.mark.parametrize(
    "batch",
    [{"n": 3, "text": "no tensor"}, {"x": torch.empty(0, 3)}, [], {"ids": ["a"], "e": None}],
    ids=["scalars", "zero-element", "empty-list", "strings"],
)
def test_a_batch_without_tensor_bytes_round_trips(tmp_path: Path, batch: object) -> None:
    """An empty buffer (torch.frombuffer refuses one) still makes a file that loads."""
    assert save_batch(tmp_path / "b.tcb", batch) == 0
    assert digest(load_batch(tmp_path / "b.tcb")) == digest(batch)


@pytest.mark.parametrize(
    "args",
    [["--cp", "0"], ["--tp", "0"], ["--dp", "-2"], ["--iters", "0"], ["--warmup", "-1"],
     ["--timeout", "0"], ["--cp", "two"]],
)  # fmt: skip
def test_sizes_that_cannot_be_are_refused_before_any_group(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse refuses them: no launcher is needed, no group is made (today --cp 0 divides
    by zero once every rank's group is up)."""
    with pytest.raises(SystemExit) as raised:
        bench_main.parse_args(args)
    assert raised.value.code == 2
    assert f"argument {args[0]}" in capsys.readouterr().err


def test_untrimmed_methods_need_a_tensorcast_that_trims(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Asked by name on a tensorcast without ``trim=``, the (trim=False) methods are a
    clear error before any group; left out, the run is the default methods as before."""
    monkeypatch.setattr(bench_main, "trim_supported", lambda: False)
    with pytest.raises(SystemExit) as raised:
        bench_main.parse_args(["--methods", "tc.loader,tc.loader(trim=False)"])
    assert raised.value.code == 2
    assert "tc.loader(trim=False) need a tensorcast that takes trim=" in capsys.readouterr().err
    monkeypatch.setattr(bench_main, "trim_supported", lambda: True)
    args = bench_main.parse_args(["--methods", "tc.loader,tc.loader(trim=False)"])
    assert args.methods == ["tc.loader", "tc.loader(trim=False)", "floor"]
    assert method_names(args.methods) == ["tc.loader", "tc.loader(trim=False)", "floor"]
    assert set(UNTRIMMED) < set(METHODS)


_INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
        torch.float64: torch.int64}  # fmt: skip


@pytest.mark.parametrize("run", [float("nan"), 0.0], ids=["nan", "zero"])
@pytest.mark.parametrize("dtype", list(_INT))
def test_the_check_compares_bits_not_values(run: float, dtype: torch.dtype) -> None:
    """A trimmed batch's run elements are rebuilt bit for bit: the run's check tells NaN
    payloads and signs, and -0.0 from 0.0, apart where ``==`` cannot."""
    x = torch.randn(3, 40).to(dtype)
    x[:, 30:] = run
    for flip in (1, -(1 << (8 * x.itemsize - 1))):  # the lowest bit (a payload), the sign
        y = x.clone()
        if run != run or flip < 0:  # a NaN's payload, or any float's sign
            y.view(_INT[dtype])[1, 35:] ^= flip
            assert digest({"x": x}) != digest({"x": y})


def test_the_help_and_the_output_say_what_paired_is() -> None:
    assert "paired   the median of the method's per-iteration ratios" in (
        bench_main._parser().format_help()
    )


def test_a_folder_that_shadows_the_package_is_named_at_start(tmp_path: Path) -> None:
    """A folder named tensorcast in the working directory shadows an editable install;
    the bench says so at once, instead of failing deep inside with `no attribute 'pack'`."""
    (tmp_path / "tensorcast").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    rc, out = run_killable(
        [sys.executable, "-m", "tensorcast.bench", "--quick"], tmp_path, env, 60.0
    )
    if "No module named tensorcast.bench" in out:
        pytest.skip("tensorcast is installed so that the folder hides it wholly: nothing runs")
    assert rc == 2, out
    assert f"the folder {tmp_path / 'tensorcast'} shadows the installed package" in out, out
    assert "no attribute" not in out, out


def test_a_batch_file_round_trips(tmp_path: Path) -> None:
    batch = {"audio": torch.randn(2, 100), "lens": torch.tensor([100, 50]), "text": ["a", "b"]}
    nbytes = save_batch(tmp_path / "b.tcb", batch)
    assert nbytes == tc.pack(batch).nbytes
    assert digest(load_batch(tmp_path / "b.tcb")) == digest(batch)
    assert digest(user_batch(str(tmp_path / "b.tcb"))) == digest(batch)


def test_a_torch_save_of_tensors_loads_with_weights_only(tmp_path: Path) -> None:
    batch = {"x": torch.arange(6).reshape(2, 3), "y": [torch.ones(2)]}
    torch.save(batch, tmp_path / "b.pt")
    assert digest(load_batch(tmp_path / "b.pt")) == digest(batch)


def test_a_torch_save_of_objects_is_refused(tmp_path: Path) -> None:
    torch.save({"x": torch.ones(1), "f": Progress}, tmp_path / "b.pt")
    with pytest.raises(pickle.UnpicklingError, match=r"[Ww]eights only load failed"):
        load_batch(tmp_path / "b.pt")


def test_a_truncated_batch_file_says_so(tmp_path: Path) -> None:
    save_batch(tmp_path / "b.tcb", {"x": torch.ones(100)})
    data = (tmp_path / "b.tcb").read_bytes()
    (tmp_path / "b.tcb").write_bytes(data[:-10])
    with pytest.raises(ValueError, match="the prefix promises"):
        load_batch(tmp_path / "b.tcb")


def test_a_lying_header_is_a_header_error(tmp_path: Path) -> None:
    save_batch(tmp_path / "b.tcb", {"x": torch.ones(100)})
    data = bytearray((tmp_path / "b.tcb").read_bytes())
    data[24:28] = b"XXXX"  # the header's magic
    (tmp_path / "b.tcb").write_bytes(bytes(data))
    with pytest.raises(tc.HeaderError):
        load_batch(tmp_path / "b.tcb")


def test_other_files_and_specs_are_value_errors(tmp_path: Path) -> None:
    (tmp_path / "b.bin").write_bytes(b"hello")
    with pytest.raises(ValueError, match="neither a tensorcast batch file"):
        load_batch(tmp_path / "b.bin")
    with pytest.raises(ValueError, match="not of the form module:function"):
        user_batch("no/such/file.tcb")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        user_batch("tensorcast.bench.workloads:nope")


def test_the_progress_bar_is_silent_off_a_terminal() -> None:
    stream = io.StringIO()
    bar = Progress(3, enabled=True, stream=stream)
    for _ in range(3):
        bar.advance("tiny: floor")
    bar.close()
    assert stream.getvalue() == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_draws_on_a_terminal_and_clears_its_line() -> None:
    stream = _Terminal()
    bar = Progress(4, enabled=True, stream=stream)
    for _ in range(4):
        bar.advance("tiny: floor")
    assert "[" + "#" * 30 + "] 100% tiny: floor" in stream.getvalue()
    bar.close()
    assert stream.getvalue().endswith("\r")


def test_quick_workloads_keep_their_structure() -> None:
    for name in WORKLOADS:
        full, quick = make_workload(name), make_workload(name, quick=True)
        assert tc.read_header(tc.pack(quick).header).leaves.__len__() == len(
            tc.read_header(tc.pack(full).header).leaves
        )
    gpt = make_workload("gpt", quick=True)
    assert set(gpt) == {"tokens", "labels", "loss_mask", "attention_mask", "position_ids"}
    assert torch.equal(gpt["tokens"][:, 1:], gpt["labels"][:, :-1])


#: A batch function that waits for the test's word: the run cannot end before the test
#: has read the first workload's rows, whatever the machine's speed.
WAITING_MODULE = """
import os, time
import torch

def held_batch():
    give_up = time.monotonic() + 150  # a failed test leaves no rank behind for long
    while not os.path.exists(os.environ["BENCH_GO"]) and time.monotonic() < give_up:
        time.sleep(0.05)
    return {"x": torch.arange(64)}
"""


@pytest.mark.dist
def test_rows_are_printed_and_the_json_written_as_each_workload_finishes(tmp_path: Path) -> None:
    """Under ``| cat`` (a pipe, as a SLURM log): the first workload's rows, and a JSON of
    it, are out while the run still waits on the second workload."""
    (tmp_path / "held.py").write_text(WAITING_MODULE)
    go, out_json = tmp_path / "go", tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    python_path = [str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")]
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", BENCH_GO=str(go))
    env["PYTHONPATH"] = os.pathsep.join(python_path)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", "-m", "tensorcast.bench", "--quick", "--iters", "1", "--warmup", "0",
            "--workloads", "gpt", "--methods", "tc.broadcast", "--batch", "held:held_batch",
            "--json", str(out_json), "--timeout", "120"]  # fmt: skip
    proc = subprocess.Popen(
        args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or ()], daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + TIMEOUT
        while not any(x.strip().startswith("floor ") for x in seen):  # gpt's last row
            seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
        assert proc.poll() is None  # held: the second workload has not loaded
        partial = json.loads(out_json.read_text())
        assert not partial["complete"] and [w["workload"] for w in partial["workloads"]] == ["gpt"]
        go.touch()
        assert proc.wait(timeout=TIMEOUT) == 0, "".join(seen)
    except queue.Empty:
        pytest.fail(f"no rows while the run went on:\n{''.join(seen)[-4000:]}")
    finally:
        if proc.poll() is None:
            proc.terminate()  # torchrun ends its ranks (they run in sessions of their own)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(10)  # at the pipe's end
        if proc.stdout is not None:
            proc.stdout.close()
    report = json.loads(out_json.read_text())
    assert report["complete"] and len(report["workloads"]) == 2


def test_the_trim_line_says_nothing_trimmed_where_the_bytes_are_equal() -> None:
    times = {"tc.loader": [1.0, 1.2, 0.9], "tc.loader(trim=False)": [1.1, 1.0, 1.0]}
    times |= {"tc.broadcast": [0.5, 0.6, 0.5], "tc.broadcast(trim=False)": [1.0, 1.0, 1.0]}
    wire = {"tc.loader": 100, "tc.loader(trim=False)": 100}
    wire |= {"tc.broadcast": 60, "tc.broadcast(trim=False)": 100}
    wl = {"rows": rows(times, 100, wire), "trim_over_untrimmed": trim_ratios(times)}
    line = trim_line(wl)
    assert line is not None and "tc.loader nothing trimmed" in line, line
    assert "tc.broadcast 0.50x (paired 0.50x, p10-p90 0.50x-0.58x)" in line, line
