"""Which modules of a quantized checkpoint are quantized, and how, as the formats' own libraries
(and vLLM) decide it from `quantization_config`:

- compressed-tensors: of the targets matching a module, a name beats a regex and a regex beats the
  class ("Linear"), whatever the order of the config groups (compressed_tensors.utils.match
  `match_targets`, quantization/lifecycle/apply.py); `actorder: "dynamic"` is "group" (a g_idx is
  stored); online transforms and sparse formats are refused by name; a `kv_cache_scheme`'s scales are
  passed over (the KV cache stays in the model's dtype, as vLLM's kv_cache_dtype="auto").
- GPTQ: GPTQModel's `dynamic` rules ("-:" regex: stored unquantized; "+:" or bare: the module's own
  bits / group_size / sym / desc_act; the first matching rule decides) and
  `modules_in_block_to_quantize` (only modules whose names contain an entry), as vLLM's gptq_utils.
- AWQ / GPTQ `modules_to_not_convert`: every module whose name contains an entry (vLLM's
  is_layer_skipped_awq, AutoAWQ's exclude_layers_to_not_quantize).
- `LLM(quantization="int4")` gives the weights `nanovllm quantize` writes, whatever dtype the model
  runs in: scales rounded to the checkpoint's dtype.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from quant_helpers import awq_tensors, gptq_tensors, write_checkpoint
from safetensors.torch import load_file, save_file

from nanovllm.builtin_model import TinyModelSpec, create_model_dir
from nanovllm.entrypoints.quantize import quantize_checkpoint
from nanovllm.layers.linear import LinearBase
from nanovllm.layers.quantization.config import resolve_quant_config
from nanovllm.layers.quantization.weights import quantize_rtn
from nanovllm.models.loader import load_model

W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
        "checkpoint_format": "gptq"}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}
SPEC = TinyModelSpec(arch="Qwen3ForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, seed=5)


def _ct(groups: dict, **top: object) -> dict:
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "config_groups": groups, "ignore": ["lm_head"], **top}}


def _config(qc: dict):  # noqa: ANN202
    return resolve_quant_config(qc if "quantization_config" in qc else {"quantization_config": qc}, None, "c.json")


# --- compressed-tensors ---------------------------------------------------------------------------

MIXED = {"group_0": {"targets": ["Linear"], "weights": W4}, "group_1": {"targets": ["re:.*down_proj"], "weights": W8}}


def test_a_regex_target_beats_the_class_as_in_compressed_tensors() -> None:
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.apply import apply_quantization_config

    model = torch.nn.Sequential()
    model.add_module("mlp", torch.nn.Module())
    model.mlp.up_proj = torch.nn.Linear(128, 256, bias=False)
    model.mlp.down_proj = torch.nn.Linear(256, 128, bias=False)
    apply_quantization_config(model, QuantizationConfig.model_validate({"config_groups": MIXED}))
    cfg = _config(_ct(MIXED))
    for module in ("up_proj", "down_proj"):
        ours = cfg.scheme_for(f"model.layers.0.mlp.{module}").bits
        assert ours == getattr(model.mlp, module).quantization_scheme.weights.num_bits, module
    assert cfg.scheme_for("model.layers.0.mlp.down_proj").bits == 8
    # a name beats a regex; a target named again by a later group takes its scheme
    named = _config(_ct({"a": {"targets": ["re:.*proj"], "weights": W8}, "b": {"targets": ["q_proj"], "weights": W4},
                         "c": {"targets": ["re:.*proj"], "weights": W4}}))
    assert named.scheme_for("model.layers.1.self_attn.q_proj").bits == 4
    assert named.scheme_for("model.layers.1.self_attn.k_proj").bits == 4


def test_dynamic_actorder_is_group() -> None:
    from compressed_tensors.quantization.quant_args import ActivationOrdering

    assert ActivationOrdering("dynamic") == ActivationOrdering.GROUP
    module = "model.layers.0.mlp.down_proj"
    schemes = {a: _config(_ct({"g": {"targets": ["Linear"], "weights": dict(W4, actorder=a)}})) for a in
               ("group", "dynamic", "weight")}
    names = {a: c.tensor_names(c.scheme_for(module)) for a, c in schemes.items()}
    assert "weight_g_idx" in names["group"] and names["dynamic"] == names["group"]
    assert "weight_g_idx" not in names["weight"]


def test_dynamic_actorder_checkpoint_loads(tmp_path: Path) -> None:
    dense = create_model_dir(tmp_path / "dense", spec=SPEC)
    out = quantize_checkpoint(dense, tmp_path / "ct", "w4a16", group_size=32, symmetric=True)
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight_shape")]:  # columns already in group order
        tensors[name.replace(".weight_shape", ".weight_g_idx")] = (torch.arange(int(tensors[name][1])) // 32).int()
    save_file(tensors, str(out / "model.safetensors"))
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "dynamic"
    (out / "config.json").write_text(json.dumps(raw))
    model, _ = load_model(out, dtype="float32")
    assert model.model.layers[0].mlp.down_proj.quant.scheme.actorder


ONLINE = {"config_groups": {"u": {"type": "hadamard", "apply": [
    {"targets": ["re:.*down_proj$"], "location": "input"},
    {"targets": ["re:.*down_proj$"], "location": "weight_input", "inverse": True}]}}}
FOLDED = {"config_groups": {"u": {"type": "hadamard", "apply": [
    {"targets": ["re:.*down_proj$"], "location": "weight_input"}]}}}


def test_online_transforms_and_sparse_formats_are_refused_by_name() -> None:
    from compressed_tensors.transform import TransformConfig

    assert any(a.is_online() for s in TransformConfig.model_validate(ONLINE).config_groups.values() for a in s.apply)
    assert not any(a.is_online() for s in TransformConfig.model_validate(FOLDED).config_groups.values()
                   for a in s.apply)
    groups = {"g": {"targets": ["Linear"], "weights": W4}}
    with pytest.raises(ValueError, match=r"transform_config group 'u' applies a 'hadamard' transform at 'input'"):
        _config(_ct(groups, transform_config=ONLINE))
    for fine in ({}, None, FOLDED):  # none (what compressed-tensors writes then), or folded into the weights
        assert _config(_ct(groups, transform_config=fine)).scheme_for("model.layers.0.mlp.up_proj").bits == 4
    with pytest.raises(ValueError, match="sparsity_config with format 'sparse-24-bitmask'"):
        _config(_ct(groups, sparsity_config={"format": "sparse-24-bitmask"}))


def test_kv_cache_scales_are_passed_over(tmp_path: Path) -> None:
    dense = create_model_dir(tmp_path / "dense", spec=SPEC)
    plain = quantize_checkpoint(dense, tmp_path / "ct", "w4a16", symmetric=True)
    out = tmp_path / "ct_kv"
    shutil.copytree(plain, out)
    tensors = load_file(str(out / "model.safetensors"))
    for layer in range(SPEC.num_hidden_layers):
        for which in ("k_scale", "v_scale"):
            tensors[f"model.layers.{layer}.self_attn.{which}"] = torch.tensor(0.01)
    save_file(tensors, str(out / "model.safetensors"))
    raw = json.loads((out / "config.json").read_text())
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.k_scale'"):
        load_model(out, dtype="float32")  # without a kv_cache_scheme such a tensor is no part of the model
    raw["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                     "dynamic": False, "symmetric": True}
    (out / "config.json").write_text(json.dumps(raw))
    with_scales, _ = load_model(out, dtype="float32")
    without, _ = load_model(plain, dtype="float32")
    assert _quantized(with_scales).keys() == _quantized(without).keys()
    for name, w in _quantized(with_scales).items():
        assert torch.equal(w.qweight, _quantized(without)[name].qweight), name
    for (name, p), (_, q) in zip(with_scales.state_dict().items(), without.state_dict().items(), strict=True):
        assert torch.equal(p, q), name


def _quantized(model: torch.nn.Module) -> dict:
    return {n: m.quant.weight for n, m in model.named_modules() if isinstance(m, LinearBase) and m.quant is not None}


# --- GPTQ and AWQ ---------------------------------------------------------------------------------

def _checkpoint(tmp_path: Path, qc: dict, dense: re.Pattern) -> Path:
    """The tiny model in `qc`'s format (round to nearest, groups of 32 in order), the linear weights
    whose names `dense` finds stored dense."""
    src = create_model_dir(tmp_path / "dense", spec=SPEC)

    def convert(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if dense.search(name):
            return {"weight": weight}
        w = quantize_rtn(weight, 4, 32, symmetric=False, scale_dtype=torch.float16)
        if qc["quant_method"] == "awq":
            return awq_tensors(w)
        return gptq_tensors(w, torch.arange(weight.shape[1]) // 32, zero_offset=1)

    return write_checkpoint(src, tmp_path / "quantized", qc, convert)


def _quantized_layers(path: Path) -> set[str]:
    model, _ = load_model(path, dtype="float32")
    return {n for n, m in model.named_modules() if isinstance(m, LinearBase) and m.quant is not None}


def test_gptq_dynamic_rules() -> None:
    cfg = _config(dict(GPTQ, dynamic={r"-:.*self_attn\.k_proj": {}, r"+:.*self_attn.*": {"bits": 8, "group_size": 64},
                                      r".*down_proj": {"sym": True, "desc_act": True}}))
    assert cfg.scheme_for("model.layers.0.self_attn.k_proj") is None  # the first matching rule decides
    attention = cfg.scheme_for("model.layers.0.self_attn.q_proj")
    assert (attention.bits, attention.group_size, attention.symmetric) == (8, 64, False)
    down = cfg.scheme_for("model.layers.3.mlp.down_proj")
    assert (down.bits, down.group_size, down.symmetric, down.actorder) == (4, 32, True, True)
    up = cfg.scheme_for("model.layers.3.mlp.up_proj")
    assert (up.bits, up.group_size, up.symmetric, up.actorder) == (4, 32, False, False)
    for bad, message in (({"-:(": {}}, "not a valid regex"), ({".*": 8}, "must map to an object"),
                         ({".*": {"bits": 3}}, "3-bit weights")):
        with pytest.raises(ValueError, match=message):
            _config(dict(GPTQ, dynamic=bad))


def test_gptq_modules_in_block_to_quantize() -> None:
    cfg = _config(dict(GPTQ, modules_in_block_to_quantize=[["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]))
    assert cfg.scheme_for("model.layers.0.mlp.down_proj") is not None
    assert cfg.scheme_for("model.layers.0.self_attn.q_proj") is None


@pytest.mark.parametrize("rule", ["dynamic", "modules_in_block_to_quantize"])
def test_gptq_checkpoint_with_dense_attention_loads(tmp_path: Path, rule: str) -> None:
    qc = dict(GPTQ, dynamic={r"-:.*self_attn.*": {}}) if rule == "dynamic" else \
        dict(GPTQ, modules_in_block_to_quantize=[["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]])
    layers = _quantized_layers(_checkpoint(tmp_path, qc, re.compile(r"\.self_attn\.")))
    assert layers == {f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}


def test_modules_to_not_convert_leave_every_module_containing_them(tmp_path: Path) -> None:
    from transformers.quantizers.quantizers_utils import should_convert_module

    skipped = ["model.layers.0.self_attn"]
    assert not should_convert_module("model.layers.0.self_attn.q_proj", skipped)  # transformers' reading too
    cfg = _config(dict(AWQ, modules_to_not_convert=skipped))
    assert cfg.scheme_for("model.layers.0.self_attn.q_proj") is None
    assert cfg.scheme_for("model.layers.1.self_attn.q_proj") is not None
    assert _config(dict(GPTQ, modules_to_not_convert=["down"])).scheme_for("model.layers.1.mlp.down_proj") is None
    with pytest.raises(ValueError, match="modules_to_not_convert must be a list of names"):
        _config(dict(AWQ, modules_to_not_convert="self_attn"))
    layers = _quantized_layers(_checkpoint(tmp_path, dict(AWQ, modules_to_not_convert=skipped),
                                           re.compile(r"^model\.layers\.0\.self_attn\.")))
    assert "model.layers.0.self_attn.qkv_proj" not in layers and "model.layers.1.self_attn.qkv_proj" in layers


# --- quantized at load time -----------------------------------------------------------------------

@pytest.mark.parametrize("checkpoint_dtype", [torch.float16, torch.bfloat16])
def test_load_time_quantization_equals_the_quantize_command(tmp_path: Path, checkpoint_dtype: torch.dtype) -> None:
    """The model runs in float32 (dtype="auto" on CPU for fp16; asked for bf16): the scales of both
    are still those of the checkpoint's dtype."""
    dense = create_model_dir(tmp_path / "dense", spec=SPEC, dtype=checkpoint_dtype)
    out = quantize_checkpoint(dense, tmp_path / "w4a16", "w4a16")

    at_load = _quantized(load_model(dense, dtype="float32", quantization="int4")[0])
    from_file = _quantized(load_model(out, dtype="float32")[0])
    assert at_load.keys() == from_file.keys() and at_load
    for name, w in at_load.items():
        assert torch.equal(w.scales, from_file[name].scales), name
        assert torch.equal(w.qweight, from_file[name].qweight), name
