"""Checkpoint and config loading: every way a model directory can be wrong gives a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from nanovllm import model_config
from nanovllm.model_config import load_model_config
from nanovllm.models import (
    find_weight_files,
    load_model,
    supported_architectures,
    validate_weight_files,
)

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("src"), "qwen3")


@pytest.fixture
def model_dir(source_dir: Path, tmp_path: Path) -> Path:
    """A fresh, modifiable copy of the tiny Qwen3 directory."""
    return Path(shutil.copytree(source_dir, tmp_path / "model"))


def edit_tensors(model_dir: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    file = model_dir / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)
    return file


def edit_config(model_dir: Path, **changes: object) -> None:
    file = model_dir / "config.json"
    cfg = json.loads(file.read_text())
    cfg.update(changes)
    file.write_text(json.dumps(cfg))


def test_good_directory_loads(model_dir: Path) -> None:
    model, config = load_model(model_dir)
    assert config.architecture == "Qwen3ForCausalLM"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ref = load_file(model_dir / "model.safetensors")
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    q, k, v = (ref[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(qkv, torch.cat([q, k, v]))


def test_missing_tensor(model_dir: Path) -> None:
    edit_tensors(model_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(
        ValueError, match=r"missing tensors: 'model\.layers\.1\.self_attn\.k_proj\.weight'"
    ):
        load_model(model_dir)


def test_unexpected_tensor(model_dir: Path) -> None:
    edit_tensors(model_dir, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(2)}))
    with pytest.raises(
        ValueError,
        match=r"unexpected tensor 'model\.layers\.0\.mystery\.weight' in .*model\.safetensors",
    ):
        load_model(model_dir)


def test_zero_biases_of_unbiased_layers_are_skipped_and_others_refused(model_dir: Path) -> None:
    """Older GPTQ writers store a bias of zeros for every linear layer (vLLM skips them); one that is
    not zero would change the model, and a bias of a layer the model lacks is unexpected."""
    down = "model.layers.0.mlp.down_proj"
    reference, _ = load_model(model_dir)
    edit_tensors(model_dir, lambda t: t.update({f"{down}.bias": torch.zeros(t[f"{down}.weight"].shape[0])}))
    model, _ = load_model(model_dir)
    assert model.model.layers[0].mlp.down_proj.bias is None
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    edit_tensors(model_dir, lambda t: t[f"{down}.bias"].fill_(0.5))
    with pytest.raises(ValueError, match=rf"unexpected tensor '{down}\.bias'"):
        load_model(model_dir)
    edit_tensors(model_dir, lambda t: t.update({f"{down}.bias": torch.zeros(2), "model.layers.0.mystery.bias":
                                                torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mystery\.bias'"):
        load_model(model_dir)


@pytest.mark.parametrize(("key", "value"), [("hidden_size", "64"), ("num_hidden_layers", True),
                                            ("vocab_size", 1.5), ("num_key_value_heads", "two"),
                                            ("rms_norm_eps", "1e-6"), ("head_dim", "32")])
def test_config_fields_of_the_wrong_type_name_the_field(model_dir: Path, key: str, value: object) -> None:
    edit_config(model_dir, **{key: value})
    with pytest.raises(ValueError, match=rf"config\.json: {key} must be an? (integer|number)"):
        load_model_config(model_dir)


def test_shape_mismatch(model_dir: Path) -> None:
    edit_tensors(model_dir, lambda t: t.update({Q_PROJ: torch.zeros(3, 64)}))
    with pytest.raises(
        ValueError,
        match=r"'model\.layers\.0\.self_attn\.q_proj\.weight' in .*model\.safetensors: shape mismatch",
    ):
        load_model(model_dir)


def test_shape_mismatch_in_unpacked_tensor(model_dir: Path) -> None:
    edit_tensors(model_dir, lambda t: t.update({"model.norm.weight": torch.zeros(65)}))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*expected \[64\], got \[65\]"):
        load_model(model_dir)


def test_truncated_file(model_dir: Path) -> None:
    file = model_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cannot read safetensors file .*model\.safetensors"):
        load_model(model_dir)


def test_validate_weight_files_reads_headers_only(model_dir: Path) -> None:
    validate_weight_files(find_weight_files(model_dir))
    file = model_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"cannot read safetensors file .*model\.safetensors"):
        validate_weight_files(find_weight_files(model_dir))


def test_garbage_file(model_dir: Path) -> None:
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        load_model(model_dir)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model directory not found: .*nowhere"):
        load_model(tmp_path / "nowhere")


def test_missing_config(model_dir: Path) -> None:
    (model_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json not found .*model/config\.json"):
        load_model(model_dir)


def test_invalid_config_json(model_dir: Path) -> None:
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"invalid JSON in .*config\.json"):
        load_model(model_dir)


def test_no_weights(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weight files in .*model"):
        load_model(model_dir)


def test_pickle_only_checkpoint_refused(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    # Never unpickled: the loader refuses on the file name alone.
    (model_dir / "pytorch_model.bin").write_bytes(b"\x80\x04 pretend pickle")
    with pytest.raises(ValueError, match="safetensors is required"):
        load_model(model_dir)


def test_unsupported_architecture(model_dir: Path) -> None:
    edit_config(model_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"
    ) as e:
        load_model(model_dir)
    for arch in supported_architectures():
        assert arch in str(e.value)


def test_unsupported_rope_type(model_dir: Path) -> None:
    edit_config(
        model_dir, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}
    )
    with pytest.raises(ValueError, match="unsupported rope type 'longrope'.*llama3.*yarn"):
        load_model(model_dir)
    edit_config(model_dir, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="linear rope scaling is missing key 'factor'"):
        load_model(model_dir)


def test_sharded_checkpoint_and_ignored_tensors(model_dir: Path) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, model_dir / "model-00001-of-00002.safetensors")
    rest = {n: tensors[n] for n in names[half:]}
    rest["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(
        16
    )  # old checkpoints have it
    save_file(rest, model_dir / "model-00002-of-00002.safetensors")
    model, _ = load_model(model_dir)
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"])


def test_duplicate_tensor_across_shards(model_dir: Path) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    save_file({Q_PROJ: tensors[Q_PROJ]}, model_dir / "model-extra.safetensors")
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight' appears in both"
    ):
        load_model(model_dir)


def test_tied_checkpoint_may_include_lm_head(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "llama_tied")
    tensors = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors")
    model, _ = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_checkpoint_requires_lm_head(model_dir: Path) -> None:
    edit_tensors(model_dir, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="missing tensors: 'lm_head.weight'"):
        load_model(model_dir)


def test_dtype_selection(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "auto" keeps a bf16 checkpoint in bf16 on a CPU with bf16 instructions (test_models_bf16
    # covers the others).
    monkeypatch.setattr(model_config, "native_bf16", lambda: True)
    model, _ = load_model(model_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    edit_config(model_dir, dtype=None, torch_dtype="bfloat16")
    model, config = load_model(model_dir, dtype="auto")
    assert config.torch_dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="unsupported dtype 'int3'"):
        load_model(model_dir, dtype="int3")


def test_legacy_v4_config_format(model_dir: Path) -> None:
    """transformers v4 configs: top-level rope_theta / rope_scaling, torch_dtype, no head_dim."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.pop("dtype", None)
    cfg.update(
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        torch_dtype="bfloat16",
    )
    (model_dir / "config.json").write_text(json.dumps(cfg))
    config = load_model_config(model_dir)
    assert config.rope.theta == 500000.0
    assert config.rope.rope_type == "llama3"
    assert config.rope.scaling["factor"] == 8.0 and "type" not in config.rope.scaling
    assert config.torch_dtype == torch.bfloat16


def test_head_dim_defaults_to_hidden_over_heads(model_dir: Path) -> None:
    edit_config(model_dir, head_dim=None)
    assert load_model_config(model_dir).head_dim == 64 // 4


YARN_CASES = [
    {"factor": 4.0},
    {"factor": 8.0, "beta_fast": 16, "beta_slow": 2},
    {"factor": 2.0, "truncate": False},
    {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 128},
    {"factor": 4.0, "attention_factor": 1.3},
    {"factor": None, "original_max_position_embeddings": 1024},  # DeepSeek's: max / original
]


@pytest.mark.parametrize("case", range(len(YARN_CASES)))
def test_yarn_and_linear_rope_as_transformers_computes_them(model_dir: Path, case: int) -> None:
    """The inverse frequencies and YaRN's attention factor of transformers' ROPE_INIT_FUNCTIONS
    (the attention factor reaches our attention as its softmax scale, squared), for config.json's
    forms: the pretraining length from the scaling, from max_position_embeddings, or absent."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nanovllm.layers.rotary_embedding import RotaryEmbedding, attention_factor

    scaling = {"rope_type": "yarn", **YARN_CASES[case]}
    edit_config(model_dir, max_position_embeddings=4096, rope_parameters={"rope_theta": 50000.0, **scaling})
    theirs = AutoConfig.from_pretrained(model_dir)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, torch.device("cpu"))
    ours = load_model_config(model_dir)
    assert torch.allclose(RotaryEmbedding(ours.head_dim, ours.rope).inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert attention_factor(ours.rope) == pytest.approx(factor, rel=1e-12)
    edit_config(model_dir, rope_parameters={"rope_theta": 50000.0, "rope_type": "linear", "factor": 3.0})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["linear"](AutoConfig.from_pretrained(model_dir), torch.device("cpu"))
    ours = load_model_config(model_dir)
    assert torch.allclose(RotaryEmbedding(ours.head_dim, ours.rope).inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert attention_factor(ours.rope) == 1.0


def test_mistral_window_as_its_config_class_reads_it(model_dir: Path) -> None:
    """MistralConfig's window is 4096 where config.json leaves the key out; null is none."""
    edit_config(model_dir, architectures=["MistralForCausalLM"], model_type="mistral")
    raw = json.loads((model_dir / "config.json").read_text())
    for key in ("sliding_window", "layer_types", "use_sliding_window", "max_window_layers"):  # Qwen3's own
        raw.pop(key, None)
    (model_dir / "config.json").write_text(json.dumps(raw))
    assert load_model_config(model_dir).sliding_window == 4096
    edit_config(model_dir, sliding_window=None)
    assert load_model_config(model_dir).sliding_window is None


def test_config_fields_as_transformers_reads_them(model_dir: Path) -> None:
    """hidden_act other than SiLU is refused (transformers would run it, vLLM refuses it; a silent
    SiLU was the worst outcome); Qwen3Config's head_dim is 128 where config.json leaves it out; a
    rope_scaling replaces rope_parameters whole, rope_theta then from the top level."""
    from transformers import AutoConfig

    for act in ("gelu", "gelu_pytorch_tanh", "relu"):
        edit_config(model_dir, hidden_act=act)
        with pytest.raises(ValueError, match=f"hidden_act '{act}' is not supported"):
            load_model_config(model_dir)
    edit_config(model_dir, hidden_act="swish")  # SiLU by another name
    assert load_model_config(model_dir).architecture == "Qwen3ForCausalLM"
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("head_dim")
    (model_dir / "config.json").write_text(json.dumps(raw))
    assert load_model_config(model_dir).head_dim == AutoConfig.from_pretrained(model_dir).head_dim == 128
    edit_config(model_dir, head_dim=None)  # null: hidden / heads, as Llama's reads it (Qwen3Config refuses it)
    assert load_model_config(model_dir).head_dim == raw["hidden_size"] // raw["num_attention_heads"]
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    edit_config(model_dir, head_dim=raw["hidden_size"] // raw["num_attention_heads"], rope_theta=500000.0,
                rope_scaling=llama3,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    theirs = AutoConfig.from_pretrained(model_dir).rope_parameters
    rope = load_model_config(model_dir).rope
    assert (rope.rope_type, rope.theta) == (theirs["rope_type"], theirs["rope_theta"]) == ("llama3", 500000.0)
    assert rope.scaling["original_max_position_embeddings"] == theirs["original_max_position_embeddings"]
