"""bf16 on CPU: our bf16 forward (bf16 weights, activations and KV cache, the C++ attention kernel)
against transformers' bf16 forward and an fp32 reference, and how a dtype is chosen on CPU.

Tolerance: bf16 keeps 8 significant bits, so every layer adds relative error of order 2^-8; on
these tiny models that is about 1% of the largest logit. TOL = 3% of it leaves headroom without
letting a wrong computation through (a skipped norm or a misplaced head changes logits by O(1)).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import make_tiny_model
from tiny_pager import TinyPager

from nanovllm import SamplingParams, model_config
from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.layers import bind_kv_cache
from nanovllm.llm import LLM
from nanovllm.model_config import load_model_config, resolve_dtype
from nanovllm.models import load_model

REL_TOL = 0.03
BLOCK_SIZE = 4
NUM_BLOCKS = 64
# A prompt in two chunks (the second over the cached first), then single-token decodes.
CHUNKS = [13, 20, 1, 1, 1, 1, 1, 1, 1]


def our_logits(path: Path, tokens: list[int], prepack: bool = False) -> torch.Tensor:
    """Logits at every position, fed through the paged cache chunk by chunk in bf16 (with the
    weights packed for the CPU's GEMMs, as the engine does, if `prepack`)."""
    model, config = load_model(path, dtype="bfloat16", attn_backend="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    if prepack:
        cpu_gemm.prepack_model(model)
    bind_kv_cache(model, torch.zeros(2, config.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads,
                                     config.head_dim, dtype=torch.bfloat16))
    pager = TinyPager(NUM_BLOCKS, BLOCK_SIZE, seed=1)
    out, done = [], 0
    for n in CHUNKS:
        batch = pager.step([(0, tokens[done:done + n])])
        done += n
        with torch.no_grad():
            out.append(model.compute_logits(model(batch.input_ids, batch.positions, batch.meta)))
    return torch.cat(out)


def hf_logits(path: Path, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama"])
def test_bf16_logits_match_transformers_bf16_and_fp32(name: str, tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, name)
    tokens = torch.randint(0, load_model_config(path).vocab_size, (sum(CHUNKS),),
                           generator=torch.Generator().manual_seed(0)).tolist()
    ours = our_logits(path, tokens)
    hf16 = hf_logits(path, tokens, torch.bfloat16)
    fp32 = hf_logits(path, tokens, torch.float32)
    tol = REL_TOL * fp32.abs().max().item()
    assert (ours - hf16).abs().max() < tol
    assert (ours - fp32).abs().max() < tol
    # Greedy: wherever transformers' bf16 top-2 margin exceeds the tolerance, we pick its token.
    top2 = hf16.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > tol
    assert clear.sum() >= len(tokens) // 4, "too few positions with a clear winner: the check would be vacuous"
    assert torch.equal(ours.argmax(-1)[clear], hf16.argmax(-1)[clear])


def test_llm_bfloat16_runs_bf16_throughout(tmp_path: Path) -> None:
    llm = LLM(str(make_tiny_model(tmp_path, "qwen3")), device="cpu", dtype="bfloat16", num_kvcache_blocks=32,
              block_size=16, max_model_len=512)
    runner = llm.engine.executor.runner
    assert runner.dtype == torch.bfloat16 and runner.attn_backend == "cpu"
    assert runner.kv_cache is not None and runner.kv_cache.dtype == torch.bfloat16
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


@pytest.fixture
def config(tmp_path: Path) -> model_config.ModelConfig:
    return load_model_config(make_tiny_model(tmp_path, "llama"))


def _with_checkpoint_dtype(config: model_config.ModelConfig, dtype: torch.dtype) -> model_config.ModelConfig:
    return replace(config, torch_dtype=dtype)


@pytest.mark.parametrize("native", [True, False])
def test_auto_follows_a_bf16_checkpoint_where_the_cpu_computes_bf16(
        config: model_config.ModelConfig, native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_config, "native_bf16", lambda: native)
    bf16_ckpt = _with_checkpoint_dtype(config, torch.bfloat16)
    assert resolve_dtype(bf16_ckpt, "auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype(bf16_ckpt, "float32", "cpu") == torch.float32
    # Not the CPU's business elsewhere.
    assert resolve_dtype(bf16_ckpt, "auto", "cuda") == torch.bfloat16


@pytest.mark.parametrize("kernel,level", [("onednn", logging.WARNING), ("avx2", logging.INFO)])
def test_explicit_bf16_without_native_support_runs_and_says_how(
        config: model_config.ModelConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        kernel: str, level: int) -> None:
    """oneDNN then multiplies on fp32 copies of the weights (twice the memory: a warning); our AVX2
    GEMM widens the bf16 weights in registers (a note)."""
    monkeypatch.setattr(model_config, "native_bf16", lambda: False)
    monkeypatch.setattr(model_config, "gemm_kernel", lambda: kernel)
    with caplog.at_level(logging.INFO, logger="nanovllm.model_config"):
        assert resolve_dtype(config, "bfloat16", "cpu") == torch.bfloat16
    [record] = [r for r in caplog.records if "AVX512-BF16/AMX" in r.getMessage()]
    assert record.levelno == level
    assert ("float32 copies" in record.getMessage()) == (kernel == "onednn")


def test_float16_on_cpu_is_an_error_or_exact_fp32(config: model_config.ModelConfig) -> None:
    with pytest.raises(ValueError, match="float16 is not supported on CPU"):
        resolve_dtype(config, "float16", "cpu")
    assert resolve_dtype(_with_checkpoint_dtype(config, torch.float16), "auto", "cpu") == torch.float32
    assert resolve_dtype(config, "float16", "cuda") == torch.float16
