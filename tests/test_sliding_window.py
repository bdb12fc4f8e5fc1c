"""Sliding windows as transformers' config classes read them: which model types slide (Qwen only
with use_sliding_window, Mistral and Mixtral by sliding_window, Llama never) and a window of 0 as
none (vLLM's rule). Where no layer slides, or max_model_len is within the window, the engine runs
the model (full attention is then exact); test_models_moe.py checks greedy output there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from moe_models import make_moe_model
from tiny_models import make_tiny_model

from nanovllm.config import EngineConfig


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sliding_window")


def edited(src: Path, dst: Path, **fields: object) -> Path:
    """A copy of the model at `src` with config.json fields replaced ("DELETE" removes one)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    for key, value in fields.items():
        if value == "DELETE":
            raw.pop(key, None)
        else:
            raw[key] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "qwen3_moe"])
def test_a_qwen_config_without_use_sliding_window_has_no_window(root: Path, name: str) -> None:
    """transformers: Qwen2Config / Qwen3Config / Qwen3MoeConfig.__post_init__
    (models/qwen*/configuration_qwen*.py) set `sliding_window = sliding_window if use_sliding_window
    else None`, and use_sliding_window defaults to False: a config.json without the key has no window
    whatever its sliding_window says (the layers' layer_types are all full_attention). vLLM reads that
    None (ModelConfig.get_sliding_window). The engine loads it at any max_model_len."""
    src = make_moe_model(root, name) if name == "qwen3_moe" else make_tiny_model(root, name)
    path = edited(src, root / f"{name}_no_use_key", use_sliding_window="DELETE", sliding_window=64,
                  max_window_layers=0, layer_types="DELETE")
    hf = transformers.AutoConfig.from_pretrained(path)
    assert hf.sliding_window is None  # transformers: no window
    assert "sliding_attention" not in (getattr(hf, "layer_types", None) or [])
    resolved = EngineConfig(str(path), device="cpu", max_model_len=256).resolve()
    assert resolved.max_model_len == 256 and resolved.model_config.sliding_window is None


def test_a_llama_config_with_a_sliding_window_key_is_full_attention(root: Path) -> None:
    """transformers: LlamaConfig (models/llama/configuration_llama.py) has no sliding window and
    LlamaModel.forward builds a plain causal mask (create_causal_mask), so a `sliding_window` key in
    a Llama config.json changes nothing (checked below: the same logits over 100 tokens with a
    window of 64). vLLM's LlamaAttention (model_executor/models/llama.py) slides only a layer that
    layer_types names sliding_attention, and get_and_verify_max_len (config/model.py) caps
    max_model_len to the window only with disable_sliding_window."""
    llama = make_tiny_model(root, "llama")
    path = edited(llama, root / "llama_window", sliding_window=64)
    ids = torch.tensor([list(range(5, 105))])
    with torch.no_grad():
        plain = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()(ids).logits
        windowed = transformers.AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits
    assert torch.equal(plain, windowed)  # transformers ignores the key
    resolved = EngineConfig(str(path), device="cpu", max_model_len=256).resolve()
    assert resolved.max_model_len == 256


def test_a_sliding_window_of_zero_means_none(root: Path) -> None:
    """vLLM: ModelConfig.__post_init__ (vllm/config/model.py): "Some checkpoints set sliding_window to
    0 to indicate that sliding window is disabled" -- a window of 0 becomes None (and
    disable_sliding_window True) before max_model_len is derived, so the model loads at its full
    length."""
    path = edited(make_moe_model(root, "mixtral"), root / "mixtral_window0", sliding_window=0)
    resolved = EngineConfig(str(path), device="cpu", max_model_len=256).resolve()
    assert resolved.max_model_len == 256 and not resolved.model_config.sliding_window
