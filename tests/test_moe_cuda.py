"""The mixture-of-experts layer on a GPU (run by scripts/gpu_check.sh; skipped without CUDA): the
Triton grouped GEMM against the per-token reference in fp32 and bf16, inside a CUDA graph replayed
with other routings (nothing in it may wait for the host), and Qwen3-MoE / Mixtral through the
engine against transformers on the same GPU, eager and with CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import assert_greedy_matches, random_prompts
from moe_cases import CASES, Case, case_id, make_weights, per_token_reference, relative_error
from moe_models import make_moe_model

from nanovllm.attention import cuda_ops
from nanovllm.layers import moe_torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
triton_moe = pytest.importorskip("nanovllm.layers.triton_moe", reason="needs triton")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_grouped_gemm_matches_reference(case: Case, dtype: torch.dtype) -> None:
    x, logits, w13, w2 = make_weights(case, seed=1, dtype=dtype)
    ref = per_token_reference(x, logits, w13, w2, case.top_k, case.renormalize)
    ids, weights = moe_torch.route(logits.cuda(), case.top_k, case.renormalize)
    got = triton_moe.fused_experts(x.cuda(), ids, weights, w13.cuda(), w2.cuda())
    assert got.dtype == dtype and got.shape == x.shape
    assert relative_error(got, ref) < TOL[dtype]


def test_grouped_gemm_replays_in_a_cuda_graph_with_new_routing() -> None:
    case = CASES[3]
    x, logits, w13, w2 = (t.cuda() for t in make_weights(case, seed=2))

    def layer() -> torch.Tensor:
        ids, weights = moe_torch.route(logits, case.top_k, case.renormalize)
        return triton_moe.fused_experts(x, ids, weights, w13, w2)

    layer()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    for seed in (3, 4):
        logits.copy_(torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        ref = per_token_reference(x.cpu(), logits.cpu(), w13.cpu(), w2.cpu(), case.top_k, case.renormalize)
        assert relative_error(out, ref) < TOL[torch.float32]


@pytest.fixture(scope="module", params=["qwen3_moe_mixed", "mixtral"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_moe_model(tmp_path_factory.mktemp("moe_cuda"), request.param)


@pytest.mark.skipif(not cuda_ops.is_available(), reason="nanovllm._kernels is not built (no nvcc at install)")
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
def test_engine_greedy_matches_transformers(moe_dir: Path, enforce_eager: bool) -> None:
    from test_cuda_engine import hf_greedy_cuda

    from nanovllm import LLM

    llm = LLM(str(moe_dir), device="cuda", dtype="float32", enforce_eager=enforce_eager, num_kvcache_blocks=256,
              block_size=16, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=48)
    assert (llm.engine.executor.runner.graphs is None) == enforce_eager
    assert_greedy_matches(llm, moe_dir, random_prompts([1, 7, 16, 33, 100], 512, seed=1), 24, hf_greedy_cuda)
