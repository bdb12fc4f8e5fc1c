"""Structured output over HTTP: `response_format` (json_object, json_schema) on chat completions
through the official openai client, vLLM's `structured_outputs` on completions and chat, streamed
and not; an invalid schema, regex or grammar is a 400 naming it, and the server stays whole."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_process import ServerProcess
from test_structured_output import PERSON
from tiny_models import make_tiny_model

HI: Any = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = make_tiny_model(tmp_path_factory.mktemp("structured_model"), "qwen3")
    with ServerProcess(model, tmp_path_factory.mktemp("server"), "--num-kvcache-blocks", "256",
                       "--max-model-len", "512", "--served-model-name", "tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def assert_chat_follows_person_schema(client: openai.OpenAI, model: str, n: int) -> None:
    """n sampled chat completions with PERSON as the json_schema response format each finish and
    follow it."""
    resp = client.chat.completions.create(
        model=model, messages=HI, max_tokens=200, n=n, temperature=1.0, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert len(resp.choices) == n
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    assert_chat_follows_person_schema(client, "tiny", 3)


def test_response_format_json_object(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="tiny", messages=HI, max_tokens=60, n=4, temperature=1.0, seed=3,
                                          response_format={"type": "json_object"})
    done = [c.message.content or "" for c in resp.choices if c.finish_reason == "stop"]
    assert done
    assert all(isinstance(json.loads(text), dict) for text in done)


def test_structured_outputs_on_completions_streamed_and_not(client: openai.OpenAI) -> None:
    choices = ["red", "green", "blue"]
    resp = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=20, n=2, temperature=1.0,
                                     extra_body={"structured_outputs": {"choice": choices}})
    assert len(resp.choices) == 4 and all(c.text in choices and c.finish_reason == "stop" for c in resp.choices)
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for chunk in client.completions.create(model="tiny", prompt="x", max_tokens=40, n=2, temperature=0.9,
                                           stream=True, extra_body={"structured_outputs": {"regex": "[0-9]{4}-[a-z]{3}"}}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert sorted(texts) == [0, 1]
    assert all(re.fullmatch("[0-9]{4}-[a-z]{3}", t) for t in texts.values()) and set(finish.values()) == {"stop"}


def test_structured_outputs_on_chat(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="tiny", messages=HI, max_tokens=30, temperature=0,
                                          extra_body={"structured_outputs": {"grammar": 'root ::= "ok" | "no"'}})
    assert resp.choices[0].message.content in ("ok", "no") and resp.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= nope"}},
     "structured_outputs.grammar"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": {"type": "nonsense"}}},
     "structured_outputs.json"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"xml": "a"}}, "unknown field"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "structured_outputs.json"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_object"},
                              "structured_outputs": {"regex": "a"}}, "cannot both"),
])
def test_invalid_spec_is_400_and_server_stays_whole(server: ServerProcess, client: openai.OpenAI, path: str,
                                                    body: dict, message: str) -> None:
    r = httpx.post(server.url + path, json={"model": "tiny", "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].finish_reason
    server.wait_blocks_free()
