"""Speculative decoding through the command line and the server: `--speculative-config` JSON on
`generate` and `serve`, its counters in /metrics, and a bad config refused naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess
from tiny_models import make_tiny_model

from nanovllm import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
PROMPT = "ab ab ab ab ab ab ab ab ab"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec_cli"), "qwen3")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nanovllm.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parent)


def test_generate_with_speculative_config(model_dir: Path) -> None:
    res = run_cli("generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-tokens", "24",
                  "--num-kvcache-blocks", "64", "--max-model-len", "256", "--device", "cpu",
                  "--speculative-config", json.dumps(SPEC))
    assert res.returncode == 0, res.stderr
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=64, max_model_len=256)
    expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    assert res.stdout == expected + "\n"


def test_bad_speculative_config_names_the_field(model_dir: Path) -> None:
    res = run_cli("generate", "--model", str(model_dir), "--prompt", "x", "--device", "cpu",
                  "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}')
    assert res.returncode != 0
    assert "speculative_config.num_speculative_tokens" in res.stderr and "Traceback" not in res.stderr


def test_server_counts_drafts(model_dir: Path, tmp_path: Path) -> None:
    server = ServerProcess(model_dir, tmp_path, "--num-kvcache-blocks", "64", "--max-model-len", "256",
                           "--speculative-config", json.dumps(SPEC))
    with server:
        body = {"model": str(model_dir), "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
        r = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=64, max_model_len=256)
        expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
        assert r.json()["choices"][0]["text"] == expected.text
        m = server.metrics()
        drafted = m["nanovllm:spec_decode_num_draft_tokens_total"]
        accepted = m["nanovllm:spec_decode_num_accepted_tokens_total"]
        assert drafted > 0 and 0 <= accepted <= drafted
        assert m["nanovllm:spec_decode_num_accepted_tokens_per_pos_total"] == accepted
