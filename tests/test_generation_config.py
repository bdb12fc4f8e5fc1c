"""generation_config as vLLM 0.32 reads it, where the offline parity tests (test_llm_vllm_parity.py)
and the server's (test_server.py) do not reach: a max_new_tokens that limits every request, a
generation-config directory's end tokens, "max_tokens": null on /v1/completions, and an invalid
default that fails only the requests that use it. Each test names vLLM's file and function."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess
from tiny_models import make_tiny_model

from nanovllm import LLM, SamplingParams

ENGINE = dict(device="cpu", num_kvcache_blocks=256, max_model_len=512, block_size=16)
CLI_ARGS = ["--num-kvcache-blocks", "256", "--max-model-len", "512", "--block-size", "16"]
PROMPT = "hello world, this is"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("review_s40"), "qwen3")


def completion(srv: ServerProcess, **body: object) -> dict:
    r = httpx.post(f"{srv.base_url}/completions", json={"prompt": "Hello", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat(srv: ServerProcess, **body: object) -> dict:
    r = httpx.post(f"{srv.base_url}/chat/completions", json={"messages": HI, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# 1. max_new_tokens of --override-generation-config / --generation-config DIR is a server-wide cap ----------

@pytest.mark.parametrize("source", ["override", "directory"])
def test_max_new_tokens_caps_a_requested_max_tokens(model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                                                     source: str) -> None:
    """vLLM: OpenAIServingCompletion.__init__ / OpenAIServingChat.__init__
    (vllm/entrypoints/openai/completion/serving.py, chat_completion/serving.py) set
    `override_max_tokens` = the generation config's max_tokens when --generation-config is a
    directory, else --override-generation-config's "max_new_tokens"; get_max_tokens
    (vllm/entrypoints/serve/utils/api_utils.py) returns min(room, requested-or-default,
    override_max_tokens, ...), so it caps even a request that sets max_tokens /
    max_completion_tokens (ModelConfig.generation_config's doc: "If max_new_tokens is specified in
    generation config, then it sets a server-wide limit on the number of output tokens for all
    requests")."""
    work = tmp_path_factory.mktemp(f"cap_{source}")
    if source == "override":
        args = ["--override-generation-config", json.dumps({"max_new_tokens": 4})]
    else:
        gen = work / "gen"
        gen.mkdir()
        (gen / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4}))
        args = ["--generation-config", str(gen)]
    with ServerProcess(model_dir, work, *CLI_ARGS, *args) as srv:
        r = completion(srv, max_tokens=10, temperature=0, ignore_eos=True)
        assert r["usage"]["completion_tokens"] == 4, r["usage"]
        assert r["choices"][0]["finish_reason"] == "length"
        c = chat(srv, max_completion_tokens=10, temperature=0, ignore_eos=True)
        assert c["usage"]["completion_tokens"] == 4, c["usage"]


# 2. --generation-config DIR: that directory's eos_token_id ends generation ---------------------------------

def test_generation_config_directory_end_tokens_stop_generation(model_dir: Path, tmp_path: Path) -> None:
    """vLLM: InputProcessor.__init__ (vllm/v1/engine/input_processor.py) keeps
    `generation_config_fields = model_config.try_get_generation_config()`, which for
    generation_config=<directory> reads that directory's generation_config.json
    (ModelConfig.try_get_generation_config in vllm/config/model.py), and every request's
    SamplingParams.update_from_generation_config (vllm/sampling_params.py) adds its eos_token_id(s)
    to stop_token_ids, in place of the model directory's."""
    llm = LLM(str(model_dir), **ENGINE)
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    ids = base.token_ids
    k = next(i for i, t in enumerate(ids) if i >= 2 and t not in ids[:i] and t != 0)
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, ids[k]]}))
    other = LLM(str(model_dir), generation_config=str(gen), **ENGINE)
    out = other.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:k + 1]
    assert out.finish_reason == "stop"


# 3. a completion request with "max_tokens": null gets 16 --------------------------------------------------

def test_completion_max_tokens_null_is_16(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM: CompletionRequest.normalize_null_max_tokens (vllm/entrypoints/openai/completion/
    protocol.py) turns "max_tokens": null into the field's default, 16, before get_max_tokens
    runs; the generation config's max_new_tokens never reaches a completion request that way."""
    work = tmp_path_factory.mktemp("null_max_tokens")
    with ServerProcess(model_dir, work, *CLI_ARGS, "--generation-config", "vllm") as srv:
        r = completion(srv, max_tokens=None, temperature=0, ignore_eos=True)
        assert r["usage"]["completion_tokens"] == 16, r["usage"]


# 4. an invalid generation_config.json sampling field fails only the requests that use it ------------------

def test_invalid_generation_config_default_does_not_stop_the_engine(model_dir: Path, tmp_path: Path) -> None:
    """vLLM: ModelConfig.get_diff_sampling_param (vllm/config/model.py) only collects the fields; they
    are validated when a SamplingParams is built from them: LLM.get_default_sampling_params
    (vllm/entrypoints/llm.py, SamplingParams.from_optional) for generate() without params, and
    to_sampling_params for a server request that leaves the field out. The engine loads, and a
    request that sets its own value is served."""
    where = tmp_path / "bad"
    shutil.copytree(model_dir, where)
    config = json.loads((where / "generation_config.json").read_text())
    (where / "generation_config.json").write_text(json.dumps({**config, "top_p": 0.0}))
    llm = LLM(str(where), **ENGINE)  # vLLM: loads
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 1
    with pytest.raises(ValueError, match="top_p"):
        llm.get_default_sampling_params()



def test_invalid_defaults_are_a_400_for_the_requests_that_use_them(model_dir: Path, tmp_path: Path) -> None:
    """Over HTTP the same: a request that leaves top_p or max_tokens out gets the invalid default and
    a 400 naming the field (never a 500); one that gives both is served."""
    where = tmp_path / "bad_server"
    shutil.copytree(model_dir, where)
    config = json.loads((where / "generation_config.json").read_text())
    (where / "generation_config.json").write_text(json.dumps({**config, "top_p": 0.0, "max_new_tokens": "many"}))
    (tmp_path / "work").mkdir()
    with ServerProcess(where, tmp_path / "work", *CLI_ARGS) as srv:
        for body, field in (({"max_tokens": 4}, "top_p"), ({"top_p": 0.5}, "max_tokens")):
            r = httpx.post(f"{srv.base_url}/chat/completions", json={"messages": HI, **body}, timeout=120)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert chat(srv, top_p=0.5, max_tokens=4, ignore_eos=True)["usage"]["completion_tokens"] == 4


# 5. a generation_config.json that is not JSON --------------------------------------------------------

def test_a_generation_config_json_that_is_not_json_does_not_stop_the_model(model_dir: Path, tmp_path: Path) -> None:
    """vLLM: ModelConfig.try_get_generation_config -> transformers_utils/config.py
    try_get_generation_config catches the OSError GenerationConfig.from_pretrained raises for a
    generation_config.json that is not valid JSON ("It looks like the config file ... is not a valid
    JSON file") and falls back to GenerationConfig.from_model_config(config.json): the model loads
    and, with no sampling field there, get_diff_sampling_param is {} (vLLM's neutral defaults)."""
    path = tmp_path / "broken_generation_config"
    shutil.copytree(model_dir, path)
    (path / "generation_config.json").write_text('{"temperature": 0.6,')
    llm = LLM(str(path), **ENGINE)
    assert llm.get_default_sampling_params() == SamplingParams()
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 1
