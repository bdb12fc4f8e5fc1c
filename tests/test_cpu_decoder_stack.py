"""The C++ decoder stack (csrc/cpu_decoder.h, nanovllm/models/cpu_stack.py) against the same model's
layers run in Python: the stack calls the same kernels on the same inputs, so greedy tokens and their
logprobs must be equal bit for bit, through chunked prefill mixed with decodes, in fp32 and bf16,
dense and quantized, dense MLPs and mixtures of experts; layers it does not take run in Python;
bad weights and metadata are errors at the binding."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from moe_models import make_moe_model
from tiny_models import make_tiny_model

from nanovllm import LLM, SamplingParams, _cpu
from nanovllm.builtin_model import TinyModelSpec, create_model_dir
from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.models import cpu_stack

pytestmark = pytest.mark.skipif(not _cpu.has_avx2_fma(), reason="the stack's GEMMs need AVX2 + FMA")

# Biases on every projection (the quantized GEMM adds them); sizes int4's groups of 128 divide.
QUANT_SPEC = TinyModelSpec(arch="LlamaForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True,
                           extra={"mlp_bias": True}, seed=41)
PROMPTS = [list(range(3, 40)), list(range(50, 53)), [7] * 70, list(range(100, 161))]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stack_models")


def decoder_model(llm: LLM) -> torch.nn.Module:
    return llm.engine.executor.runner.model.model


def generate(llm: LLM, stack: bool) -> list[tuple[list[int], list[dict]]]:
    decoder_model(llm).use_cpu_stack = stack
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: (lp.logprob, lp.rank) for t, lp in d.items()}
                                            for d in o.outputs[0].logprobs]) for o in outs]


def make_llm(path: Path, dtype: str, quantization: str | None = None) -> LLM:
    # A 16-token budget cuts the prompts into chunks that share steps with the others' decodes;
    # no prefix caching, so the second run computes what the first did.
    return LLM(str(path), dtype=dtype, quantization=quantization, max_num_batched_tokens=16, max_num_seqs=4,
               max_model_len=256, enable_prefix_caching=False, block_size=8, num_kvcache_blocks=96)


def assert_stack_equals_python_layers(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = []  # each step's cpu_stack.run: None where the step fell back to the Python layers
    run = cpu_stack.run
    monkeypatch.setattr(cpu_stack, "run", lambda *args: ran.append(out := run(*args)) or out)
    try:
        stacked = generate(llm, True)
        assert ran and all(out is not None for out in ran), "the stack did not run every step"
        ran.clear()
        assert stacked == generate(llm, False)
        assert not ran
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama3_rope", "llama_tied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_the_python_layers(name: str, dtype: str, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_stack_equals_python_layers(make_llm(make_tiny_model(root / dtype, name), dtype), monkeypatch)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_the_python_layers_quantized(quantization: str, dtype: str, root: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = create_model_dir(root / f"q{quantization}{dtype}", spec=QUANT_SPEC)
    assert_stack_equals_python_layers(make_llm(path, dtype, quantization), monkeypatch)


def test_stack_follows_a_new_kv_cache(root: Path) -> None:
    llm = make_llm(make_tiny_model(root / "realloc", "qwen3"), "float32")
    try:
        before = generate(llm, True)
        first = decoder_model(llm).layer_stack()
        runner = llm.engine.executor.runner
        runner.release_kv_cache()
        assert decoder_model(llm).layer_stack() is None  # no cache bound: the layers would raise
        grown = first.stack.buffer_bytes
        assert grown > 0
        runner.allocate_kv_cache(80)
        second = decoder_model(llm).layer_stack()
        assert second is not None and second is not first
        # The buffers the first stack grew go to the second, not grown again from nothing.
        assert (second.stack.buffer_bytes, first.stack.buffer_bytes) == (grown, 0)
        assert generate(llm, True) == before
    finally:
        llm.engine.shutdown()


def test_each_layer_turns_by_its_own_rotary(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack computes a forward's rotary angles once where every layer's inv_freq is the same;
    a layer whose differ still turns q and k by its own."""
    llm = make_llm(make_tiny_model(root / "own_rotary", "qwen3"), "float32")
    shared = generate(llm, True)
    decoder_model(llm).layers[1].self_attn.rotary_emb.inv_freq.mul_(0.5)
    decoder_model(llm).forget_layer_stack()  # built again: the stack compares the layers' inv_freq once
    assert generate(llm, True) != shared
    assert_stack_equals_python_layers(llm, monkeypatch)


@pytest.mark.parametrize("name", ["qwen3_moe_mixed", "mixtral", "qwen3_moe_ragged"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_the_python_layers_mixture_of_experts(name: str, dtype: str, root: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # qwen3_moe_mixed mixes dense and sparse layers; in qwen3_moe_ragged one expert takes every row.
    assert_stack_equals_python_layers(make_llm(make_moe_model(root / f"moe{dtype}", name), dtype), monkeypatch)


@pytest.mark.parametrize(("name", "quantization"), [("qwen3_moe_mixed", "int8"), ("mixtral_wide", "int4")])
def test_stack_equals_the_python_layers_quantized_experts(name: str, quantization: str, root: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert_stack_equals_python_layers(make_llm(make_moe_model(root / f"qmoe{quantization}", name), "bfloat16",
                                               quantization), monkeypatch)


def test_layers_the_kernels_do_not_take_run_in_python(root: Path) -> None:
    llm = make_llm(make_tiny_model(root / "python", "qwen3"), "float32")
    try:
        generate(llm, True)
        model = decoder_model(llm)
        assert model.layer_stack() is not None
        llm.engine.executor.runner.model.set_attention_backend("torch")  # the reference has no qkv_attention
        assert model.layer_stack() is None
        llm.engine.executor.runner.model.set_attention_backend("cpu")
        layers = model._stack_layers()
        assert cpu_stack.build(layers, model.norm, model.embed_tokens) is not None
        packed, layers[1].down.packed = layers[1].down.packed, None  # an unpacked weight: F.linear
        try:
            assert cpu_stack.build(layers, model.norm, model.embed_tokens) is None
        finally:
            layers[1].down.packed = packed
    finally:
        llm.engine.shutdown()


def test_bad_weights_and_metadata_are_errors(root: Path) -> None:
    llm = make_llm(make_tiny_model(root / "bad", "qwen3"), "float32")
    try:
        generate(llm, True)
        stack = decoder_model(llm).layer_stack()
        assert stack is not None
        cs = stack.stack
        weights = torch.zeros(1 << 16)
        lin = _cpu.DecoderLinear.dense(weights.data_ptr(), 0, 8, 8, False, 0)
        layer = _cpu.DecoderLayer(lin, lin, lin, lin, weights.data_ptr(), weights.data_ptr(), 0, 0,
                                  weights.data_ptr(), weights.data_ptr(), weights.data_ptr())
        with pytest.raises(ValueError, match="qkv"):
            _cpu.DecoderStack(0, 8, 2, 1, 4, 16, 1e-6, 0.5, 8, 4, [layer], weights.data_ptr(), weights.data_ptr(), 64)
        # gemm_bf16's bf16 weight takes the stack's rows as they are: only a bf16 stack's.
        bf16_qkv = _cpu.DecoderLinear.dense_bf16(weights.data_ptr(), 16, 8, 0)
        bf16_layer = _cpu.DecoderLayer(bf16_qkv, lin, lin, lin, weights.data_ptr(), weights.data_ptr(), 0, 0,
                                       weights.data_ptr(), weights.data_ptr(), weights.data_ptr())
        with pytest.raises(ValueError, match="qkv: a bf16 weight for gemm_bf16 in a stack of fp32 rows"):
            _cpu.DecoderStack(0, 8, 2, 1, 4, 16, 1e-6, 0.5, 8, 4, [bf16_layer], weights.data_ptr(), weights.data_ptr(),
                              64)
        pair_packed = cpu_gemm.PackedWeight(torch.zeros(16 * 8, dtype=torch.bfloat16), 16, 8, pairs=True)
        assert cpu_gemm.stack_linear(pair_packed, None, torch.float32) is None  # the Python layers run it
        with pytest.raises(ValueError, match="null norm"):
            _cpu.DecoderLayer(lin, lin, lin, lin, 0, weights.data_ptr(), 0, 0, weights.data_ptr(),
                              weights.data_ptr(), weights.data_ptr())
        with pytest.raises(ValueError, match="bits"):
            _cpu.DecoderLinear.quant(weights.data_ptr(), weights.data_ptr(), 0, 0, 8, 8, 8, 3, 0.0, 0, 0)
        # Token ids the stack looks up: each must be a row of its embedding.
        ids, pos = torch.tensor([3, 512], dtype=torch.int32), torch.arange(2, dtype=torch.int32)
        hidden = torch.zeros(2, stack.hidden)
        tables = torch.zeros((1, 1), dtype=torch.int32)
        lens, cu = torch.tensor([2], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
        out = torch.empty_like(hidden)
        with pytest.raises(IndexError, match="token id 512 is outside the embedding's 512 rows"):
            cs.forward(ids.data_ptr(), out.data_ptr(), pos.data_ptr(), pos.data_ptr(), 2, tables.data_ptr(), 1,
                       lens.data_ptr(), cu.data_ptr(), 1, 2)
        for table, vocab in ((0, 64), (weights.data_ptr(), 0)):
            with pytest.raises(ValueError, match="the embedding needs a table and vocab >= 1"):
                _cpu.DecoderStack(0, 8, 2, 1, 4, 16, 1e-6, 0.5, 8, 4, [], weights.data_ptr(), table, vocab)
        # One sequence of 2 tokens whose block table points past the cache.
        hidden = torch.zeros(2, stack.hidden)
        out = torch.empty_like(hidden)
        ints = torch.zeros(2, dtype=torch.int32)
        tables = torch.tensor([[10_000]], dtype=torch.int32)
        lens, cu = torch.tensor([2], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
        with pytest.raises(IndexError, match="block_tables"):
            cs.forward(ints.data_ptr(), out.data_ptr(), ints.data_ptr(), ints.data_ptr(), 2, tables.data_ptr(), 1,
                       lens.data_ptr(), cu.data_ptr(), 1, 2)
        slots = torch.tensor([0, 10_000_000], dtype=torch.int32)
        tables = torch.tensor([[0]], dtype=torch.int32)
        with pytest.raises(IndexError, match="slot_mapping"):
            cs.forward(ints.data_ptr(), out.data_ptr(), ints.data_ptr(), slots.data_ptr(), 2, tables.data_ptr(), 1,
                       lens.data_ptr(), cu.data_ptr(), 1, 2)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("moe", [False, True])
def test_part_clocks_sum_each_forward(moe: bool, root: Path) -> None:
    """time_parts(True) zeroes the clocks and sums every forward's GEMMs, attention, experts and rest
    into part_times (roofline.py's parts) until time_parts(False); the parts add up to the forwards'
    time, and a dense model has no experts' time, a MoE model some."""
    path = make_moe_model(root / "clock_moe", "qwen3_moe_mixed") if moe else make_tiny_model(root / "clock", "qwen3")
    llm = make_llm(path, "bfloat16")
    try:
        generate(llm, True)
        stack = decoder_model(llm).layer_stack().stack
        assert stack.part_times["forwards"] == 0  # never switched on
        stack.time_parts(True)
        start = time.perf_counter()
        generate(llm, True)
        wall = time.perf_counter() - start
        stack.time_parts(False)
        times = stack.part_times
        steps = times["forwards"]
        assert steps > len(PROMPTS)  # every step of the second run: prefill chunks and decodes
        generate(llm, True)  # off: nothing more is summed
        assert stack.part_times == times
        parts = [times[p] for p in ("gemm", "attention", "experts", "rest")]
        assert min(parts) >= 0 and times["gemm"] > 0 and times["attention"] > 0 and sum(parts) < wall
        assert (times["experts"] > 0) == moe
        stack.time_parts(True)
        assert stack.part_times == {"gemm": 0.0, "attention": 0.0, "experts": 0.0, "rest": 0.0, "forwards": 0}
    finally:
        llm.engine.shutdown()
