"""Qwen3-MoE and Mixtral against transformers on tiny random-weight checkpoints (tests/moe_models.py):
greedy output token for token in fp32 with the experts on either CPU packing (our AVX2 GEMM's, the
fused C++ call; oneDNN's, the per-expert loop), ragged routing, dense and sparse layers mixed,
norm_topk_prob either way, chunked prefill, preemption and prefix caching; bf16 logits within bf16
tolerance; config.json and checkpoint errors at load, naming the field or the expert."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import (
    assert_greedy_matches,
    assert_greedy_matches_with_preemption_and_prefix_cache,
    random_prompts,
)
from moe_models import MOE_MODELS, make_moe_model, router_counts
from safetensors.torch import load_file, save_file
from test_models_bf16 import CHUNKS, REL_TOL, hf_logits, our_logits

from nanovllm import LLM, _cpu
from nanovllm.builtin_model import create_model_dir
from nanovllm.config import DEFAULT_BATCHED_TOKENS, DEFAULT_CPU_MOE_BATCHED_TOKENS, EngineConfig
from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.cpu import moe as cpu_moe
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.models import load_model
from nanovllm.models.moe import SparseMoeBlock

BLOCK = 16
VOCAB = 512

KERNELS = [
    pytest.param("avx2", marks=pytest.mark.skipif(not _cpu.has_avx2_fma(), reason="the CPU lacks AVX2 + FMA")),
    pytest.param("onednn", marks=pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: make_moe_model(root, name) for name in MOE_MODELS}


@pytest.fixture(params=KERNELS)
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The GEMM kernel every layer, experts included, is packed for, whatever this CPU would take;
    with oneDNN every weight is packed, small or not (the tiny models' experts are below its threshold)."""
    monkeypatch.setattr(cpu_gemm, "gemm_kernel", lambda: request.param)
    monkeypatch.setattr(cpu_moe, "expert_kernel", lambda: request.param)
    if request.param == "onednn":
        monkeypatch.setattr(cpu_gemm, "PREPACK_MIN_WEIGHTS", 0)
    yield request.param


def make_llm(path: Path, **kwargs: object) -> LLM:
    options: dict[str, object] = dict(device="cpu", num_kvcache_blocks=128, block_size=BLOCK, max_model_len=1024)
    return LLM(str(path), **{**options, **kwargs})  # type: ignore[arg-type]


def moe_layers(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, FusedMoE)]


def test_config_fields_decide_the_layers(models: dict[str, Path]) -> None:
    expected = {  # sparse layers, experts, top_k, renormalize, expert intermediate size
        "qwen3_moe": ({0, 1}, 8, 2, False, 32),
        "qwen3_moe_mixed": ({1, 5}, 8, 3, True, 48),
        "mixtral": ({0, 1}, 8, 2, True, 128),
        "qwen3_moe_ragged": ({0, 1}, 16, 2, True, 32),
    }
    for name, (sparse, experts, top_k, renormalize, inter) in expected.items():
        model, config = load_model(models[name])
        layers = model.model.layers
        assert {i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock)} == sparse
        for i in sparse:
            moe = layers[i].mlp.experts
            assert (moe.num_experts, moe.top_k, moe.renormalize, moe.intermediate_size) == (
                experts, top_k, renormalize, inter)
        for i in set(range(config.num_hidden_layers)) - sparse:  # dense: intermediate_size
            assert layers[i].mlp.down_proj.input_size == config.intermediate_size


def test_ragged_model_routes_every_row_to_one_expert(models: dict[str, Path]) -> None:
    """The routing the ragged case claims, as transformers computes it: expert 5 takes every row of
    every sparse layer, and most experts none."""
    tokens = random_prompts([40], VOCAB, seed=3)[0]
    for counts in router_counts(models["qwen3_moe_ragged"], tokens):
        assert counts[5] == len(tokens)
        assert (counts == 0).sum() >= 12


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_greedy_matches_transformers(models: dict[str, Path], name: str, kernel: str) -> None:
    llm = make_llm(models[name])
    packed = {type(m.packed) for m in moe_layers(llm)}
    assert packed == {cpu_moe.GemmPackedExperts if kernel == "avx2" else cpu_moe.LinearExperts}
    assert_greedy_matches(llm, models[name], random_prompts([1, 15, 16, 17, 120], VOCAB, seed=1), max_new=16)


@pytest.mark.parametrize("name,kernel", [pytest.param("qwen3_moe_mixed", *KERNELS[0].values, marks=KERNELS[0].marks),
                                         pytest.param("mixtral", *KERNELS[1].values, marks=KERNELS[1].marks)],
                         indirect=["kernel"])
def test_chunked_prefill_preemption_and_prefix_cache(models: dict[str, Path], name: str, kernel: str) -> None:
    llm = make_llm(models[name], num_kvcache_blocks=24, max_model_len=24 * BLOCK, max_num_seqs=6,
                   max_num_batched_tokens=48)
    assert_greedy_matches_with_preemption_and_prefix_cache(llm, models[name])


# --- bf16 -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_mixed", "mixtral"])
def test_bf16_logits_within_tolerance(models: dict[str, Path], name: str, kernel: str) -> None:
    """The experts packed for `kernel`, bf16 throughout (test_models_bf16.py's tolerance). Within bf16 tolerance of transformers' bf16 logits everywhere, and of the fp32 logits wherever
    transformers' bf16 is: a router in bf16 may pick another expert than in fp32 at a near tie (the
    Mixtral model here does at one position, 5% of the largest logit away, both engines alike)."""
    tokens = random_prompts([sum(CHUNKS)], VOCAB, seed=2)[0]
    ours = our_logits(models[name], tokens, prepack=True)
    fp32 = hf_logits(models[name], tokens, torch.float32)
    hf16 = hf_logits(models[name], tokens, torch.bfloat16)
    tol = REL_TOL * fp32.abs().max().item()
    assert (ours - hf16).abs().max() < tol
    hf_off = (hf16 - fp32).abs().amax(dim=-1)
    assert ((ours - fp32).abs().amax(dim=-1) < hf_off + tol).all()
    assert (hf_off < tol).sum() >= len(tokens) - 2, "bf16 routing differs from fp32 almost everywhere"


# --- errors at load -------------------------------------------------------------------------------


def edited_copy(src: Path, dst: Path, config: dict | None = None, drop: str | None = None) -> Path:
    """A copy of the model at `src` with config.json fields replaced (None deletes one) and the
    tensor `drop` left out of the checkpoint."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    raw = json.loads((dst / "config.json").read_text())
    for key, value in (config or {}).items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (dst / "config.json").write_text(json.dumps(raw))
    if drop is not None:
        weights = load_file(dst / "model.safetensors")
        del weights[drop]
        save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("name,config,drop,message", [
    ("qwen3_moe", {"num_experts_per_tok": 9}, None, r"num_experts_per_tok \(9\) exceeds the number of experts \(8\)"),
    ("mixtral", {"num_experts_per_tok": 0}, None, "num_experts_per_tok must be an integer >= 1, got 0"),
    ("mixtral", {"num_experts_per_tok": 1.5}, None, "num_experts_per_tok must be an integer >= 1, got 1.5"),
    ("qwen3_moe", {"moe_intermediate_size": None}, None, "missing required key 'moe_intermediate_size'"),
    ("qwen3_moe", {"num_local_experts": None}, None, "missing required key 'num_local_experts' or 'num_experts'"),
    ("qwen3_moe", {"mlp_only_layers": "0"}, None, "mlp_only_layers must be a list of layer indices"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, None, "decoder_sparse_step must be an integer >= 1"),
    ("mixtral", {"hidden_act": "gelu"}, None, "hidden_act 'gelu' is not supported"),
    ("qwen3_moe", None, "model.layers.1.mlp.experts.3.up_proj.weight",
     r"missing tensors: 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"),
    ("mixtral", None, "model.layers.0.block_sparse_moe.experts.7.w2.weight",
     r"missing tensors: 'model\.layers\.0\.block_sparse_moe\.experts\.7\.w2\.weight'"),
])
def test_bad_checkpoint_is_a_value_error_naming_the_field_or_expert(
        models: dict[str, Path], tmp_path: Path, name: str, config: dict | None, drop: str | None,
        message: str) -> None:
    path = edited_copy(models[name], tmp_path / name, config, drop)
    with pytest.raises(ValueError, match=message):
        load_model(path)


@pytest.mark.parametrize("config,message", [
    ({"num_experts_per_tok": "2"}, "config.json: num_experts_per_tok must be an integer >= 1, got '2'"),
    ({"quantization_config": "w4a16"}, "config.json: quantization_config must be an object"),
])
def test_the_engine_checks_config_json_before_the_tokenizer_reads_it(
        models: dict[str, Path], tmp_path: Path, config: dict, message: str) -> None:
    """Loading the tokenizer parses config.json with transformers, whose errors (a strict dataclass's
    own type, an AttributeError) name neither the file nor the field: the engine's checks run first."""
    path = edited_copy(models["qwen3_moe"], tmp_path / "m", config, None)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), device="cpu", num_kvcache_blocks=16, max_model_len=64)


def test_integral_floats_are_integers(models: dict[str, Path], tmp_path: Path) -> None:
    """Some writers give integer fields as floats (32768.0); the dense fields are read that way too."""
    path = edited_copy(models["qwen3_moe"], tmp_path / "m", {"num_experts_per_tok": 2.0, "decoder_sparse_step": 1.0})
    model, _ = load_model(path)
    experts = model.model.layers[0].mlp.experts
    assert experts.top_k == 2 and isinstance(experts.top_k, int)


def test_num_experts_is_read_under_either_name(models: dict[str, Path], tmp_path: Path) -> None:
    """transformers 5 writes Qwen3-MoE's num_experts as num_local_experts; earlier writers as num_experts."""
    raw = json.loads((models["qwen3_moe"] / "config.json").read_text())
    assert raw.get("num_local_experts", raw.get("num_experts")) == 8
    path = edited_copy(models["qwen3_moe"], tmp_path / "m", {"num_local_experts": None, "num_experts": 8})
    model, _ = load_model(path)
    assert model.model.layers[0].mlp.experts.num_experts == 8


def test_expert_count_and_defaults_are_read_as_transformers_reads_them(models: dict[str, Path], tmp_path: Path) -> None:
    """transformers stores num_experts as num_local_experts (attribute_map), so with both set that one
    counts, and Mixtral takes num_experts too; a Mixtral config.json without rope_theta or
    rms_norm_eps gets MixtralConfig's defaults (1e6, 1e-5), not the other architectures'."""
    import transformers

    both = edited_copy(models["qwen3_moe"], tmp_path / "both", {"num_experts": 4, "num_local_experts": 8})
    alias = edited_copy(models["mixtral"], tmp_path / "alias", {"num_local_experts": None, "num_experts": 8})
    bare = edited_copy(models["mixtral"], tmp_path / "bare", {"rope_theta": None, "rope_parameters": None,
                                                               "rms_norm_eps": None})
    for path in (both, alias, bare):
        hf_config = transformers.AutoConfig.from_pretrained(path)
        model, config = load_model(path)
        assert {layer.mlp.experts.num_experts for layer in model.model.layers} == {hf_config.num_local_experts}
        assert config.rms_norm_eps == hf_config.rms_norm_eps
        assert config.rope.theta == hf_config.rope_parameters["rope_theta"]
    assert (config.rms_norm_eps, config.rope.theta) == (1e-5, 1e6)
    prompts = random_prompts([40], VOCAB, seed=12)
    for path in (both, bare):
        assert_greedy_matches(make_llm(path), path, prompts, 8)


def test_a_sliding_window_runs_where_it_changes_nothing(models: dict[str, Path], tmp_path: Path) -> None:
    """A window is full attention within max_model_len <= window (the engine runs that, as vLLM's
    --disable-sliding-window caps max_model_len); beyond it, a ValueError saying so. Qwen3-MoE slides
    only with use_sliding_window and a window (transformers: use_sliding_window with
    sliding_window null is full attention)."""
    qwen = edited_copy(models["qwen3_moe"], tmp_path / "qwen", {"use_sliding_window": True, "sliding_window": None})
    mixtral = edited_copy(models["mixtral"], tmp_path / "mixtral", {"sliding_window": 512})
    prompts = random_prompts([40], VOCAB, seed=13)
    assert_greedy_matches(make_llm(qwen), qwen, prompts, 8)
    assert_greedy_matches(make_llm(mixtral, max_model_len=512), mixtral, prompts, 8)
    with pytest.raises(ValueError, match=r"a window of 512 tokens.*pass max_model_len=512 or disable_sliding_window"
                                         r"=True \(asked for 1024\)"):
        make_llm(mixtral)
    assert EngineConfig(str(mixtral), device="cpu", disable_sliding_window=True).resolve().max_model_len == 512
    assert EngineConfig(str(models["mixtral"]), max_model_len=2048, device="cpu").resolve().max_model_len == 2048

    sliding = edited_copy(models["qwen3_moe"], tmp_path / "sliding", {"use_sliding_window": True, "sliding_window": 64})
    with pytest.raises(ValueError, match="a window of 64 tokens"):
        make_llm(sliding)


def test_a_sharded_checkpoint_reads_the_files_its_index_names(models: dict[str, Path], tmp_path: Path) -> None:
    """Mistral's repositories keep their own consolidated.safetensors beside the Hugging Face shards
    and index: the loader reads the files the index names, as transformers does."""
    import transformers

    path = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(models["mixtral"]).save_pretrained(path, max_shard_size="60KB")
    for f in models["mixtral"].iterdir():
        if not (path / f.name).exists() and not f.name.endswith(".safetensors"):
            (path / f.name).write_bytes(f.read_bytes())
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    weights = load_file(models["mixtral"] / "model.safetensors")
    save_file({k.replace("model.layers.", "layers.").replace("block_sparse_moe", "feed_forward"): v
               for k, v in weights.items()}, path / "consolidated.safetensors")
    assert_greedy_matches(make_llm(path), models["mixtral"], random_prompts([30], VOCAB, seed=13), 8)
    missing = sorted(set(index["weight_map"].values()))[0]
    (path / missing).unlink()
    with pytest.raises(ValueError, match=f"names weight files that are not there: {missing}"):
        load_model(path)


def test_a_moe_model_on_cpu_takes_larger_steps_by_default(models: dict[str, Path], tmp_path: Path) -> None:
    """Each CPU step reads the experts its tokens chose from memory: a MoE model's default token budget
    is DEFAULT_CPU_MOE_BATCHED_TOKENS, a dense model's the CPU's; an explicit budget wins either way."""
    assert DEFAULT_CPU_MOE_BATCHED_TOKENS > DEFAULT_BATCHED_TOKENS["cpu"]
    dense = create_model_dir(tmp_path / "dense")
    for name in MOE_MODELS:
        resolved = EngineConfig(model=str(models[name]), device="cpu", max_model_len=1024).resolve()
        assert resolved.max_num_batched_tokens == DEFAULT_CPU_MOE_BATCHED_TOKENS, name
        assert EngineConfig(model=str(models[name]), device="cpu", max_model_len=1024,
                            max_num_batched_tokens=256).resolve().max_num_batched_tokens == 256
    assert EngineConfig(model=str(dense), device="cpu").resolve().max_num_batched_tokens == DEFAULT_BATCHED_TOKENS["cpu"]
    # Read as the model (and transformers) reads it: num_local_experts counts before its alias
    # num_experts, so num_local_experts 0 is dense whatever else.
    no_experts = edited_copy(models["qwen3_moe"], tmp_path / "none", {"num_local_experts": 0, "num_experts": 8})
    assert EngineConfig(model=str(no_experts), device="cpu",
                        max_model_len=1024).resolve().max_num_batched_tokens == DEFAULT_BATCHED_TOKENS["cpu"]


@pytest.mark.parametrize("name,top_k", [("qwen3_moe", 8), ("mixtral", 2)])
def test_num_experts_per_tok_defaults_as_the_config_classes(models: dict[str, Path], tmp_path: Path, name: str,
                                                            top_k: int) -> None:
    from transformers import AutoConfig

    path = edited_copy(models[name], tmp_path / name, {"num_experts_per_tok": None}, None)
    assert AutoConfig.from_pretrained(path).num_experts_per_tok == top_k
    model, _ = load_model(path)
    assert {m.top_k for m in model.modules() if hasattr(m, "top_k")} == {top_k}
