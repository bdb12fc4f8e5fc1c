"""The Triton paged prefill kernel (nanovllm/attention/triton_prefill.py) without a GPU:

- under Triton's CPU interpreter against the torch reference backend, so CI checks the kernel's
  indexing through the block table, the causal mask of chunks that follow a cached prefix, GQA and
  the online softmax on every run;
- compiled ahead of time for sm_90 (Triton's own ptxas, no driver needed) for every dtype and
  head_dim the engine launches it with, so what the interpreter forgives (types of `tl.dot`
  operands, shared memory over the limit) fails here rather than in a GPU session.

tests/test_kernels_cuda.py runs the compiled kernel on a GPU.

TRITON_INTERPRET must be set before triton is first imported, so the cases run in one process of
their own (tests/triton_interpreted_worker.py) and the rest of the session keeps compiled Triton.

bf16 is not checked here: the interpreter's `tl.dot` gives garbage for bf16 operands (numpy has no
bf16; a 16x16 bf16 product is off by ~1e10 in triton 3.9), so bf16 is left to the GPU test.
Triton >= 3.7 is needed: 3.6's interpreter cannot loop to a loaded bound under numpy 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
INTERPRETER_OK = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)

WORKER = Path(__file__).resolve().parent / "triton_interpreted_worker.py"
TOL = {"float32": 1e-5, "float16": 2e-3}
SHAPES = [(64, 16, 1), (128, 16, 8), (128, 256, 4), (256, 16, 2), (32, 16, 4), (96, 16, 2)]  # head_dim, bs, group


def chunked_case(dtype: str, head_dim: int, block_size: int, group: int) -> dict:
    # Two decodes first (their rows must stay untouched), then chunks: a whole short prompt, a chunk
    # after a cached prefix that ends mid-block, a chunk filling exactly two blocks, a one-token
    # chunk, and a long chunk after a prefix (several query and key tiles).
    return {"dtype": dtype, "head_dim": head_dim, "block_size": block_size, "group": group,
            "context_lens": [50, 3, 40, block_size + 9, 2 * block_size, 1, 300],
            "q_lens": [1, 1, 40, 9, 2 * block_size, 1, 200], "num_decode": 2, "seed": head_dim + group}


CASES = {f"{d}-hd{hd}-bs{bs}-g{g}": chunked_case(d, hd, bs, g) for d in TOL for hd, bs, g in SHAPES}


@cache
def results() -> dict[str, dict] | str:
    """Every case, in one interpreter process (its startup and triton's import are paid once); the
    worker's error output if it failed, so that a failure is not re-run for every case."""
    names = list(CASES)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(WORKER)], input=json.dumps([CASES[n] for n in names]),
                          capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        return proc.stderr[-4000:]
    return dict(zip(names, json.loads(proc.stdout.splitlines()[-1])))


@pytest.mark.skipif(not INTERPRETER_OK, reason=f"triton {triton.__version__}'s interpreter cannot run the kernel "
                    "(needs >= 3.7, which the test extra installs where nothing pins triton)")
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name: str) -> None:
    all_results = results()
    assert not isinstance(all_results, str), f"interpreter run failed:\n{all_results}"
    r = all_results[name]
    assert r["other_rows_untouched"], "rows of the decodes were written"
    assert r["all_written"], "prefill rows left unwritten"
    tol = TOL[CASES[name]["dtype"]]
    assert r["error"] < tol, f"relative error {r['error']:.2e} (tolerance {tol})"


# --- ahead-of-time compile for sm_90 ---------------------------------------------------------------

SM90_SHARED_MEMORY_LIMIT = 227 * 1024
_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_compiles_for_sm90(dtype: torch.dtype, head_dim: int) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.attention import triton_prefill

    kernel = triton_prefill._paged_prefill_kernel
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps, num_stages = triton_prefill._config(dtype, block_d)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_M": block_m, "BLOCK_N": block_n,
                  "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}
    signature = {name: "i32" for name in kernel.arg_names}  # strides, counts, the group
    signature.update({name: "*" + _TRITON_TYPES[dtype] for name in ("Q", "K", "V", "O")})
    signature.update({name: "*i32" for name in ("BT", "CU_Q", "CTX")})
    signature.update({"qk_scale": "fp32", **{name: "constexpr" for name in constexprs}})
    # What an engine launch specializes on: 16-byte aligned activations and caches, their strides
    # (multiples of head_dim) and the block size divisible by 16.
    aligned = [kernel.arg_names.index(n) for n in ("Q", "K", "V", "O", "stride_qt", "stride_qh", "stride_ot",
                                                   "stride_oh", "stride_kb", "stride_ks", "stride_kh", "stride_vb",
                                                   "stride_vs", "stride_vh", "block_size")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True})
    assert compiled.asm.get("cubin"), "no cubin produced"
    assert compiled.metadata.shared <= SM90_SHARED_MEMORY_LIMIT
