"""The Triton dequantizing GEMM (nanovllm/layers/quantization/triton_gemm.py) without a GPU: under
Triton's CPU interpreter against `x @ dequantize(W).T` (ragged rows, columns and depths, every
group size, int4 and int8, symmetric and asymmetric, activation order, bias), and compiled ahead of
time for sm_90 in every activation dtype, so that what the interpreter forgives fails here rather
than in a GPU session. bf16 is not run in the interpreter (its `tl.dot` on bf16 is garbage, see
tests/test_triton_prefill.py); scripts/gpu_check.sh runs the GPU tests on a GPU."""

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
WORKER = Path(__file__).resolve().parent / "triton_quant_worker.py"
TOL = {"float32": 1e-5, "float16": 2e-3}
SHAPES = [(1, 64, 16, 64), (3, 100, 70, 32), (17, 256, 64, 128), (40, 96, 33, 96), (5, 130, 8, 64)]  # m k n group


def case(dtype: str, bits: int, symmetric: bool, i: int) -> dict:
    m, k, n, group = SHAPES[i]
    return {"dtype": dtype, "bits": bits, "symmetric": symmetric, "m": m, "k": k, "n": n, "group": group,
            "act_order": i == 2, "bias": i % 2 == 1, "seed": i + 10 * bits}


CASES = {f"{d}-int{b}-{'sym' if s else 'asym'}-{i}": case(d, b, s, i)
         for d in TOL for b in (4, 8) for s in (True, False) for i in range(len(SHAPES))}


@cache
def results() -> dict[str, float] | str:
    names = list(CASES)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(WORKER)], input=json.dumps([CASES[n] for n in names]),
                          capture_output=True, text=True, env=env, timeout=900, cwd=WORKER.parent)
    if proc.returncode != 0:
        return proc.stderr[-4000:]
    return dict(zip(names, json.loads(proc.stdout.splitlines()[-1])))


@pytest.mark.skipif(not INTERPRETER_OK, reason=f"triton {triton.__version__}'s interpreter cannot run the kernel")
@pytest.mark.parametrize("name", list(CASES))
def test_matches_dequantized_product(name: str) -> None:
    all_results = results()
    assert not isinstance(all_results, str), f"interpreter run failed:\n{all_results}"
    tol = TOL[CASES[name]["dtype"]]
    assert all_results[name] < tol, f"relative error {all_results[name]:.2e} (tolerance {tol})"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_compiles_for_sm90(dtype: torch.dtype, bits: int) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.layers.quantization import triton_gemm

    kernel = triton_gemm._dequant_gemm
    types = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    constexprs = {"GROUP_SIZE": 128, "BITS": bits, "HAS_BIAS": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 32,
                  "PRECISION": triton_gemm.precision(dtype)}
    signature = {name: "i32" for name in kernel.arg_names}
    signature.update({"x_ptr": "*" + types[dtype], "bias_ptr": "*" + types[dtype], "y_ptr": "*" + types[dtype],
                      "q_ptr": "*u8" if bits == 4 else "*i8", "s_ptr": "*fp32", "z_ptr": "*fp32",
                      **{name: "constexpr" for name in constexprs}})
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm.get("cubin"), "no cubin produced"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_on_gpu_matches_dequantized_product(dtype: torch.dtype, bits: int) -> None:
    from quant_helpers import random_quantized

    from nanovllm.layers.quantization.triton_gemm import TritonWeight, linear

    w = random_quantized(1000, 768, bits, 128, symmetric=False, seed=bits, act_order=True)
    weight = TritonWeight.from_weight(w, "cuda")
    for m in (1, 7, 300):
        x = torch.randn(m, 768, device="cuda").to(dtype)
        expected = x.double() @ w.dequantize(torch.float64).cuda().t()
        err = (linear(x, weight, None).double() - expected).abs().max() / expected.abs().max()
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), (m, float(err))


@cuda
def test_quantized_engine_on_gpu_matches_transformers(tmp_path: Path) -> None:
    """A W4A16 checkpoint from `nanovllm quantize`, run on the GPU (fp32, the Triton GEMM), gives
    transformers' greedy tokens on the same (dequantized) weights."""
    pytest.importorskip("compressed_tensors")
    import transformers
    from engine_helpers import random_prompts
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from nanovllm import LLM, SamplingParams
    from nanovllm.builtin_model import TinyModelSpec, create_model_dir
    from nanovllm.entrypoints.quantize import quantize_checkpoint

    spec = TinyModelSpec(vocab_size=512, hidden_size=128, intermediate_size=256, head_dim=32, seed=41)
    out = quantize_checkpoint(create_model_dir(tmp_path / "dense", spec=spec), tmp_path / "w4", "w4a16", 32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    llm = LLM(str(out), device="cuda", dtype="float32", num_kvcache_blocks=64, max_model_len=256)
    for prompt in random_prompts([4, 30], 512, seed=2):
        ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert ours == theirs[0, len(prompt):].tolist()


@cuda
def test_quantized_experts_on_gpu_match_transformers(tmp_path: Path) -> None:
    """A Qwen3-MoE quantized by `nanovllm quantize` (w8a16, experts included), run on the GPU (fp32;
    each expert's projections on the Triton GEMM), gives transformers' greedy tokens on the dense
    checkpoint carrying the same dequantized weights."""
    from engine_helpers import assert_greedy_matches, random_prompts
    from moe_models import make_moe_model
    from test_quant_models import our_dense_weights_of, write_dense

    from nanovllm import LLM
    from nanovllm.entrypoints.quantize import quantize_checkpoint
    from nanovllm.models import load_model

    dense = make_moe_model(tmp_path, "qwen3_moe_mixed")
    out = quantize_checkpoint(dense, tmp_path / "w8", "w8a16")
    model, _ = load_model(out, dtype="float32")
    oracle = write_dense(dense, tmp_path / "oracle", {f"{m}.weight": w for m, w in our_dense_weights_of(model).items()})
    llm = LLM(str(out), device="cuda", dtype="float32", num_kvcache_blocks=64, max_model_len=256)
    assert_greedy_matches(llm, oracle, random_prompts([4, 30], 512, seed=2), max_new=12)
