"""The built-in demo model that `nanovllm bench` creates on first use."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from nanovllm.builtin_model import BUILTIN_SPEC, EOS_TOKEN, default_model_dir, ensure_default_model
from nanovllm.model_config import load_model_config


def test_builtin_model_created_once_in_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    path = ensure_default_model()
    assert path == default_model_dir() and path.parent == tmp_path
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary leftovers

    config = load_model_config(path)
    assert config.architecture == "Qwen3ForCausalLM"
    assert config.vocab_size == BUILTIN_SPEC.vocab_size
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) == config.vocab_size
    assert tok.eos_token == EOS_TOKEN and config.eos_token_ids == (tok.eos_token_id,)
    text = "Hello world, 123!"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
