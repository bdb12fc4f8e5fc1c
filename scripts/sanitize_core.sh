#!/usr/bin/env bash
# Builds the C++ core with AddressSanitizer + UndefinedBehaviorSanitizer (warnings as errors)
# into build/sanitize and runs the core's test suite against that build, and the attention kernel's
# test of sequences whose block tables end with their blocks.
# Usage: scripts/sanitize_core.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build/sanitize
PY=$(command -v python3 || command -v python)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DNANOVLLM_SANITIZE=ON -DNANOVLLM_WERROR=ON -DNANOVLLM_CUDA=OFF \
  -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" >/dev/null
# _core and _cpu too: importing nanovllm imports the text side and the CPU kernels.
cmake --build "$BUILD" --target _C _cpu _core -j 2
# A package tree holding the sanitized extensions, put first on the path for the tests.
PKG="$BUILD/pkg"
rm -rf "$PKG" && mkdir -p "$PKG"
cp -r nanovllm "$PKG/"
find "$PKG" -name '*.so' -delete
cp "$BUILD"/_C*.so "$BUILD"/_cpu*.so "$BUILD"/_core*.so "$PKG/nanovllm/"
# Python is not instrumented, so the runtimes are preloaded; its allocator "leaks" by design.
LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
PYTHONPATH="$PKG" "$PY" -m pytest -p no:cacheprovider -q tests/test_core_*.py \
  tests/test_cpu_attention.py::test_one_sequence_reads_only_its_own_blocks "$@"
