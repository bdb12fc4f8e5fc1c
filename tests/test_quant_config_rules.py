"""Which modules of a quantized checkpoint are quantized, and how, as the formats' own libraries
(and vLLM) decide it from `quantization_config`:

- compressed-tensors: of the targets matching a module, its whole name beats a regex (the first in
  sorted order) and a regex beats the class ("Linear"), whatever the order of the config groups
  (compressed_tensors.utils.match `match_targets`, quantization/lifecycle/apply.py, as the oracle); `actorder: "dynamic"` is "group" (a g_idx is
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
    named = _config(_ct({"a": {"targets": ["re:.*proj"], "weights": W8},
                         "b": {"targets": ["model.layers.1.self_attn.q_proj"], "weights": W4},
                         "c": {"targets": ["re:.*proj"], "weights": W8}}))
    assert named.scheme_for("model.layers.1.self_attn.q_proj").bits == 4
    assert named.scheme_for("model.layers.1.self_attn.k_proj").bits == 8


W4_64 = dict(W4, group_size=64)
MODULES = [*(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"),
           *(f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down"))]
TARGET_CASES = [
    # a bare module name is no suffix match: only the whole name (compressed-tensors' match_name, vLLM's)
    ({"a": {"targets": ["Linear"], "weights": W4}}, ["lm_head", "down_proj"]),
    ({"a": {"targets": ["down_proj", "re:.*q_proj"], "weights": W8}}, ["lm_head"]),
    # several regexes match: compressed-tensors takes the first in sorted order, not the config's
    ({"a": {"targets": ["re:.*mlp.*"], "weights": W4}, "b": {"targets": ["re:.*down_proj"], "weights": W8}},
     ["lm_head"]),
    ({"a": {"targets": ["re:.*down_proj"], "weights": W8}, "b": {"targets": ["re:.*mlp.*"], "weights": W4}},
     ["lm_head"]),
    ({"z": {"targets": ["re:model.layers.1.*"], "weights": W4_64}, "a": {"targets": ["re:.*proj"], "weights": W8},
      "m": {"targets": ["Linear", "model.layers.0.mlp.up_proj"], "weights": W4}}, ["lm_head", "re:.*k_proj"]),
    ({"a": {"targets": ["Linear"], "weights": W4}, "b": {"targets": ["re:.*layers.0.*"], "weights": W8}},
     ["lm_head", "model.layers.0.self_attn.q_proj", "re:.*layers.1.mlp.*"]),
]


@pytest.mark.parametrize("case", range(len(TARGET_CASES)))
def test_targets_and_ignore_match_as_compressed_tensors_applies_them(case: int) -> None:
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.apply import apply_quantization_config

    groups, ignore = TARGET_CASES[case]
    model = torch.nn.Module()
    for name in [*MODULES, "lm_head"]:
        parent = model
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, torch.nn.Linear(128, 128, bias=False))
    apply_quantization_config(model, QuantizationConfig.model_validate({"config_groups": groups, "ignore": ignore}))
    ours = _config(_ct(groups, ignore=ignore))
    for name in MODULES:
        theirs = getattr(model.get_submodule(name), "quantization_scheme", None)
        expected = None if theirs is None else (theirs.weights.num_bits, theirs.weights.group_size)
        scheme = ours.scheme_for(name)
        assert (None if scheme is None else (scheme.bits, scheme.group_size or -1)) == (
            None if expected is None else (expected[0], expected[1] or -1)), name


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


def test_packing_named_by_format_as_transformers_reads_it() -> None:
    """transformers 5 names GPTQ's and AWQ's packing `format`; the older key (checkpoint_format,
    version) wins where both are given."""
    from transformers import AwqConfig, GPTQConfig

    base = {k: v for k, v in GPTQ.items() if k != "checkpoint_format"}
    for given in ({"format": "gptq_v2"}, {"format": "gptq"}, {}, {"format": "gptq", "checkpoint_format": "gptq_v2"},
                  {"format": "gptq_v2", "checkpoint_format": None}):
        expected = GPTQConfig.from_dict({**base, **given}).format
        assert _config({**base, **given}).extra["zero_offset"] == (0 if expected == "gptq_v2" else 1), given
    awq = {k: v for k, v in AWQ.items() if k != "version"}
    assert AwqConfig.from_dict({**awq, "format": "gemv"}).format == "gemv"
    with pytest.raises(ValueError, match="AWQ version 'gemv' is not supported"):
        _config({**awq, "format": "gemv"})
    assert _config({**awq, "format": "gemm"}).method == "awq"
    with pytest.raises(ValueError, match="AWQ version 'gemv'"):
        _config({**awq, "format": "gemm", "version": "gemv"})


def test_boolean_and_enum_fields_as_the_libraries_read_them() -> None:
    from compressed_tensors.quantization import QuantizationArgs

    assert QuantizationArgs.model_validate(dict(W4, strategy="GROUP", type="INT")).strategy == "group"
    upper = _config(_ct({"g": {"targets": ["Linear"], "weights": dict(W4, strategy="GROUP", type="Int")}}))
    assert upper.scheme_for("model.layers.0.mlp.up_proj") == _config(_ct({"g": {"targets": ["Linear"],
                                                                                 "weights": W4}})).scheme_for(
        "model.layers.0.mlp.up_proj")
    # A JSON string "false" is false, not a non-empty string's truth.
    for text, value in (("false", False), ("True", True)):
        assert _config(dict(GPTQ, sym=text)).scheme_for("model.layers.0.mlp.up_proj").symmetric is value
        assert _config(dict(GPTQ, desc_act=text)).scheme_for("model.layers.0.mlp.up_proj").actorder is value
    assert _config(dict(GPTQ, sym=None)).scheme_for("model.layers.0.mlp.up_proj").symmetric is False  # vLLM's
    with pytest.raises(ValueError, match="sym must be true or false, got 'no'"):
        _config(dict(GPTQ, sym="no"))
    with pytest.raises(ValueError, match="zero_point must be true or false, got 1"):
        _config(dict(AWQ, zero_point=1))
    with pytest.raises(ValueError, match="symmetric must be true or false"):
        _config(_ct({"g": {"targets": ["Linear"], "weights": dict(W4, symmetric="yes")}}))


def test_gptq_without_g_idx_and_with_unlisted_dense_layers(tmp_path: Path) -> None:
    """As vLLM reads GPTQ: without desc_act a g_idx may be left out (each row's group is its index
    // group_size), and a layer the checkpoint stores dense is loaded dense though the config does
    not list it (vLLM's maybe_update_config finds them from the stored dtypes)."""
    with_g_idx = _checkpoint(tmp_path / "a", GPTQ, re.compile(r"^$"))
    out = tmp_path / "no_g_idx"
    shutil.copytree(with_g_idx, out)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.endswith(".g_idx")}, str(out / "model.safetensors"))
    expected, got = _quantized(load_model(with_g_idx, dtype="float32")[0]), _quantized(load_model(out, dtype="float32")[0])
    assert expected.keys() == got.keys() and expected
    for name, w in got.items():
        assert torch.equal(w.qweight, expected[name].qweight) and torch.equal(w.scales, expected[name].scales), name
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"]["desc_act"] = True  # activation order needs each row's group
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"missing tensors: '.*g_idx'"):
        load_model(out, dtype="float32")
    # Attention stored dense, the config silent about it.
    layers = _quantized_layers(_checkpoint(tmp_path / "b", GPTQ, re.compile(r"\.self_attn\.")))
    assert layers == {f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    # A fused layer stored half dense cannot be one layer.
    with pytest.raises(ValueError, match="stored partly quantized, partly dense"):
        load_model(_checkpoint(tmp_path / "c", GPTQ, re.compile(r"\.self_attn\.k_proj")), dtype="float32")


def test_load_time_scheme_on_an_autogptq_checkpoint_says_what_it_is(tmp_path: Path) -> None:
    out = _checkpoint(tmp_path, GPTQ, re.compile(r"^$"))
    raw = json.loads((out / "config.json").read_text())
    (out / "quantize_config.json").write_text(json.dumps({k: v for k, v in raw.pop("quantization_config").items()
                                                          if k != "quant_method"}))
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"quantization='int8' quantizes an unquantized checkpoint.*"
                                         r"holds quantize_config.json.*quantization='gptq'"):
        load_model(out, dtype="float32", quantization="int8")
    assert _quantized(load_model(out, dtype="float32", quantization="gptq")[0])


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
