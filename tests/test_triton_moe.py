"""The Triton MoE grouped GEMM (nanovllm/layers/triton_moe.py) without a GPU:

- under Triton's CPU interpreter against the per-token reference (tests/moe_cases.py), fp32, so CI
  checks the grouping by expert, the padded blocks, the gather of input rows, the routing weights
  and the sum over each row's experts on every run;
- compiled ahead of time for sm_90 in every dtype, so what the interpreter forgives fails here
  rather than in a GPU session.

tests/test_moe_cuda.py runs the compiled kernel on a GPU (scripts/gpu_check.sh). bf16 is left to
it: the interpreter's `tl.dot` gives garbage for bf16 operands (tests/test_triton_prefill.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from functools import cache
from pathlib import Path

import pytest
import torch
from moe_cases import CASES, case_id

triton = pytest.importorskip("triton")
INTERPRETER_OK = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)

WORKER = Path(__file__).resolve().parent / "triton_moe_interpreted_worker.py"
TOL = 1e-5


@cache
def results() -> list[dict] | str:
    """Every case in one interpreter process; the worker's error output if it failed."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(WORKER)], input=json.dumps([asdict(c) for c in CASES]),
                          capture_output=True, text=True, env=env, timeout=900, cwd=WORKER.parent)
    if proc.returncode != 0:
        return proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.skipif(not INTERPRETER_OK, reason=f"triton {triton.__version__}'s interpreter is too old (needs >= 3.7)")
@pytest.mark.parametrize("index", range(len(CASES)), ids=[case_id(c) for c in CASES])
def test_interpreted_kernel_matches_reference(index: int) -> None:
    all_results = results()
    assert not isinstance(all_results, str), f"interpreter run failed:\n{all_results}"
    r = all_results[index]
    assert r["aligned"], "align() lost, repeated or misplaced an assignment"
    assert r["shape_ok"]
    assert r["error"] < TOL, f"relative error {r['error']:.2e} (tolerance {TOL})"


_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@pytest.mark.parametrize("mul_weights", [False, True])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_compiles_for_sm90(dtype: torch.dtype, block_m: int, mul_weights: bool) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.layers import triton_moe

    kernel = triton_moe._grouped_gemm_kernel
    fp32 = dtype == torch.float32
    constexprs = {"MUL_WEIGHTS": mul_weights, "BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 32 if fp32 else 64,
                  "PRECISION": "ieee" if fp32 else "tf32"}
    signature = {name: "i32" for name in kernel.arg_names}  # sizes and strides
    signature.update({name: "*" + _TRITON_TYPES[dtype] for name in ("A", "B", "C")})
    signature.update({"SORTED": "*i32", "BLOCK_EXPERT": "*i32", "WEIGHTS": "*fp32"})
    signature.update({name: "constexpr" for name in constexprs})
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 2 if fp32 else 3})
    assert compiled.asm.get("cubin"), "no cubin produced"
