#!/usr/bin/env bash
# The GPU check, in one command, for a GPU machine without a package index (< 8 min on an H200):
#   1. build:  NANOVLLM_CUDA=ON pip install --no-build-isolation --no-deps --no-index .
#              (the kernels must build: configuring fails without nvcc)
#   2. tests:  the GPU tests (kernels vs the torch reference, engine vs transformers, graphs)
#   3. bench:  decode kernel bandwidth vs the device's copy bandwidth; throughput (nano-vllm's
#              workload, Qwen3-0.6B-shaped random bf16 model) eager and with CUDA graphs; the GPU
#              decode step at batch 256 beside the scheduler's CPU time per step
#   4. report: one markdown table (benchmarks/gpu_report.py), for benchmarks/RESULTS.md
# Everything printed is also kept under the results directory (default
# benchmarks/results/gpu-<UTC time>/): gpu_check.log, the JSON of each benchmark, summary.md.
#
# Usage: scripts/gpu_check.sh [--dry-run] [--quick] [--skip-build] [--skip-tests] [--skip-bench]
#                             [--deadline SECONDS] [--results DIR] [--archive FILE.tgz]
#   --dry-run     no GPU needed: builds nothing, runs the same test command (GPU tests skip), the
#                 benchmarks' CPU stand-ins (tiny model, --dry-run), and the report
#   --quick       target rows only, fewer sequences: a fast sanity pass
#   --deadline S  finish within S seconds of starting (default 540): every step's timeout is cut to
#                 what is left, steps that no longer fit are skipped, the report is always written
#   --archive F   also pack the results directory into F (.tgz) at the end, for a machine that
#                 hands back only a few files. On the workplace's device machine:
#                   scripts/gpu_check.sh --results /tmp/gpu --deadline 540 --archive "$OUT/gpu.tgz"
# Environment: PYTHON (default python3, else python), BENCH_MODEL_DIR (where the 0.6B-shaped model is kept and
# reused; default ~/.cache/nanovllm/bench-qwen3-0.6b-shape).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$(command -v python3 || command -v python || echo python)}
DRY=0 QUICK=0 BUILD=1 TESTS=1 BENCH=1 DEADLINE=540 ARCHIVE=""
# No network there: transformers / huggingface_hub must never try. The fp32 engine tests compare
# greedy tokens with transformers (top-2 logit margins down to ~5e-5): keep fp32 matmuls IEEE even
# where the image turns TF32 on through the environment.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 NVIDIA_TF32_OVERRIDE=0
unset TORCH_ALLOW_TF32_CUBLAS_OVERRIDE
RESULTS="benchmarks/results/gpu-$(date -u +%Y%m%d-%H%M%S)"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --quick) QUICK=1 ;;
    --skip-build) BUILD=0 ;;
    --skip-tests) TESTS=0 ;;
    --skip-bench) BENCH=0 ;;
    --deadline) DEADLINE="$2"; shift ;;
    --results) RESULTS="$2"; shift ;;
    --archive) ARCHIVE="$2"; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
# tee ignores INT/TERM: a signal to the whole process group (timeout, Ctrl-C) must not take the
# log's pipe away before the trap below has written the report.
exec > >(trap '' INT TERM; exec tee "$RESULTS/gpu_check.log") 2>&1
: > "$RESULTS/status.tsv"
START=$(date +%s)
FAILED=0
# Killed from outside (the device tool's own limit): still leave a summary of what finished.
STEP_PID=""
# finish: the report, then the archive (the bench model of a dry run stays out of it).
finish() {
  "$PY" benchmarks/gpu_report.py "$RESULTS"
  if [ -n "$ARCHIVE" ]; then
    tar czf "$ARCHIVE" --exclude=tiny-model -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" && echo "archived to $ARCHIVE"
  fi
}
interrupted() {
  echo "!!! interrupted after $(( $(date +%s) - START ))s"
  if [ -n "$STEP_PID" ]; then
    kill -TERM "$STEP_PID" 2>/dev/null
    wait "$STEP_PID" 2>/dev/null
    printf '%s\t%s\t%s\n' "$STEP_NAME" interrupted "$(( $(date +%s) - STEP_T0 ))" >> "$RESULTS/status.tsv"
  fi
  finish
  exit 143
}
STEP_NAME="" STEP_T0=0
trap interrupted TERM INT

# run NAME TIMEOUT_S [--log FILE] CMD...: runs, times and records one step (its output into FILE
# instead of the terminal with --log); a failure is recorded, not fatal.
run() {
  local name=$1 limit=$2 log=""; shift 2
  if [ "$1" = "--log" ]; then log=$2; shift 2; fi
  # Kept for the report: 15 s, plus the 10 s that timeout's --kill-after may add to a step.
  local left=$(( START + DEADLINE - 25 - $(date +%s) ))
  if [ "$left" -lt 15 ]; then
    echo "!!! $name skipped: the --deadline is reached"
    printf '%s\t%s\t%s\n' "$name" skipped 0 >> "$RESULTS/status.tsv"
    FAILED=1
    return 1
  fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  echo
  echo "=== [$(( $(date +%s) - START ))s] $name: $*${log:+ > $log}"
  local t0 rc
  t0=$(date +%s)
  # In the background plus `wait`, so that a TERM from outside runs the trap at once.
  if [ -n "$log" ]; then
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1 &
  else
    timeout --kill-after=10 "$limit" "$@" &
  fi
  STEP_PID=$! STEP_NAME=$name STEP_T0=$t0
  wait "$STEP_PID"
  rc=$?
  STEP_PID=""
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$RESULTS/status.tsv"
  if [ "$rc" -ne 0 ]; then
    echo "!!! $name failed (exit $rc)"
    FAILED=1
  fi
  return "$rc"
}

# --- environment ------------------------------------------------------------------------------
"$PY" - "$RESULTS/env.json" "$DRY" <<'EOF'
import json, platform, shutil, subprocess, sys
def out(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        return None
env = {"python": platform.python_version(), "dry_run": sys.argv[2] == "1",
       "date": out(["date", "-u", "+%Y-%m-%d %H:%M UTC"]), "git": out(["git", "describe", "--always", "--dirty"])}
try:
    import torch
    env.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=f"{p.name} ({p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
                       f"sm_{p.major}{p.minor})")
except Exception as e:
    env["torch"] = f"unavailable: {e}"
for name in ("triton", "flash_attn"):
    try:
        env[name] = __import__(name).__version__
    except Exception:
        env[name] = "absent"
smi = out(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
env["driver"] = smi.splitlines()[0] if smi else None
nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if shutil.os.path.exists("/usr/local/cuda/bin/nvcc") else None)
env["nvcc"] = (out([nvcc, "--version"]) or "").splitlines()[-1] if nvcc else "absent"
open(sys.argv[1], "w").write(json.dumps(env, indent=2) + "\n")
print(json.dumps(env, indent=2))
EOF
if [ "$DRY" -eq 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA GPU visible to torch: use --dry-run on a machine without one"
  exit 2
fi

# --- build --------------------------------------------------------------------------------------
if [ "$BUILD" -eq 1 ] && [ "$DRY" -eq 0 ]; then
  run build 600 --log "$RESULTS/build.log" \
    env NANOVLLM_CUDA=ON PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install --no-build-isolation --no-deps --no-index -v .
  tail -3 "$RESULTS/build.log"
  grep -E "CUDA kernels:|nvcc|error" "$RESULTS/build.log" | head -20
elif [ "$DRY" -eq 1 ]; then
  echo "dry run: would run NANOVLLM_CUDA=ON $PY -m pip install --no-build-isolation --no-deps --no-index ."
fi
(cd /tmp && "$PY" -c "import nanovllm._kernels as k; print('nanovllm._kernels:', k.build_targets(), 'CUDA runtime', k.cuda_runtime_version())") \
  || echo "nanovllm._kernels is not importable"

# --- tests --------------------------------------------------------------------------------------
if [ "$TESTS" -eq 1 ]; then
  # Two processes: a sticky CUDA error (an illegal address) in the kernel tests cannot fail the
  # engine tests too. faulthandler dumps the stacks of a test that hangs.
  PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs --durations=8 -o faulthandler_timeout=100)
  run tests_kernels 200 --log "$RESULTS/pytest_kernels.txt" "${PYTEST[@]}" \
    tests/test_kernels_cuda.py tests/test_kernels_build.py tests/test_plan_tensors.py
  tail -15 "$RESULTS/pytest_kernels.txt"
  run tests_engine 150 --log "$RESULTS/pytest_engine.txt" "${PYTEST[@]}" tests/test_cuda_engine.py
  tail -15 "$RESULTS/pytest_engine.txt"
fi

# --- benchmarks ---------------------------------------------------------------------------------
if [ "$BENCH" -eq 1 ]; then
MODEL=${BENCH_MODEL_DIR:-$HOME/.cache/nanovllm/bench-qwen3-0.6b-shape}
if [ "$DRY" -eq 1 ]; then
  MODEL="$RESULTS/tiny-model"
  run decode_kernel 60 "$PY" benchmarks/decode_kernel.py --dry-run --json "$RESULTS/decode_kernel.json"
  run model 120 "$PY" benchmarks/make_bench_model.py "$MODEL" --shape tiny
  # CPU stand-ins of the throughput runs: a handful of short sequences, so the commands are checked.
  THROUGHPUT_ARGS=(--model "$MODEL" --device cpu --num-seqs 4 --min-len 4 --max-input-len 32 --max-output-len 8
                   --max-num-seqs 4 --max-model-len 256 --no-tqdm)
  STEP_ARGS=(--model "$MODEL" --device cpu --batch 8 --context 64 --steps 5)
else
  if [ "$QUICK" -eq 1 ]; then KERNEL_ARGS=(--only-target --iters 10); else KERNEL_ARGS=(); fi
  run decode_kernel 120 "$PY" benchmarks/decode_kernel.py "${KERNEL_ARGS[@]}" --json "$RESULTS/decode_kernel.json"
  run model 180 "$PY" benchmarks/make_bench_model.py "$MODEL" --shape qwen3-0.6b
  if [ "$QUICK" -eq 1 ]; then NUM_SEQS=64; else NUM_SEQS=256; fi
  # nano-vllm's bench: 256 sequences, input and output lengths uniform in [100, 1024], ignore_eos,
  # max_model_len 4096, temperature 0.6 (the script's default).
  THROUGHPUT_ARGS=(--model "$MODEL" --dtype bfloat16 --num-seqs "$NUM_SEQS" --min-len 100 --max-input-len 1024
                   --max-output-len 1024 --max-num-seqs 256 --max-model-len 4096 --no-tqdm)
  STEP_ARGS=(--model "$MODEL" --batch 256 --context 1024 --steps 100)
fi
run throughput_eager 180 "$PY" benchmarks/throughput.py "${THROUGHPUT_ARGS[@]}" --enforce-eager \
  --json "$RESULTS/throughput_eager.json"
run throughput_graphs 150 "$PY" benchmarks/throughput.py "${THROUGHPUT_ARGS[@]}" \
  --json "$RESULTS/throughput_graphs.json"
run sched_overhead 120 --log "$RESULTS/sched_overhead.txt" \
  "$PY" benchmarks/sched_overhead.py --json "$RESULTS/sched_overhead.json"
grep -E "^\| decode \| 256 " "$RESULTS/sched_overhead.txt"
run decode_step 150 "$PY" benchmarks/decode_step.py "${STEP_ARGS[@]}" --sched-json "$RESULTS/sched_overhead.json" \
  --json "$RESULTS/decode_step.json"
fi

# --- report -------------------------------------------------------------------------------------
echo
echo "=== [$(( $(date +%s) - START ))s] report"
finish
echo "total $(( $(date +%s) - START ))s; results in $RESULTS"
exit "$FAILED"
