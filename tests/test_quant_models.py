"""Quantized models end to end (CPU): `nanovllm quantize` writes a compressed-tensors checkpoint that
transformers loads with the same dequantized weights as our engine, and our greedy output equals
transformers' on it; `LLM(quantization="int8"|"int4")` gives the same weights as `nanovllm
quantize`; AWQ and GPTQ (with and without desc_act) checkpoints run and match transformers on
their dequantized weights; against the unquantized model, greedy tokens agree until a step whose
top-2 margin is within the quantization error; unsupported schemes fail at load, by name."""

from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import transformers
from engine_helpers import assert_greedy_matches, random_prompts
from quant_helpers import awq_tensors, gptq_tensors, write_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from nanovllm import LLM, SamplingParams
from nanovllm.builtin_model import TinyModelSpec, create_model_dir
from nanovllm.entrypoints.cli import main as cli_main
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.linear import LinearBase
from nanovllm.layers.quantization.weights import QuantizedWeight, quantize_rtn
from nanovllm.models.loader import load_model

pytest.importorskip("compressed_tensors")  # transformers reads compressed-tensors checkpoints through it

# Dimensions that every group size below divides; qwen2 adds q/k/v biases.
SPECS = {
    "qwen3": TinyModelSpec(arch="Qwen3ForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, seed=31),
    "qwen2": TinyModelSpec(arch="Qwen2ForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=None, seed=32),
}
ENGINE = dict(device="cpu", num_kvcache_blocks=64, block_size=16, max_model_len=256)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("quant")


@pytest.fixture(scope="module")
def dense(root: Path) -> dict[str, Path]:
    return {name: create_model_dir(root / name, spec=spec) for name, spec in SPECS.items()}


@lru_cache(maxsize=None)
def hf_dequantized(path: str) -> transformers.PreTrainedModel:
    """transformers on a compressed-tensors checkpoint, decompressed into dense fp32 weights."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()


def hf_quantized_greedy(path: Path, prompt: list[int], max_new: int, eos: int | None) -> list[int]:
    with torch.no_grad():
        out = hf_dequantized(str(path)).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                                 max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                                                 pad_token_id=eos if eos is not None else 0)
    return out[0, len(prompt):].tolist()


@lru_cache(maxsize=None)
def moe_dense(root: Path, name: str) -> Path:
    """tests/moe_models.py's model `name`, made once per test module."""
    from moe_models import make_moe_model

    return make_moe_model(root, name)


def our_dense_weights(model_dir: Path, quantization: str | None = None) -> dict[str, torch.Tensor]:
    """Every linear layer's dequantized weight as our loader holds it, by checkpoint module name."""
    model, _ = load_model(model_dir, dtype="float32", quantization=quantization)
    for name, layer in model.named_modules():
        if isinstance(layer, LinearBase) and not name.endswith("mlp.gate"):  # a MoE router stays dense
            assert layer.quant is not None and layer.quant.weight is not None, name
    return our_dense_weights_of(model)


def our_dense_weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The dequantized weight of each quantized linear layer and expert projection of `model`, by
    checkpoint module name."""
    quants = [m.quant for m in model.modules() if isinstance(m, LinearBase) and m.quant is not None]
    for moe in model.modules():
        if isinstance(moe, FusedMoE) and moe.quant is not None:
            quants += [*moe.quant.w13, *moe.quant.w2]
    out = {}
    for quant in quants:
        w = quant.weight.dequantize()
        start = 0
        for _, rows, module in quant.shards:
            out[module] = w[start:start + rows]
            start += rows
    return out


def quantized_weights(model_dir: Path, quantization: str | None = None,
                      dtype: str = "float32") -> dict[str, QuantizedWeight]:
    model, _ = load_model(model_dir, dtype=dtype, quantization=quantization)
    return {name: layer.quant.weight for name, layer in model.named_modules()
            if isinstance(layer, LinearBase) and layer.quant is not None}


CASES = {  # id: (model, scheme, group size, symmetric)
    "w4a16-asym-g32": ("qwen3", "w4a16", 32, False),
    "w4a16-sym-g128-bias": ("qwen2", "w4a16", None, True),
    "w8a16-sym-channel": ("qwen3", "w8a16", None, True),
    "w8a16-asym-g64": ("qwen2", "w8a16", 64, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quantize_command_loads_in_transformers_and_engine(case: str, dense: dict[str, Path], root: Path) -> None:
    model, scheme, group, symmetric = CASES[case]
    out = root / f"ct-{case}"
    args = ["quantize", str(dense[model]), str(out), "--scheme", scheme]
    args += [] if group is None else ["--group-size", str(group)]
    args += ["--symmetric"] if symmetric else []
    assert cli_main(args) == 0
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["num_bits"] == (4 if scheme == "w4a16" else 8)
    hf = hf_dequantized(str(out))
    ours = our_dense_weights(out)
    assert len(ours) == 2 * 7
    for module, w in ours.items():
        assert torch.equal(hf.get_submodule(module).weight, w), module
    llm = LLM(str(out), **ENGINE)
    packed = [m.quant.cpu for m in llm.engine.executor.runner.model.modules() if isinstance(m, LinearBase)]
    assert len(packed) == 2 * 4 and all(p is not None for p in packed)  # qkv, o, gate_up, down per layer
    assert_greedy_matches(llm, out, random_prompts([1, 9, 40], 512, seed=3), max_new=16, oracle=hf_quantized_greedy)


def test_load_time_quantization_equals_the_quantize_command(dense: dict[str, Path], root: Path) -> None:
    """LLM(quantization="int4"/"int8") and `nanovllm quantize` (defaults: int4 in groups of 128, int8
    per channel, asymmetric) give the same integers, scales and zero points, hence the same tokens,
    whatever dtype the model runs in: the fp32 checkpoint's weights are rounded as stored, not after
    their cast to bf16."""
    assert json.loads((dense["qwen3"] / "config.json").read_text())["dtype"] == "float32"
    for name, scheme in (("int4", "w4a16"), ("int8", "w8a16")):
        out = root / f"default-{scheme}"
        assert cli_main(["quantize", str(dense["qwen3"]), str(out), "--scheme", scheme]) == 0
        for dtype in ("float32", "bfloat16"):
            at_load, from_file = quantized_weights(dense["qwen3"], name, dtype), quantized_weights(out, dtype=dtype)
            assert at_load.keys() == from_file.keys() and len(at_load) == 8
            for layer, w in at_load.items():
                f = from_file[layer]
                expected = (4, 128) if name == "int4" else (8, w.in_features)  # int8: one group per output channel
                assert (w.bits, w.group_size) == (f.bits, f.group_size) == expected
                assert torch.equal(w.qweight, f.qweight) and torch.equal(w.scales, f.scales), (dtype, layer)
                assert w.zeros is not None and torch.equal(w.zeros, f.zeros)  # type: ignore[arg-type]
        prompts = random_prompts([5, 30], 512, seed=4)
        params = SamplingParams(temperature=0, max_tokens=12)
        for dtype in ("float32", "bfloat16"):
            a = [o.outputs[0].token_ids for o in LLM(str(dense["qwen3"]), quantization=name, dtype=dtype,
                                                     **ENGINE).generate(prompts, params, use_tqdm=False)]
            b = [o.outputs[0].token_ids
                 for o in LLM(str(out), dtype=dtype, **ENGINE).generate(prompts, params, use_tqdm=False)]
            assert a == b, dtype


def _logits(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """The logits after each position of `ids`."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("scheme", ["w8a16", "w4a16"])
def test_greedy_agrees_with_the_unquantized_model_where_the_margin_exceeds_the_error(
        scheme: str, dense: dict[str, Path], root: Path) -> None:
    """At every step of our quantized engine's greedy output where the unquantized model's top-2
    margin exceeds twice the quantization error of the logits (max |dense - quantized| there), our
    token is the unquantized model's argmax: an argmax flips only where the error can flip it."""
    out = root / f"margin-{scheme}"
    assert cli_main(["quantize", str(dense["qwen3"]), str(out), "--scheme", scheme, "--group-size", "32"]) == 0
    llm = LLM(str(out), **ENGINE)
    hf_dense = transformers.AutoModelForCausalLM.from_pretrained(dense["qwen3"], torch_dtype=torch.float32).eval()
    hf_quant = hf_dequantized(str(out))
    decisive = 0
    for prompt in random_prompts([3, 12, 25, 60, 7, 33, 90, 5], 512, seed=5):
        ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
        # One teacher-forced forward of prompt + our tokens gives every step's logits.
        n = len(prompt)
        dense_all, quant_all = (_logits(m, list(prompt) + list(ours))[n - 1:-1] for m in (hf_dense, hf_quant))
        for token, dense_logits, quant_logits in zip(ours, dense_all, quant_all):
            top2 = dense_logits.topk(2).values
            if top2[0] - top2[1] > 2 * (dense_logits - quant_logits).abs().max():
                assert token == int(dense_logits.argmax()), f"{scheme}: flipped a margin of {top2[0] - top2[1]:.4f}"
                decisive += 1
    # Steps where the check had teeth (w8a16: most of the 256; w4a16 on a random tiny model: ~5%).
    assert decisive >= 8


def write_dense(src: Path, out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """A dense copy of src with the given (dequantized) linear weights: transformers' oracle."""
    shutil.copytree(src, out)
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        tensors = {name: weights.get(name, f.get_tensor(name)) for name in f.keys()}  # noqa: SIM118
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("fmt", ["awq-g32", "gptq4-desc_act", "gptq8-sym", "gptq4-asym-g64", "moe-awq-g16",
                                 "moe-gptq4-desc_act-g16"])
def test_awq_and_gptq_checkpoints_match_transformers_on_their_weights(fmt: str, dense: dict[str, Path],
                                                                      root: Path) -> None:
    """Each format's tensors, written from weights rounded here, load to exactly those weights and
    give transformers' tokens on them; the `moe-` cases on a Qwen3-MoE whose experts are quantized
    and routers dense (unlisted, as AutoAWQ and GPTQModel write them)."""
    src = moe_dense(root, "qwen3_moe_mixed") if fmt.startswith("moe-") else dense["qwen3"]
    bits, group = (8, 64) if fmt == "gptq8-sym" else (4, 64 if fmt.endswith("g64") else 16 if fmt.endswith("g16") else 32)
    symmetric = fmt == "gptq8-sym"
    desc_act = "desc_act" in fmt
    dequantized: dict[str, torch.Tensor] = {}

    def convert(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        k = weight.shape[1]
        # desc_act: GPTQ quantizes the columns in its activation order; g_idx says each column's group.
        order = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if desc_act else torch.arange(k)
        w = quantize_rtn(weight[:, order], bits, group, symmetric, scale_dtype=torch.float16)
        w_dense = torch.empty_like(weight).index_copy_(1, order, w.dequantize())
        dequantized[name] = w_dense
        if "awq" in fmt:
            return awq_tensors(w)
        position = torch.argsort(order)  # where each checkpoint column sits in the activation order
        stored = QuantizedWeight(w.qweight[:, position].contiguous(), w.scales, w.zeros, bits, group)
        return gptq_tensors(stored, position // group, zero_offset=1)

    if "awq" in fmt:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    else:
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": symmetric,
              "checkpoint_format": "gptq"}
    ckpt = write_checkpoint(src, root / fmt, qc, convert)
    oracle = write_dense(src, root / f"{fmt}-dense", dequantized)
    ours = our_dense_weights(ckpt)
    assert {f"{module}.weight" for module in ours} == dequantized.keys()  # experts included
    for module, w in ours.items():
        torch.testing.assert_close(w, dequantized[f"{module}.weight"], rtol=0, atol=0)
    llm = LLM(str(ckpt), **ENGINE)
    prompts = random_prompts([2, 17, 50], 512, seed=6)
    from engine_helpers import hf_greedy

    assert_greedy_matches(llm, oracle, prompts, max_new=16, oracle=hf_greedy)


def test_unsupported_and_mismatched_schemes_fail_at_load(dense: dict[str, Path], root: Path) -> None:
    src = dense["qwen3"]
    w8a8 = root / "w8a8"
    shutil.copytree(src, w8a8)
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"},
                                      "input_activations": {"num_bits": 8, "dynamic": True}}}}
    (w8a8 / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="format 'int-quantized'. is not supported"):
        LLM(str(w8a8), **ENGINE)
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(src), quantization="fp8", **ENGINE)
    out = root / "already"
    assert cli_main(["quantize", str(src), str(out)]) == 0
    with pytest.raises(ValueError, match="is quantized with 'compressed-tensors'"):
        LLM(str(out), quantization="int8", **ENGINE)
    assert cli_main(["quantize", str(out), str(root / "twice")]) == 2  # already quantized: a clear error
    assert cli_main(["quantize", str(src), str(root / "g100"), "--group-size", "100"]) == 2  # 128 % 100
    assert not (root / "g100").exists()


def test_quantize_command_refuses_quantized_or_unreadable_input_and_leaves_nothing(
        dense: dict[str, Path], root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`nanovllm quantize` on a checkpoint quantized without a quantization_config (an AutoGPTQ side
    file; quantized tensors), on a truncated weight file, or into a path it cannot make: a one-line
    error, exit code 2, and no directory left of those it made."""
    src = dense["qwen3"]
    side = root / "refuse-side"
    shutil.copytree(src, side)
    (side / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, "desc_act": False,
                                                           "sym": True}))
    stripped = root / "refuse-stripped"
    assert cli_main(["quantize", str(src), str(stripped)]) == 0
    raw = json.loads((stripped / "config.json").read_text())
    del raw["quantization_config"]
    (stripped / "config.json").write_text(json.dumps(raw))
    truncated = root / "refuse-truncated"
    shutil.copytree(src, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    (root / "refuse-file").write_text("not a directory")
    cases = [(side, root / "refuse-out" / "a", "already quantized (quantize_config.json)"),
             (stripped, root / "refuse-out" / "b", "already quantized (tensor"),
             (truncated, root / "refuse-out" / "c", "cannot read safetensors file"),
             (src, root / "refuse-file" / "out", "Not a directory"),
             (src, root / "refuse-new" / "deeper" / "out", "not a multiple of the group size")]
    for model, out, message in cases:
        capsys.readouterr()
        extra = ["--group-size", "100"] if message.startswith("not a multiple") else []
        assert cli_main(["quantize", str(model), str(out), *extra]) == 2, message
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    assert not (root / "refuse-out").exists() and not (root / "refuse-new").exists()


def test_quantize_command_keeps_the_index_true_and_other_weight_formats_out(dense: dict[str, Path],
                                                                            root: Path) -> None:
    """A sharded checkpoint's index gets the quantized files' total size; a `pytorch_model.bin` beside
    the safetensors (the dense model again) is not copied; `--group-size -1` is one group per output
    channel."""
    src = root / "index-src"
    shutil.copytree(dense["qwen3"], src)
    with safe_open(str(src / "model.safetensors"), framework="pt", device="cpu") as f:
        names = list(f.keys())  # noqa: SIM118
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 123}, "weight_map": {name: "model.safetensors" for name in names}}))
    (src / "pytorch_model.bin").write_bytes(b"dense weights in another format")
    out = root / "index-out"
    assert cli_main(["quantize", str(src), str(out), "--group-size", "-1"]) == 0
    assert not (out / "pytorch_model.bin").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    with safe_open(str(out / "model.safetensors"), framework="pt", device="cpu") as f:
        total = sum(t.numel() * t.element_size() for t in map(f.get_tensor, f.keys()))  # noqa: SIM118
        assert set(index["weight_map"]) == set(f.keys())  # noqa: SIM118
    assert index["metadata"]["total_size"] == total
    weights = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (weights["strategy"], weights["group_size"]) == ("channel", None)
    for name, w in quantized_weights(out).items():
        assert w.group_size == w.in_features, name


MOE_CASES = {  # id: (tests/moe_models.py's model, --scheme, --group-size, expert projections)
    "qwen3_moe-w8a16": ("qwen3_moe_mixed", "w8a16", None, ("gate_proj", "up_proj", "down_proj")),
    "mixtral-w4a16-g16": ("mixtral", "w4a16", 16, ("w1", "w3", "w2")),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_mixture_of_experts_quantizes_experts_not_routers(case: str, root: Path) -> None:
    """On a Qwen3-MoE (sparse and dense layers) and a Mixtral, `nanovllm quantize` and
    LLM(quantization=) quantize every expert and linear layer but the routers (ignored by name in
    the checkpoint's config); the tokens equal transformers' on the dense checkpoint carrying our
    dequantized weights (transformers 5 does not read asymmetric compressed-tensors experts),
    and the two ways of quantizing give the same integers and tokens."""
    name, scheme, group, projections = MOE_CASES[case]
    dense_dir = moe_dense(root, name)
    out = root / f"ct-{case}"
    args = ["quantize", str(dense_dir), str(out), "--scheme", scheme]
    assert cli_main(args + ([] if group is None else ["--group-size", str(group)])) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert r"re:.*\.mlp\.gate$" in qc["ignore"] and r"re:.*\.block_sparse_moe\.gate$" in qc["ignore"]
    with safe_open(str(out / "model.safetensors"), framework="pt", device="cpu") as f:
        names = set(f.keys())  # noqa: SIM118
    block = "block_sparse_moe" if name == "mixtral" else "mlp"
    assert f"model.layers.1.{block}.gate.weight" in names  # a router, dense
    assert f"model.layers.1.{block}.experts.0.{projections[2]}.weight_packed" in names  # an expert, quantized
    model, _ = load_model(out, dtype="float32")
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert routers and all(r.quant is None for r in routers)
    assert moes and all(m.quant is not None and m.w13_weight is None for m in moes)
    quantized = our_dense_weights_of(model)
    experts = sum(m.num_experts for m in moes)
    dense_layers = len(model.model.layers) - len(moes)
    assert len(quantized) == 4 * len(model.model.layers) + 3 * dense_layers + 3 * experts
    assert f"model.layers.1.{block}.experts.0.{projections[0]}" in quantized
    oracle_dir = write_dense(dense_dir, root / f"{case}-dequantized", {f"{m}.weight": w for m, w in quantized.items()})
    prompts = random_prompts([3, 17, 40], 512, seed=5)
    llm = LLM(str(out), **ENGINE)
    assert_greedy_matches(llm, oracle_dir, prompts, max_new=12)
    if group is None:  # the load-time schemes' defaults: int8 per channel
        at_load, _ = load_model(dense_dir, dtype="float32", quantization="int8")
        assert our_dense_weights_of(at_load).keys() == quantized.keys()
        for module, w in our_dense_weights_of(at_load).items():
            assert torch.equal(w, quantized[module]), module
        params = SamplingParams(temperature=0, max_tokens=12)
        a = LLM(str(dense_dir), quantization="int8", **ENGINE).generate(prompts, params, use_tqdm=False)
        b = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_quantization_config_beside_config_json(dense: dict[str, Path], root: Path) -> None:
    """AutoGPTQ's and AutoAWQ's older checkpoints keep the quantization config in quantize_config.json
    / quant_config.json, not config.json: read, as vLLM reads them, when `quantization` names the
    format (vLLM's gptq_marlin / awq_marlin too), giving the weights of the same checkpoint
    configured in config.json; without the name, the load fails saying so."""
    src = dense["qwen3"]

    def gptq(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = quantize_rtn(weight, 4, 32, False, scale_dtype=torch.float16)
        return gptq_tensors(w, torch.arange(weight.shape[1]) // 32, zero_offset=1)

    def awq(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return awq_tensors(quantize_rtn(weight, 4, 32, False, scale_dtype=torch.float16))

    gptq_qc = {"bits": 4, "group_size": 32, "desc_act": False, "sym": False}
    awq_qc = {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}  # AutoAWQ's own keys
    cases = {"gptq": (gptq, gptq_qc, "quantize_config.json"), "awq": (awq, awq_qc, "quant_config.json")}
    for method, (convert, qc, side) in cases.items():
        inline = write_checkpoint(src, root / f"side-{method}-inline", {"quant_method": method, **qc}, convert)
        beside = root / f"side-{method}"
        shutil.copytree(inline, beside)
        raw = json.loads((beside / "config.json").read_text())
        del raw["quantization_config"]
        (beside / "config.json").write_text(json.dumps(raw))
        (beside / side).write_text(json.dumps(qc))
        expected = our_dense_weights(inline)
        for name in (method, f"{method}_marlin", f"auto_{method}"):
            got = our_dense_weights(beside, quantization=name)
            assert got.keys() == expected.keys()
            for module, w in got.items():
                torch.testing.assert_close(w, expected[module], rtol=0, atol=0)
        with pytest.raises(ValueError, match=f"looks quantized.*{side}"):
            load_model(beside, dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts([3, 20], 512, seed=7)
    runs = [LLM(str(root / path), quantization=q, **ENGINE).generate(prompts, greedy, use_tqdm=False)
            for path, q in (("side-gptq", "gptq"), ("side-gptq-inline", None))]
    assert [[o.outputs[0].token_ids for o in run] for run in runs] == [[o.outputs[0].token_ids for o in runs[1]]] * 2

    beside = root / "side-awq"
    (beside / "quantize_config.json").write_text(json.dumps(awq_qc))  # both of AWQ's names: which one?
    with pytest.raises(ValueError, match="holds both quant_config.json and quantize_config.json"):
        load_model(beside, dtype="float32", quantization="awq")
    (beside / "quant_config.json").unlink()
    (beside / "quantize_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*quantize_config.json"):
        load_model(beside, dtype="float32", quantization="awq")
    (beside / "quantize_config.json").write_text(json.dumps({"quant_method": "gptq", **gptq_qc}))
    with pytest.raises(ValueError, match="is quantized with 'gptq'"):
        load_model(beside, dtype="float32", quantization="awq")
    # AutoGPTQ's file read as AWQ's (both spell it quantize_config.json): refused, naming what AWQ's lacks.
    (beside / "quantize_config.json").write_text(json.dumps(gptq_qc))
    with pytest.raises(ValueError, match="quantize_config.json lacks the AWQ config's zero_point"):
        load_model(beside, dtype="float32", quantization="awq")
    (beside / "quantize_config.json").write_text(json.dumps({"quant_method": None, **awq_qc}))  # null: none named
    assert our_dense_weights(beside, quantization="awq").keys() == our_dense_weights(root / "side-awq-inline").keys()
    with pytest.raises(ValueError, match="quantization='gptq_marlin': .*quantize_config.json lacks the GPTQ config's bits"):
        load_model(beside, dtype="float32", quantization="gptq_marlin")  # the option as the user spelled it
    with pytest.raises(ValueError, match="quantization='gptq_marlin', but .*config.json is quantized with 'awq'"):
        load_model(root / "side-awq-inline", dtype="float32", quantization="gptq_marlin")
    with pytest.raises(ValueError, match="has no quantization_config and its directory no quantize_config.json"):
        load_model(src, dtype="float32", quantization="gptq")
    with pytest.raises(ValueError, match="compressed-tensors', but .* has no quantization_config$"):
        load_model(src, dtype="float32", quantization="compressed-tensors")
