"""The server's guard rails: the API key and the queue limit (a server started with
`--api-key` and `--max-queued-requests 2 --max-num-seqs 2`), and the key taken from the
environment."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_process import ServerProcess
from tiny_models import make_tiny_model

from nanovllm.entrypoints import cli

KEY = "test-secret-key"
OTHER_KEY = "second-key"  # vLLM's --api-key takes several; any of them opens /v1
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("limits_model"), "qwen3")
    with ServerProcess(model_dir, tmp_path_factory.mktemp("limits"), "--num-kvcache-blocks", "128",
                       "--max-model-len", "512", "--api-key", KEY, OTHER_KEY, "--max-queued-requests", "2",
                       "--max-num-seqs", "2") as srv:
        yield srv


def test_api_key_required_on_v1_routes(server: ServerProcess) -> None:
    completion = {"prompt": "hi", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    routes = [("GET", "/v1/models", None), ("POST", "/v1/completions", completion),
              ("POST", "/v1/chat/completions", chat)]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"X-Api-Key": KEY}):
            r = httpx.request(method, f"{server.url}{path}", json=body, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == 401 and r.json()["error"]["message"]
        for auth in (AUTH, {"Authorization": f"Bearer {OTHER_KEY}"}):
            r = httpx.request(method, f"{server.url}{path}", json=body, headers=auth)
            assert r.status_code == 200, r.text
    # Health, metrics and the tokenizer routes are outside /v1 and stay open (as in vLLM).
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}).status_code == 200


def test_api_key_with_openai_client(server: ServerProcess) -> None:
    bad = openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="x", prompt="hi")
    good = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    model = good.models.list().data[0].id
    usage = good.completions.create(model=model, prompt="hi", max_tokens=2).usage
    assert usage is not None and usage.completion_tokens == 2


def test_queue_limit_answers_503(server: ServerProcess) -> None:
    """2 sequences run, 2 may wait; the rest of a burst of long requests is refused at once."""
    body = {"prompt": "a long one", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def burst() -> list[tuple[int, dict | None]]:
        async with httpx.AsyncClient(timeout=60, headers=AUTH, limits=httpx.Limits(max_connections=32)) as http:
            async def one() -> tuple[int, dict | None]:
                async with http.stream("POST", f"{server.base_url}/completions", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        return r.status_code, r.json()
                    # Hold the accepted streams open until every response status is in.
                    await asyncio.sleep(0.5)
                    return 200, None

            return list(await asyncio.gather(*(one() for _ in range(12))))

    results = asyncio.run(burst())
    codes = [code for code, _ in results]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(503) >= 1 and 2 <= codes.count(200) <= 8, codes
    for code, err in results:
        if code == 503:
            assert err is not None and err["error"]["code"] == 503 and "retry" in err["error"]["message"]
    # The accepted streams were closed early: nothing stays behind, and the server serves on.
    server.wait_blocks_free(timeout=15)
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": "hi", "max_tokens": 3}, headers=AUTH)
    assert r.status_code == 200


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`nanovllm serve` takes the key from NANOVLLM_API_KEY (else vLLM's VLLM_API_KEY) when --api-key
    is absent."""
    from nanovllm.entrypoints.openai import api_server

    seen: dict[str, Any] = {}

    class FakeEngine:
        def shutdown(self) -> None:  # the CLI stops the engine (its TP workers) when the server returns
            seen["shutdowns"] = seen.get("shutdowns", 0) + 1

    class FakeLLM:
        engine = FakeEngine()

    def fake_make_llm(args: argparse.Namespace, model: str) -> FakeLLM:
        seen["model"] = model
        return FakeLLM()

    monkeypatch.setattr(cli, "_make_llm", fake_make_llm)
    monkeypatch.setattr(cli, "_check_port_free", lambda host, port: seen.setdefault("checked", []).append((host, port)))
    monkeypatch.setattr(api_server, "run_server", lambda engine, config: seen.update(config=config))
    monkeypatch.setenv("NANOVLLM_API_KEY", "from-env")
    assert cli.main(["serve", str(tmp_path), "--port", "1234"]) == 0
    assert seen["checked"] == [("127.0.0.1", 1234)]  # before the model (tests/test_errors_name_the_cause.py)
    config = seen["config"]
    assert (config.api_key, config.host, config.port) == (["from-env"], "127.0.0.1", 1234)
    assert config.served_model_names == [str(tmp_path)]
    assert seen["shutdowns"] == 1
    assert cli.main(["serve", str(tmp_path), "--api-key", "flag", "--served-model-name", "a", "b"]) == 0
    assert seen["config"].api_key == ["flag"] and seen["config"].served_model_names == ["a", "b"]
    monkeypatch.delenv("NANOVLLM_API_KEY")
    assert cli.main(["serve", str(tmp_path)]) == 0
    assert seen["config"].api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "vllm-env")  # a vLLM deployment's key: never left unused
    assert cli.main(["serve", str(tmp_path)]) == 0
    assert seen["config"].api_key == ["vllm-env"]
