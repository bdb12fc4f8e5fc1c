"""Mistakes a new user makes get an error that names the cause (issue 25): a checkpoint of an
architecture this engine does not run, a model directory without a tokenizer, a Hub id, sampling
parameters as a dict, a port already taken; and the built-in model says its weights are random."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import TINY_SPECS, make_tiny_model

from nanovllm import LLM, SamplingParams
from nanovllm.builtin_model import BUILTIN_NAME, create_model_dir
from nanovllm.model_config import SUPPORTED_ARCHITECTURES
from nanovllm.models.registry import supported_architectures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("errors"), "qwen3")


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "nanovllm.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=None if env is None else {**os.environ, **env})


def test_unsupported_architecture_is_named_before_any_config_key(tmp_path: Path) -> None:
    # A GPT-2 config.json has none of the keys the supported architectures need (hidden_size, ...).
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                      "n_embd": 768, "n_layer": 12, "vocab_size": 50257}))
    with pytest.raises(ValueError) as e:
        LLM(str(tmp_path), device="cpu")
    message = str(e.value)
    assert "unsupported model architecture 'GPT2LMHeadModel'" in message and "hidden_size" not in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)
    assert sorted(SUPPORTED_ARCHITECTURES) == supported_architectures()  # what the registry builds


def test_model_directory_without_tokenizer_files(model_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "no_tokenizer"
    shutil.copytree(model_dir, bare)
    for f in bare.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            f.unlink()
    with pytest.raises(ValueError, match=f"no tokenizer in {bare}: none of tokenizer.json, tokenizer.model, "
                                         "vocab.json is there"):
        LLM(str(bare), device="cpu", num_kvcache_blocks=16)
    # --tokenizer / tokenizer= takes it from elsewhere.
    llm = LLM(str(bare), tokenizer=str(model_dir), device="cpu", num_kvcache_blocks=16, max_model_len=64)
    assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_empty_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    empty = tmp_path / "empty_tokenizer"
    shutil.copytree(model_dir, empty)
    for f in empty.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    Tokenizer(models.BPE()).save(str(empty / "tokenizer.json"))
    with pytest.raises(ValueError, match=f"the tokenizer in {empty} has no tokens"):
        LLM(str(empty), device="cpu", num_kvcache_blocks=16)


def test_hub_id_says_downloads_are_not_supported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="model directory not found: Qwen/Qwen3-0.6B .*Hugging Face Hub id: "
                                                "downloads are not supported: pass a local directory"):
        LLM("Qwen/Qwen3-0.6B")
    with pytest.raises(FileNotFoundError) as e:  # a missing path is not called a Hub id
        LLM(str(tmp_path / "some" / "dir"))
    assert "Hub" not in str(e.value)
    res = run_cli("generate", "--model", "Qwen/Qwen3-0.6B", "--prompt", "x", cwd=tmp_path)
    assert res.returncode == 2 and "downloads are not supported: pass a local directory" in res.stderr


def test_sampling_params_as_a_dict_is_a_type_error_naming_sampling_params(model_dir: Path) -> None:
    """vLLM's LLM.generate takes SamplingParams objects only; a dict would otherwise be read as a
    list of its keys (an AttributeError deep inside)."""
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=16, max_model_len=64)
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams .*got dict: write "
                                        r"SamplingParams\(\*\*params\)"):
        llm.generate("x", {"max_tokens": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got a list holding dict"):
        llm.generate(["x"], [{"max_tokens": 2}])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.chat([{"role": "user", "content": "hi"}], {"max_tokens": 2})  # type: ignore[arg-type]
    stats = llm.stats()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_logprobs_beyond_max_logprobs_name_the_limit(model_dir: Path) -> None:
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=16, max_model_len=64, max_logprobs=3)
    with pytest.raises(ValueError, match="logprobs = 4 is more than this engine's max_logprobs = 3"):
        llm.generate("x", SamplingParams(max_tokens=2, logprobs=4), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs = 5 is more than"):
        llm.generate("x", SamplingParams(max_tokens=2, prompt_logprobs=5), use_tqdm=False)
    assert llm.generate("x", SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)[0].outputs[0].logprobs


def test_serve_checks_the_port_before_loading_the_model(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The model directory does not exist either: the port is what gets reported, so it was checked first.
        res = run_cli("serve", str(tmp_path / "not_loaded"), "--port", str(port), cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in res.stderr
    assert "model directory" not in res.stderr and "Traceback" not in res.stderr


@pytest.fixture()
def builtin_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache whose built-in model is already there (a tiny one: creating the real one takes longer)."""
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path))
    create_model_dir(tmp_path / BUILTIN_NAME, spec=TINY_SPECS["qwen3"])
    return tmp_path


def test_llm_without_a_model_runs_the_builtin_one_and_says_its_weights_are_random(
        builtin_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="nanovllm"):
        llm = LLM(device="cpu", num_kvcache_blocks=16, max_model_len=64)
    assert llm.engine.config.model == str(builtin_cache / BUILTIN_NAME)
    warnings = [r.getMessage() for r in caplog.records if "RANDOM weights" in r.getMessage()]
    assert len(warnings) == 1 and BUILTIN_NAME in warnings[0]
    assert llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_generate_without_model_runs_the_builtin_one(builtin_cache: Path) -> None:
    res = run_cli("generate", "--prompt", "Hello", "--max-tokens", "3", "--num-kvcache-blocks", "16",
                  "--max-model-len", "64", "--device", "cpu", cwd=builtin_cache,
                  env={"NANOVLLM_CACHE": str(builtin_cache)})
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("RANDOM weights") == 1 and res.stdout.strip()
