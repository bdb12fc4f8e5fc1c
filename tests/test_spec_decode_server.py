"""Speculative decoding through the server: `serve --speculative-config JSON`, the completions it
serves and its counters in /metrics (the command line's flag: tests/test_cli.py)."""

from __future__ import annotations

import json
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
