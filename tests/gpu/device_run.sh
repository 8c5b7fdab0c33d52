#!/usr/bin/env bash
# The GPU checks in one command, for a machine with one GPU:
#
#     bash tests/gpu/device_run.sh OUTDIR      # run everything (at most 480 s of parts)
#     bash tests/gpu/device_run.sh --plan      # print the plan only
#
# Run from a plain copy of the tree: nothing is installed (the repository goes on
# PYTHONPATH); it needs python3 with torch, numpy and a CUDA device (PYTHON= picks another
# interpreter). Each part is a process of its own under a hard limit, and writes its JSON
# and log into OUTDIR as soon as it ends, so a run cut off still returns what it did; the
# last part writes OUTDIR/summary.txt. Without CUDA it prints the plan and exits 77.
# What each check would catch: docs/reliability.md, "GPU checks".
#
# Exit status: 0 when every part ended cleanly and no check failed, 1 otherwise (python3
# cannot import torch included), 77 when torch imports and sees no CUDA device (nothing
# run), 2 on a usage error. An environment step that fails otherwise, or runs out of its
# time (a cold `import torch` of CUDA wheels and CUDA's start-up can take tens of
# seconds), does not end the run: the parts have limits of their own.
set -u

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
ROOT=$PWD
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# Each part's hard limit (seconds, the kill's grace included); A, B and C are the
# figures of gpu_stream_check.PART_TIMEOUT_S (tests/gpu/test_device_run_plan.py checks it).
PARTS=(env A B C overlap summary)
declare -A LIMIT=([env]=40 [A]=65 [B]=140 [C]=170 [overlap]=55 [summary]=10)
declare -A WHAT=(
  [env]="python, torch, numpy and pytest versions, the CUDA device, NCCL, nvidia-smi (compute mode) -> env.json"
  [A]="gpu_stream_check.py --parts A, one process, no group: R1 R2 R3 R4 R5 R6 T1 T2 T3 T18a"
  [B]="gpu_stream_check.py --parts B, two gloo ranks sharing the GPU: R7 T4 T5 T5b T7 T15 T18b T6 T6b"
  [C]="gpu_stream_check.py --parts C, an NCCL group of one: R8 T8 T9 T10 T11 T23 T16 T13a T13b T13c T14 T19 T20 T21 T22 T12 T12s T12p T24 T6c"
  [overlap]="bench_gpu_overlap.py --steps 30: the share of the upload hidden under a step, H2D against a plain pinned copy -> overlap.json"
  [summary]="summary.txt: every check PASS / FAIL / SKIP, the overlap share, H2D against a plain pinned copy"
)

plan() {
  echo "tensorcast GPU run: plan (each part a process of its own under a hard limit)"
  local total=0 part
  for part in "${PARTS[@]}"; do
    printf '  %-8s %4d s  %s\n' "$part" "${LIMIT[$part]}" "${WHAT[$part]}"
    total=$((total + LIMIT[$part]))
  done
  echo "total: $total s"
}

if [[ $# -ne 1 || $1 == -h || $1 == --help ]]; then
  echo "usage: bash tests/gpu/device_run.sh OUTDIR | --plan" >&2
  exit 2
fi
if [[ $1 == --plan ]]; then
  plan
  exit 0
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
STARTED=$SECONDS

# -- env: what the machine is; whether there is a CUDA device at all ---------------------
if command -v nvidia-smi > /dev/null 2>&1; then
  timeout -k 1 3 nvidia-smi -L > "$OUT/nvidia-smi.txt" 2>&1
  timeout -k 1 3 nvidia-smi --query-gpu=index,compute_mode --format=csv,noheader \
    > "$OUT/compute-mode.txt" 2>&1
fi
# exit 0: a device; 3: torch imports and sees none; 4: no torch; anything else: go on
timeout -k 2 $((LIMIT[env] - 10)) "$PY" - "$OUT" > "$OUT/env.log" 2>&1 <<'PYTHON'
import json
import platform
import sys
from pathlib import Path

out = Path(sys.argv[1])
env = {"python": platform.python_version(), "executable": sys.executable}
smi = out / "nvidia-smi.txt"
if smi.exists():
    env["nvidia_smi"] = [x for x in smi.read_text(errors="replace").splitlines() if x.strip()]
modes = out / "compute-mode.txt"
if modes.exists():  # EXCLUSIVE_PROCESS: one CUDA context at a time on the GPU
    first = modes.read_text(errors="replace").strip().splitlines()[:1]
    env["compute_mode"] = first[0].split(",")[-1].strip() if first else None
for name in ("numpy", "pytest"):
    try:
        env[name] = __import__(name).__version__
    except Exception as e:
        env[name] = f"missing ({type(e).__name__})"
try:
    import torch
except Exception as e:
    env["error"] = f"{sys.executable} cannot import torch: {type(e).__name__}: {e}"
    env["cuda_available"] = None
else:
    env.update(torch=torch.__version__, cuda=torch.version.cuda)
    env["cuda_available"] = torch.cuda.is_available()
    if env["cuda_available"]:
        env["device"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        env["device_count"] = torch.cuda.device_count()
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:
            env["nccl"] = f"unknown ({type(e).__name__})"
    else:
        built = "a CPU-only build" if torch.version.cuda is None else "no visible CUDA device"
        env["error"] = f"torch {torch.__version__} has {built}"
(out / "env.json").write_text(json.dumps(env, indent=1) + "\n")
print(json.dumps(env, indent=1))
sys.exit({True: 0, False: 3, None: 4}[env["cuda_available"]])
PYTHON
rc=$?
why=$(sed -n 's/^ *"error": "\(.*\)",\{0,1\}$/\1/p' "$OUT/env.json" 2> /dev/null | head -n 1)
if [[ $rc -eq 3 || $rc -eq 4 ]]; then
  if [[ $rc -eq 3 ]]; then
    echo "needs a CUDA device: ${why:-none visible}; nothing was run"
  else
    echo "needs torch: ${why:-$PY cannot import it}; nothing was run (PYTHON= picks another python)"
  fi
  plan | tee "$OUT/plan.txt"
  [[ $rc -eq 3 ]] && exit 77
  exit 1
fi
plan | tee "$OUT/plan.txt"
cat "$OUT/env.log"
if [[ $rc -ne 0 ]]; then  # each part finds out for itself, under its own limit
  echo "the environment step did not finish cleanly (rc=$rc, limit $((LIMIT[env] - 10)) s); on to the parts"
fi

# -- the parts -------------------------------------------------------------------------
FAILED=()

run_part() {  # name, then the command; under the part's hard limit, its output in OUTDIR
  local name=$1 limit=${LIMIT[$1]} log="$OUT/$1.log" grace=5
  shift
  [[ $name == [ABC] ]] && log="$OUT/part-$name.log"
  [[ $name == summary ]] && grace=3
  echo "=== $name (limit $limit s, $((SECONDS - STARTED)) s into the run): $*"
  # TERM at the limit less the grace, KILL at the limit. timeout signals its whole
  # process group (a benchmark's ranks included); gpu_stream_check's part processes have
  # sessions of their own and end themselves by the deadline given.
  timeout -k $grace $((limit - grace)) "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc after $((SECONDS - STARTED)) s"
  [[ $rc -eq 0 ]] || FAILED+=("$name (rc=$rc)")
}

for part in A B C; do
  # the part must be done by then: its driver keeps a few seconds to write its verdicts
  deadline=$(($(date +%s) + LIMIT[$part] - 5))
  run_part "$part" "$PY" tests/gpu/gpu_stream_check.py --parts "$part" --out "$OUT" \
    --deadline "$deadline"
done
run_part overlap "$PY" benchmarks/bench_gpu_overlap.py --steps 30 --timeout $((LIMIT[overlap] - 20)) \
  --json "$OUT/overlap.json"
run_part summary "$PY" tests/gpu/gpu_stream_check.py --summary "$OUT"

echo "device_run: $((SECONDS - STARTED)) s in all; OUTDIR: $OUT"
if [[ ${#FAILED[@]} -gt 0 ]]; then
  echo "device_run: not clean: ${FAILED[*]}"
  exit 1
fi
exit 0
