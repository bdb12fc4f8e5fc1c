"""The LM head's greedy tokens without its logits (cpu_gemm.greedy, gemm_greedy_cpu): the same
tokens as the sampler's argmax of cpu_gemm.logits, through ties across panels and threads, NaN and
infinite logits, on every path the head takes (AMX tiles where the CPU has them and k is a multiple
of 32, the pair tiles, fp32 weights); and the engine takes it exactly for the steps whose rows all
sample greedily and want nothing else of their logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nanovllm import LLM, SamplingParams, _cpu
from nanovllm.builtin_model import TinyModelSpec, create_model_dir
from nanovllm.cpu import KERNEL_DTYPES
from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.cpu import sampler as cpu_sampler

pytestmark = pytest.mark.skipif(not _cpu.has_avx2_fma(), reason="the head's GEMM needs AVX2 + FMA")

N = 1000  # columns cut ragged by the 16-column panels, over two threads' shares


def head(k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, cpu_gemm.PackedWeight]:
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(N, k, generator=g) * 0.1).to(dtype)
    weight[700] = weight[3]  # a tie across panels and threads: the first column must win
    weight[998] = weight[3]
    packed = cpu_gemm.prepack(weight, "avx2")
    assert isinstance(packed, cpu_gemm.PackedWeight)
    return weight, packed


def rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2
    if m >= 5:
        x[1] = float("nan")  # every logit NaN: token 0
        x[2] = 0.0  # every logit 0: the first column
        x[3, 0] = float("inf")  # infinite logits of both signs, NaN where a weight is 0
        x[4, :] = 0.0
        x[4, 1] = 1.0  # column 3's tie with 700 and 998 decides
    return x.to(dtype)


def greedy_ids(x: torch.Tensor, packed: cpu_gemm.PackedWeight, threads: int) -> torch.Tensor:
    ids = torch.full((x.shape[0],), -7, dtype=torch.int64)
    _cpu.gemm_greedy_cpu(x.data_ptr(), KERNEL_DTYPES[x.dtype], packed.data.data_ptr(),
                         KERNEL_DTYPES[packed.data.dtype], packed.pairs, ids.data_ptr(), x.shape[0], N, x.shape[1],
                         x.stride(0), threads)
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [0, 1, 5, 33])
@pytest.mark.parametrize("k", [72, 96])
def test_greedy_tokens_equal_the_argmax_of_the_logits(dtype: torch.dtype, weight_dtype: torch.dtype, m: int,
                                                      k: int) -> None:
    _, packed = head(k, weight_dtype, seed=m + k)
    x = rows(m, k, dtype, seed=m)
    expected = cpu_sampler.argmax(cpu_gemm.logits(x, packed))
    if m >= 5:
        assert expected[1] == 0 and expected[2] == 0  # the cases meant: a row of NaNs, a row of ties
    for threads in (1, 2, 3):
        assert torch.equal(greedy_ids(x, packed, threads), expected), threads
    assert torch.equal(cpu_gemm.greedy(x, packed), expected)
    strided = torch.cat([x, x[:, :5]], dim=1)[:, :k]  # read in place at a row stride past k
    assert m < 2 or not strided.is_contiguous()
    assert torch.equal(cpu_gemm.greedy(strided, packed), expected)


def test_greedy_rejects_bad_rows_and_sizes() -> None:
    _, packed = head(96, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="96 inputs"):
        cpu_gemm.greedy(torch.randn(2, 95), packed)
    with pytest.raises(ValueError, match="float64"):
        cpu_gemm.greedy(torch.randn(2, 96, dtype=torch.float64), packed)
    x = torch.randn(2, 96)
    ids = torch.empty(2, dtype=torch.int64)
    data = packed.data.data_ptr()
    with pytest.raises(ValueError, match="bad sizes"):
        _cpu.gemm_greedy_cpu(x.data_ptr(), 0, data, 1, True, ids.data_ptr(), 2, N, 96, 95)
    with pytest.raises(ValueError, match="null pointer"):
        _cpu.gemm_greedy_cpu(x.data_ptr(), 0, data, 1, True, 0, 2, N, 96, 96)
    with pytest.raises(ValueError, match="x_dtype"):
        _cpu.gemm_greedy_cpu(x.data_ptr(), 4, data, 1, True, ids.data_ptr(), 2, N, 96, 96)


# A head of 4096 x 64 (262,144 weights) is packed for our GEMM (cpu_gemm.PREPACK_MIN_WEIGHTS).
SPEC = TinyModelSpec(vocab_size=4096, hidden_size=64, intermediate_size=128, seed=5)
PROMPTS = [list(range(3, 40)), [7] * 20, list(range(100, 161))]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = create_model_dir(tmp_path_factory.mktemp("greedy_head") / "m", spec=SPEC, tokenizer_vocab=4096)
    engine = LLM(str(path), dtype="bfloat16", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=32)
    yield engine
    engine.engine.shutdown()


def test_the_engine_takes_the_greedy_head_only_for_all_greedy_steps(llm: LLM,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = llm.engine.executor.runner.model
    assert isinstance(model.lm_head.packed, cpu_gemm.PackedWeight)
    calls: list[int] = []
    greedy = cpu_gemm.greedy
    monkeypatch.setattr(cpu_gemm, "greedy", lambda x, p: calls.append(x.shape[0]) or greedy(x, p))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def tokens(outs: list) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in outs]

    fused = tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    assert calls, "an all-greedy step did not take the greedy head"
    sampler = llm.engine.executor.runner.token_sampler
    taken, sampler._greedy = sampler._greedy, None
    try:
        assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == fused  # through the logits
    finally:
        sampler._greedy = taken
    calls.clear()
    # Steps where a row samples, or wants logprobs, need the logits: never the greedy head.
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    llm.generate(PROMPTS, [params, sampled, params], use_tqdm=False)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS, [params, with_logprobs, params], use_tqdm=False)
    assert not calls
    assert tokens(outs) == fused
