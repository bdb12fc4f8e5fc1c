"""The LM head's greedy tokens without its logits (cpu_gemm.greedy, gemm_greedy_cpu): the same
tokens as the sampler's argmax of cpu_gemm.logits, through ties across panels and threads, NaN and
infinite logits, on every path the head takes (AMX tiles where the CPU has them and k is a multiple
of 32, the pair tiles, fp32 weights); and the engine takes it exactly for the steps whose rows all
sample greedily and want nothing else of their logits."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from nanovllm import LLM, RequestOutput, SamplingParams, _cpu
from nanovllm.builtin_model import TinyModelSpec, create_model_dir
from nanovllm.cpu import KERNEL_DTYPES
from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.cpu import sampler as cpu_sampler

pytestmark = pytest.mark.skipif(not _cpu.has_avx2_fma(), reason="the head's GEMM needs AVX2 + FMA")

N = 1010  # columns cut ragged by the 16-column panels (the last pair 18 wide), over two threads' shares
TIES = (3, 700, 998, 1008)  # equal weight rows: across panel pairs, threads and the last pair's halves


def head(k: int, dtype: torch.dtype, seed: int, n: int = N) -> tuple[torch.Tensor, cpu_gemm.PackedWeight]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * 0.1
    for column in TIES:
        if column < n:
            weight[column] = weight[TIES[0]]
    weight = weight.to(dtype)
    packed = cpu_gemm.prepack(weight, "avx2")
    assert isinstance(packed, cpu_gemm.PackedWeight)
    return weight, packed


def rows(m: int, k: int, dtype: torch.dtype, seed: int, weight: torch.Tensor) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2
    if m >= 5:
        x[1] = float("nan")  # every logit NaN: token 0
        x[2] = 0.0  # every logit 0: the first column
        x[3, 0] = float("inf")  # infinite logits of both signs, NaN where a weight is 0
        x[4] = weight[TIES[0]].float() * 8  # its largest logit in every tied column: the first wins
    return x.to(dtype)


def greedy_ids(x: torch.Tensor, packed: cpu_gemm.PackedWeight, threads: int) -> torch.Tensor:
    ids = _cpu.gemm_greedy_cpu(x.data_ptr(), KERNEL_DTYPES[x.dtype], packed.data.data_ptr(),
                               KERNEL_DTYPES[packed.data.dtype], packed.pairs, x.shape[0], packed.out_features,
                               x.shape[1], x.stride(0), threads)
    assert ids.dtype == np.int32 and ids.shape == (x.shape[0],)
    return torch.from_numpy(ids).long()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [0, 1, 5, 33])
@pytest.mark.parametrize("k", [72, 96])
def test_greedy_tokens_equal_the_argmax_of_the_logits(dtype: torch.dtype, weight_dtype: torch.dtype, m: int,
                                                      k: int) -> None:
    weight, packed = head(k, weight_dtype, seed=m + k)
    x = rows(m, k, dtype, seed=m, weight=weight)
    expected = cpu_sampler.argmax(cpu_gemm.logits(x, packed))
    if m >= 5:  # the cases meant: a row of NaNs, a row of ties at 0, a tie at its largest logit
        assert expected[1] == 0 and expected[2] == 0 and expected[4] == TIES[0]
    for threads in (1, 2, 3):
        assert torch.equal(greedy_ids(x, packed, threads), expected), threads
    assert torch.equal(torch.from_numpy(cpu_gemm.greedy(x, packed)).long(), expected)
    strided = torch.cat([x, x[:, :5]], dim=1)[:, :k]  # read in place at a row stride past k
    assert m < 2 or not strided.is_contiguous()
    assert torch.equal(torch.from_numpy(cpu_gemm.greedy(strided, packed)).long(), expected)


def test_greedy_tokens_over_row_chunks() -> None:
    """A depth whose rows the AMX path packs and multiplies in several chunks (32 rows at 12,288)."""
    weight, packed = head(12288, torch.bfloat16, seed=3, n=200)
    x = rows(70, 12288, torch.bfloat16, seed=4, weight=weight)
    expected = cpu_sampler.argmax(cpu_gemm.logits(x, packed))
    assert torch.equal(greedy_ids(x, packed, 2), expected)


def test_greedy_rejects_bad_rows_and_sizes() -> None:
    _, packed = head(96, torch.float32, seed=1)
    with pytest.raises(ValueError, match="96 inputs"):
        cpu_gemm.greedy(torch.randn(2, 95), packed)
    with pytest.raises(ValueError, match="float64"):
        cpu_gemm.greedy(torch.randn(2, 96, dtype=torch.float64), packed)
    x = torch.randn(2, 96)
    data, pairs = packed.data.data_ptr(), packed.pairs
    with pytest.raises(ValueError, match="bad sizes"):
        _cpu.gemm_greedy_cpu(x.data_ptr(), 0, data, 0, pairs, 2, N, 96, 95)
    with pytest.raises(ValueError, match="null pointer"):
        _cpu.gemm_greedy_cpu(0, 0, data, 0, pairs, 2, N, 96, 96)
    with pytest.raises(ValueError, match="x_dtype"):
        _cpu.gemm_greedy_cpu(x.data_ptr(), 4, data, 0, pairs, 2, N, 96, 96)


# A bf16 model whose head is packed for our GEMM (the "avx2" head kernel packs any size).
SPEC = TinyModelSpec(vocab_size=4096, hidden_size=64, intermediate_size=128, seed=5)
PROMPTS = [list(range(3, 40)), [7] * 20, list(range(100, 161))]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    path = create_model_dir(tmp_path_factory.mktemp("greedy_head") / "m", spec=SPEC, tokenizer_vocab=4096)
    # No prefix caching: every run schedules the prompts alike, chunked by the 32-token budget.
    engine = LLM(str(path), dtype="bfloat16", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=32,
                 enable_prefix_caching=False)
    yield engine
    engine.engine.shutdown()


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_engine_takes_the_greedy_head_only_for_all_greedy_steps(llm: LLM,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    runner = llm.engine.executor.runner
    assert runner.model.has_greedy_head()
    sampler = runner.token_sampler
    users: list[tuple[int, int, int]] = []  # the live sequences' features at each greedy-head call
    greedy = cpu_gemm.greedy

    def spy(x: torch.Tensor, packed: cpu_gemm.PackedWeight) -> np.ndarray:
        u = sampler.state.users
        users.append((u.sampled, u.logprobs, u.processed))
        return greedy(x, packed)

    monkeypatch.setattr(cpu_gemm, "greedy", spy)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    fused = tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    assert users, "an all-greedy step did not take the greedy head"
    taken, sampler._greedy = sampler._greedy, None
    try:
        assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == fused  # through the logits
    finally:
        sampler._greedy = taken
    # A step where a live sequence samples, wants logprobs or has a processor needs the logits.
    users.clear()
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    penalized = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3)
    for other in (sampled, with_logprobs, penalized):
        outs = llm.generate(PROMPTS, [params, other, params], use_tqdm=False)
        assert tokens(outs)[0] == fused[0] and tokens(outs)[2] == fused[2]
    assert all(u == (0, 0, 0) for u in users), users
