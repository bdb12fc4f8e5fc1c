"""Conventions of vLLM's server that its clients rely on beyond the OpenAI schema: the request
id a client names, an empty model name, the /ping probe, the developer role and tool-call history
as chat templates get them, the reply's role without a generation prompt, and the prefix cache's
part of the usage (--enable-prompt-tokens-details). The server runs in-process (TestClient)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tiny_models import make_tiny_model

from nanovllm import LLM, SamplingParams
from nanovllm.chat_inputs import template_conversation
from nanovllm.entrypoints.openai.api_server import ServerConfig, build_app

ENGINE_ARGS = {"device": "cpu", "num_kvcache_blocks": 128, "max_model_len": 512, "block_size": 16}
MODEL = "tiny"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return LLM(str(make_tiny_model(tmp_path_factory.mktemp("conventions_model"), "qwen3")), **ENGINE_ARGS)


def serve(llm: LLM, **options: Any) -> TestClient:
    config = ServerConfig(model_path="tiny-qwen3", served_model_names=[MODEL], **options)
    return TestClient(build_app(llm.engine, config))


@pytest.fixture(scope="module")
def client(llm: LLM) -> Iterator[TestClient]:
    with serve(llm) as c:
        yield c


def sse_chunks(client: TestClient, path: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    with client.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_request_ids_the_client_names(client: TestClient) -> None:
    """vLLM's: the X-Request-Id header, else the body's request_id, names the response (every
    chunk of a stream too); the engine's own ids stay unique, so two requests may share one."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
    r = client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "my-req-123"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-my-req-123"
    r = client.post("/v1/completions", json={**completion, "request_id": "rid-9"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-rid-9"
    r = client.post("/v1/completions", json={**completion, "request_id": "body"}, headers={"X-Request-Id": "head"})
    assert r.json()["id"] == "cmpl-head"
    chunks = sse_chunks(client, "/v1/chat/completions", {**chat, "request_id": "streamed"})
    assert chunks and {c["id"] for c in chunks} == {"chatcmpl-streamed"}
    fresh = {client.post("/v1/completions", json=completion).json()["id"] for _ in range(2)}
    assert len(fresh) == 2 and all(i.startswith("cmpl-") for i in fresh)

    results: list[int] = []

    def send() -> None:
        body = {**completion, "max_tokens": 8, "ignore_eos": True}
        results.append(client.post("/v1/completions", json=body, headers={"X-Request-Id": "same"}).status_code)

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200, 200, 200]


def test_empty_model_name_is_the_served_model(client: TestClient) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                       ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        r = client.post(path, json={**body, "model": ""})
        assert r.status_code == 200, (path, r.text)
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404


def test_ping_and_allow_header(client: TestClient) -> None:
    assert client.get("/ping").status_code == 200 and client.post("/ping").status_code == 200
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == 405


def test_developer_role_reaches_templates_as_system(client: TestClient, llm: LLM) -> None:
    """vLLM's: where the template never names "developer" (OpenAI's newer name for the system
    role), developer messages become system ones, merged with any others into one at the front."""
    tok = llm.get_tokenizer()

    def rendered(messages: list[dict[str, str]]) -> list[int]:
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)

    def served(messages: list[dict[str, str]]) -> list[int]:
        r = client.post("/tokenize", json={"model": MODEL, "messages": messages})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    dev_first = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert served(dev_first) == rendered([{"role": "system", "content": "be brief"}, dev_first[1]])
    mixed = [{"role": "system", "content": "one"}, {"role": "user", "content": "hi"},
             {"role": "developer", "content": "two"}]
    merged = [{"role": "system", "content": "one\n\ntwo"}, {"role": "user", "content": "hi"}]
    assert served(mixed) == rendered(merged)
    # The same conversation through LLM.chat, as vLLM's offline chat converts it too.
    params = SamplingParams(temperature=0, max_tokens=1)
    assert llm.chat(mixed, params, use_tqdm=False)[0].prompt_token_ids == rendered(merged)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": dev_first, "max_tokens": 1})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == len(rendered([{"role": "system", "content": "be brief"}, dev_first[1]]))


def test_template_conversation_rules() -> None:
    developer = [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]
    # A template that names the role gets it as sent.
    assert template_conversation(developer, "{% if m.role == 'developer' %}{% endif %}") == developer
    assert template_conversation(developer, {"default": 'x "developer"', "tool_use": "y"}) == developer
    assert template_conversation(developer, "{{ messages }}") == [{"role": "system", "content": "d"}, developer[1]]
    # A lone system message already at the front keeps its other fields.
    named = [{"role": "developer", "content": "d", "name": "n", "tools": []}, {"role": "user", "content": "u"}]
    assert template_conversation(named, "") == [{"role": "system", "content": "d", "name": "n"}, named[1]]
    # Text parts of merged system messages are joined by newlines, empty ones dropped.
    parts = [{"role": "user", "content": "u"}, {"role": "system", "content": [{"type": "text", "text": "a"},
                                                                              {"type": "text", "text": "b"}]},
             {"role": "developer", "content": ""}]
    assert template_conversation(parts, None) == [{"role": "system", "content": "a\nb"}, parts[0]]
    # No developer message: the conversation is untouched (system messages where they are).
    late_system = [{"role": "user", "content": "u"}, {"role": "system", "content": "s"}]
    assert template_conversation(late_system, None) == late_system


def test_tool_call_arguments_reach_templates_as_objects() -> None:
    def call(arguments: Any) -> dict[str, Any]:
        return {"role": "assistant", "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}

    def arguments(message: dict[str, Any]) -> Any:
        return template_conversation([message], None)[0]["tool_calls"][0]["function"]["arguments"]

    assert arguments(call('{"city": "Paris", "n": 2}')) == {"city": "Paris", "n": 2}
    assert arguments(call({"already": "parsed"})) == {"already": "parsed"}
    for not_an_object in ("", None, "not json", "[1, 2]", "42"):
        assert arguments(call(not_an_object)) == {}
    sent = call('{"a": 1}')
    template_conversation([sent], None)
    assert sent["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the caller's message is not changed
    for none in ([], None):  # vLLM drops both: templates test `'tool_calls' in message`
        empty = {"role": "assistant", "content": "x", "tool_calls": none}
        assert template_conversation([empty], None) == [{"role": "assistant", "content": "x"}]
    for bad in ([{"type": "code", "function": {}}], [{"type": "function"}], ["f"]):
        with pytest.raises(ValueError, match="tool_calls must be objects of type 'function'"):
            template_conversation([{"role": "assistant", "tool_calls": bad}], None)


def test_bad_tool_call_history_is_a_400(client: TestClient) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": ["f"]},
                {"role": "user", "content": "again"}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "tool_calls" in r.json()["error"]["message"]


def test_reply_role_without_a_generation_prompt(client: TestClient) -> None:
    """vLLM's: a reply that continues the conversation's last message takes that message's role."""
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = client.post("/v1/chat/completions", json={**body, "add_generation_prompt": False})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "user"
    chunks = sse_chunks(client, "/v1/chat/completions", {**body, "add_generation_prompt": False})
    assert chunks[0]["choices"][0]["delta"]["role"] == "user"
    assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["role"] == "assistant"
    cont = {**body, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
            "add_generation_prompt": False, "continue_final_message": True}
    assert client.post("/v1/chat/completions", json=cont).json()["choices"][0]["message"]["role"] == "assistant"


def test_prompt_tokens_details(llm: LLM, client: TestClient) -> None:
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, the prompt tokens
    whose KV the prefix cache held when the request was first scheduled (whole blocks); null
    without the flag, as vLLM's."""
    prompt = "a shared prefix that spans several blocks of the cache " * 4
    completion = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    assert client.post("/v1/completions", json=completion).json()["usage"]["prompt_tokens_details"] is None
    with serve(llm, enable_prompt_tokens_details=True) as detailed:
        first = detailed.post("/v1/completions", json={**completion, "prompt": "x " + prompt}).json()["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        again = detailed.post("/v1/completions", json={**completion, "prompt": "x " + prompt}).json()["usage"]
        cached = again["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and cached % 16 == 0 and cached <= again["prompt_tokens"]
        # Two prompts: their hits summed.
        two = detailed.post("/v1/completions", json={**completion, "prompt": ["x " + prompt, "x " + prompt]})
        assert two.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * cached
        chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
        detailed.post("/v1/chat/completions", json=chat)
        usage = detailed.post("/v1/chat/completions", json=chat).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        chunks = sse_chunks(detailed, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
        assert chunks[-1]["usage"]["prompt_tokens_details"] == usage["prompt_tokens_details"]
        streamed = sse_chunks(detailed, "/v1/completions", {**completion, "stream_options": {"include_usage": True}})
        assert streamed[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_echoed_prompt_tokens_of_a_metaspace_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> None:
    """An echo's first prompt token has no logprob entry: vLLM names it tokenizer.decode([id]),
    without the leading space its logprob strings put back (those of the other prompt tokens)."""
    from test_detokenizer import _sp_tokenizer, vllm_token_string

    from nanovllm.builtin_model import TinyModelSpec, build_hf_model

    path = tmp_path_factory.mktemp("metaspace")
    tok = _sp_tokenizer("first")
    tok.save_pretrained(path)
    build_hf_model(TinyModelSpec(arch="LlamaForCausalLM", vocab_size=len(tok), head_dim=16, seed=9),
                   eos_token_id=tok.eos_token_id).save_pretrained(path, safe_serialization=True)
    ids = tok.encode(" hello world", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids[0]).startswith("▁")  # a token whose space decode drops
    with serve(LLM(str(path), **ENGINE_ARGS)) as client:
        body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
        tokens = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
    assert tokens[:len(ids)] == [tok.decode([ids[0]])] + [vllm_token_string(tok, i) for i in ids[1:]]
    assert not tokens[0].startswith(" ")
