#!/usr/bin/env bash
# The GPU check, in one command, for a GPU machine without a package index (one H200, 15 minutes of
# device time per session, machine start included). On the workplace's device tool, the call is:
#
#   run(command='scripts/gpu_check.sh --results /tmp/gpu --deadline 450 --archive "$OUT/gpu.tgz"',
#       carry=[".whl"], timeout_s=510)
#
# (.whl comes from scripts/gpu_wheels.sh, run here beforehand: the Python packages the image
# lacks.) With the machine's start (1-2 min) that leaves ~4 minutes for one rerun after a fix,
# e.g. --quick --skip-bench --deadline 180 (a fresh machine builds again). Step costs, dry run and
# estimates on the H200: benchmarks/RESULTS.md, "GPU".
# Steps, the most informative first; each is timed, a failure is recorded and the next step runs:
#   0. wheels:    pip install --no-index --no-deps --target SITE .whl/*.whl; SITE goes first on
#                 PYTHONPATH for every later step
#   1. preflight: imports every module the package, the server, the tests and the benchmarks need
#                 (scripts/gpu_preflight.py); anything missing stops the check at once, listed
#   2. build:     NANOVLLM_CUDA=ON pip install --no-build-isolation --no-deps --no-index . (all
#                 cores; the kernels must build: configuring fails without nvcc)
#   3. tests:     kernels vs the torch reference; engine parity with transformers (eager, graphs,
#                 a one-rank NCCL group); every sampling path on CUDA with the sync audit
#   4. bench:     decode kernel bandwidth vs the device's copy bandwidth; throughput (nano-vllm's
#                 workload, Qwen3-0.6B-shaped random bf16 model) eager and with CUDA graphs; the GPU
#                 decode step at batch 256 beside the scheduler's CPU time per step
#   5. suite:     the rest of the test suite, GPU visible, on all cores (pytest -n), as time allows
#   6. report:    one markdown table (benchmarks/gpu_report.py), for benchmarks/RESULTS.md
# Everything printed is also kept under the results directory (default
# benchmarks/results/gpu-<UTC time>/): gpu_check.log, the JSON of each benchmark, summary.md.
#
# Usage: scripts/gpu_check.sh [--dry-run] [--quick] [--skip-build] [--skip-tests] [--skip-bench]
#                             [--skip-suite] [--wheels DIR] [--site DIR] [--require MOD]...
#                             [--deadline SECONDS] [--results DIR] [--archive FILE.tgz]
#   --dry-run     no GPU needed: builds nothing; installs the wheels and runs the preflight as on
#                 the GPU machine, runs the same tests (GPU tests skip), the benchmarks' CPU
#                 stand-ins (tiny model, --dry-run), and the report (tests/test_gpu_check.py runs
#                 this with everything else skipped)
#   --quick       target rows only, fewer sequences, no suite: a fast sanity pass
#   --wheels DIR  wheels to install first (default .whl, when it exists); --site DIR: where
#                 (default /tmp/nanovllm-site)
#   --require MOD one more module the preflight must import (repeatable)
#   --deadline S  finish within S seconds of starting (default 450): every step's timeout is cut to
#                 what is left, steps that no longer fit are skipped, the report is always written
#   --archive F   also pack the results directory into F (.tgz) at the end, for a machine that
#                 hands back only a few files
# Environment: PYTHON (default python3, else python), BENCH_MODEL_DIR (where the 0.6B-shaped model is kept and
# reused; default ~/.cache/nanovllm/bench-qwen3-0.6b-shape).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$(command -v python3 || command -v python || echo python)}
DRY=0 QUICK=0 BUILD=1 TESTS=1 BENCH=1 SUITE=1 DEADLINE=450 ARCHIVE="" WHEELS="" SITE=/tmp/nanovllm-site
REQUIRE=()
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
    --skip-suite) SUITE=0 ;;
    --wheels) WHEELS="$2"; shift ;;
    --site) SITE="$2"; shift ;;
    --require) REQUIRE+=(--also "$2"); shift ;;
    --deadline) DEADLINE="$2"; shift ;;
    --results) RESULTS="$2"; shift ;;
    --archive) ARCHIVE="$2"; shift ;;
    -h|--help) sed -n '2,43p' "$0"; exit 0 ;;
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
  # In the background plus `wait`, so that a TERM from outside runs the trap at once. A step past
  # its limit gets INT first: pytest then still lists the failures so far and its counts (on the
  # 2026-12-04 H200 run, TERM cut the suite at 98% with ~36 failures and no names).
  if [ -n "$log" ]; then
    timeout -s INT --kill-after=10 "$limit" "$@" > "$log" 2>&1 &
  else
    timeout -s INT --kill-after=10 "$limit" "$@" &
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
smi = out(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
env["nvidia_smi"] = smi.splitlines()[0] if smi else None
env["driver"] = smi.splitlines()[0].rsplit(",", 1)[-1].strip() if smi else None
nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if shutil.os.path.exists("/usr/local/cuda/bin/nvcc") else None)
env["nvcc"] = (out([nvcc, "--version"]) or "").splitlines()[-1] if nvcc else "absent"
open(sys.argv[1], "w").write(json.dumps(env, indent=2) + "\n")
print(json.dumps(env, indent=2))
EOF
if [ "$DRY" -eq 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA GPU visible to torch: use --dry-run on a machine without one"
  exit 2
fi

# --- wheels and preflight -------------------------------------------------------------------
if [ -z "$WHEELS" ] && [ -d .whl ]; then WHEELS=.whl; fi
if [ -n "$WHEELS" ]; then
  # The wheels are for the GPU machine's Python (3.12). Run by another Python (a dry run here),
  # they are installed for 3.12 all the same, which checks that the set installs as a whole, but
  # stay off PYTHONPATH: their compiled modules could not load here.
  FOR_PY=$("$PY" - "$WHEELS" <<'EOF2'
import pathlib, sys
here = f"cp{sys.version_info.major}{sys.version_info.minor}"
tags = {w.name.split("-")[-3] for w in pathlib.Path(sys.argv[1]).glob("*.whl")}
print(next((t for t in sorted(tags) if t.startswith("cp3") and t != here), ""))
EOF2
)
  CROSS=()
  if [ -n "$FOR_PY" ]; then
    CROSS=(--python-version "3.${FOR_PY#cp3}" --implementation cp --abi "$FOR_PY" --abi abi3 --abi none
           --only-binary=:all:)
  fi
  # --target: the image's own site-packages stay untouched; SITE goes first on PYTHONPATH, so a
  # carried wheel wins over an older copy in the image.
  run wheels 120 bash -c 'site=$1 py=$2 dir=$3; shift 3; rm -rf "$site" &&
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$@" \
      "$dir"/*.whl' wheels "$SITE" "$PY" "$WHEELS" "${CROSS[@]}"
  if [ -z "$FOR_PY" ]; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE (first on PYTHONPATH)"
  else
    echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE for Python ${CROSS[1]} ($FOR_PY): not this Python's, so not on PYTHONPATH"
  fi
fi
if ! run preflight 120 "$PY" scripts/gpu_preflight.py --also xdist "${REQUIRE[@]}" --json "$RESULTS/preflight.json"; then
  echo "!!! preflight failed: nothing else can run; carry the missing wheels (scripts/gpu_wheels.sh) and rerun"
  finish
  exit 3
fi

# --- build --------------------------------------------------------------------------------------
if [ "$BUILD" -eq 1 ] && [ "$DRY" -eq 0 ]; then
  run build 300 --log "$RESULTS/build.log" \
    env NANOVLLM_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" PIP_BREAK_SYSTEM_PACKAGES=1 \
    "$PY" -m pip install --no-build-isolation --no-deps --no-index -v .
  tail -3 "$RESULTS/build.log"
  grep -E "CUDA kernels:|nvcc|error" "$RESULTS/build.log" | head -20
elif [ "$DRY" -eq 1 ]; then
  echo "dry run: would run NANOVLLM_CUDA=ON $PY -m pip install --no-build-isolation --no-deps --no-index ."
fi
if [ "$TESTS" -eq 1 ] || [ "$BENCH" -eq 1 ]; then
  (cd /tmp && "$PY" -c "import nanovllm._kernels as k; print('nanovllm._kernels:', k.build_targets(), 'CUDA runtime', k.cuda_runtime_version())") \
    || echo "nanovllm._kernels is not importable"
fi

# --- tests --------------------------------------------------------------------------------------
# Each group in its own process: a sticky CUDA error (an illegal address) in one cannot fail the
# next. faulthandler dumps the stacks of a test that hangs.
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfEs --durations=8 -o faulthandler_timeout=100)
# The quantized GEMM's GPU tests by name: the rest of its file runs Triton's interpreter on the CPU.
GPU_TESTS=(tests/test_kernels_cuda.py tests/test_kernels_build.py tests/test_plan_tensors.py tests/test_staging.py
           tests/test_moe_cuda.py tests/test_quant_triton.py::test_on_gpu_matches_dequantized_product
           tests/test_quant_triton.py::test_quantized_engine_on_gpu_matches_transformers
           tests/test_quant_triton.py::test_quantized_experts_on_gpu_match_transformers
           tests/test_cuda_engine.py tests/test_tensor_parallel_one_rank.py
           tests/test_sampling_cuda.py)
if [ "$TESTS" -eq 1 ]; then
  run tests_kernels 150 --log "$RESULTS/pytest_kernels.txt" "${PYTEST[@]}" "${GPU_TESTS[@]:0:8}"
  tail -15 "$RESULTS/pytest_kernels.txt"
  run tests_engine 150 --log "$RESULTS/pytest_engine.txt" "${PYTEST[@]}" "${GPU_TESTS[@]:8:2}"
  tail -15 "$RESULTS/pytest_engine.txt"
  run tests_sampling 120 --log "$RESULTS/pytest_sampling.txt" "${PYTEST[@]}" "${GPU_TESTS[@]:10:1}"
  tail -15 "$RESULTS/pytest_sampling.txt"
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

# --- the rest of the suite --------------------------------------------------------------------
# With the GPU visible (a test that picks the device itself must pass there too), on every core
# (two OpenMP threads per worker: torch's default of one per core, per worker, would thrash).
if [ "$SUITE" -eq 1 ] && [ "$QUICK" -eq 0 ] && [ "$TESTS" -eq 1 ]; then
  IGNORE=()
  for t in "${GPU_TESTS[@]}"; do
    case "$t" in *::*) IGNORE+=(--deselect "$t") ;; *) IGNORE+=(--ignore "$t") ;; esac
  done
  run suite 600 --log "$RESULTS/pytest_suite.txt" env OMP_NUM_THREADS=2 "${PYTEST[@]}" -n "$(nproc)" "${IGNORE[@]}" tests
  tail -25 "$RESULTS/pytest_suite.txt"
fi

# --- report -------------------------------------------------------------------------------------
echo
echo "=== [$(( $(date +%s) - START ))s] report"
finish
echo "total $(( $(date +%s) - START ))s; results in $RESULTS"
exit "$FAILED"
