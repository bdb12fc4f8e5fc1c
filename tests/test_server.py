"""The OpenAI-compatible server end to end: a real `nanovllm serve` process on a tiny model,
driven by the official `openai` client (and raw httpx where the client would not send it), its
outputs checked against `LLM.generate` / `LLM.chat` in this process with the same engine options."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from server_process import ServerProcess
from tiny_models import make_tiny_model

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.openai.api_server import ServerConfig, build_app

ENGINE_ARGS = {"num_kvcache_blocks": 256, "max_model_len": 512, "block_size": 16}
CLI_ARGS = ["--num-kvcache-blocks", "256", "--max-model-len", "512", "--block-size", "16"]
MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("server_model"), "qwen3")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess(model_dir, tmp_path_factory.mktemp("server"), *CLI_ARGS,
                       "--served-model-name", MODEL, "other-name") as srv:
        yield srv


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu", **ENGINE_ARGS)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def chat_messages(*turns: tuple[str, str]) -> Any:
    """[{"role", "content"}, ...] (typed Any: the client's message TypedDicts are a union)."""
    return [{"role": role, "content": content} for role, content in turns]


HI: Any = chat_messages(("user", "hi"))


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def expected_text(llm: LLM, prompt: str | list[int], max_tokens: int) -> tuple[str, str]:
    out = llm.generate(prompt, greedy(max_tokens), use_tqdm=False)[0].outputs[0]
    return out.text, out.finish_reason


# Basics -------------------------------------------------------------------------------------


def test_health_models_version(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "other-name"]
    assert models.data[0].max_model_len == 512  # type: ignore[attr-defined]
    # The startup log says where it listens and how big the KV pool is.
    assert f"http://127.0.0.1:{server.port}" in server.log() and "KV cache: 256 blocks" in server.log()


def test_completion_greedy_matches_llm(client: openai.OpenAI, llm: LLM) -> None:
    for prompt, max_tokens in (("Hello, my name is", 12), ("The capital of France", 20), ("a", 5)):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        text, reason = expected_text(llm, prompt, max_tokens)
        assert resp.object == "text_completion" and resp.model == MODEL and resp.id.startswith("cmpl-")
        assert resp.choices[0].text == text
        assert resp.choices[0].finish_reason == reason
        n_prompt = len(llm.get_tokenizer().encode(prompt))
        n_out = len(llm.generate(prompt, greedy(max_tokens), use_tqdm=False)[0].outputs[0].token_ids)
        assert resp.usage is not None
        assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (n_prompt, n_out)
        assert resp.usage.total_tokens == n_prompt + n_out


def test_completion_any_served_name_and_no_model(server: ServerProcess, client: openai.OpenAI) -> None:
    resp = client.completions.create(model="other-name", prompt="hi", max_tokens=2)
    assert resp.model == MODEL  # the first name is the one reported
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_completion_stream_equals_non_stream(server: ServerProcess, client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in [c for c in chunks if c.choices][:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])
    # The raw event stream: `data: {...}` events, the last one `data: [DONE]`.
    with httpx.stream("POST", f"{server.base_url}/completions", json={**kw, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == full.choices[0].text


def test_chat_matches_llm_chat(client: openai.OpenAI, llm: LLM) -> None:
    messages = chat_messages(("system", "You are terse."), ("user", "Say something."))
    expected = llm.chat(messages, greedy(16), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.outputs[0].text
    assert resp.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert resp.usage is not None and resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)
    # max_completion_tokens wins over the deprecated max_tokens.
    short = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3,
                                           max_tokens=100, temperature=0)
    assert short.usage is not None and short.usage.completion_tokens == 3

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.outputs[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_chat_without_max_tokens_may_fill_the_context(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=chat_messages(("user", "x")),
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage is not None and resp.usage.total_tokens == 512
    assert resp.choices[0].finish_reason == "length"


def test_token_id_prompts(client: openai.OpenAI, llm: LLM) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 17, 40)]
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0)
    expected = llm.generate(prompts, greedy(10), use_tqdm=False)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [e.outputs[0].text for e in expected]
    one = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=10, temperature=0)
    assert one.choices[0].text == expected[1].outputs[0].text
    assert one.usage is not None and one.usage.prompt_tokens == 17


def test_n_and_seed(server: ServerProcess, client: openai.OpenAI) -> None:
    prompts = ["Tell me", "Another"]
    kw: dict[str, Any] = {"model": MODEL, "prompt": prompts, "max_tokens": 12, "temperature": 1.0, "n": 3,
                          "extra_body": {"ignore_eos": True}}
    a = client.completions.create(seed=1234, **kw)
    b = client.completions.create(seed=1234, **kw)
    c = client.completions.create(seed=99, **kw)
    assert [ch.index for ch in a.choices] == list(range(6))
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert [ch.text for ch in a.choices] != [ch.text for ch in c.choices]
    assert len({ch.text for ch in a.choices}) > 1  # the n samples differ
    prompt_tokens = sum(len(httpx.post(f"{server.url}/tokenize", json={"prompt": p}).json()["tokens"])
                        for p in prompts)
    assert a.usage is not None and (a.usage.prompt_tokens, a.usage.completion_tokens) == (prompt_tokens, 6 * 12)
    # Streaming n > 1: every choice arrives, each once finished, same texts as non-streamed.
    chunks = list(client.completions.create(seed=1234, stream=True, **kw))
    texts: dict[int, str] = {}
    finished: dict[int, int] = {}
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = finished.get(choice.index, 0) + 1
    assert [texts[i] for i in range(6)] == [ch.text for ch in a.choices]
    assert finished == {i: 1 for i in range(6)}
    chat = client.chat.completions.create(model=MODEL, messages=HI,
                                          n=2, max_tokens=5, temperature=1.0, seed=5)
    assert [ch.index for ch in chat.choices] == [0, 1]


def test_stop_strings(server: ServerProcess, client: openai.OpenAI) -> None:
    prompt = "Once upon a time there was"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # A stop string of two ASCII letters from the middle of the greedy text.
    starts = [i for i in range(3, len(full) - 2) if full[i:i + 2].isascii() and full[i:i + 2].isalpha()]
    assert starts, f"no ASCII letters in {full!r}"
    stop = full[starts[len(starts) // 2]:starts[len(starts) // 2] + 2]
    cut = full[:full.index(stop)]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stop=[stop, "\x00zz"],
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == cut
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].stop_reason == stop  # type: ignore[attr-defined]
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut
    kept = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stop=stop,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop


def test_logprobs(client: openai.OpenAI, llm: LLM) -> None:
    prompt = "The quick brown fox"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    expected = llm.generate(prompt, greedy(8, logprobs=3), use_tqdm=False)[0].outputs[0]
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(expected.token_ids) == 8
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for tok_id, got, top, entry in zip(expected.token_ids, lp.token_logprobs, lp.top_logprobs, expected.logprobs or []):
        assert got == pytest.approx(entry[tok_id].logprob, abs=1e-4)
        assert 1 <= len(top) <= 4 and got == pytest.approx(max(top.values()), abs=1e-5)  # greedy: chosen is best
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1, echo=True)
    n_prompt = len(llm.get_tokenizer().encode(prompt))
    elp = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith(prompt)
    assert elp is not None and elp.token_logprobs is not None
    assert len(elp.token_logprobs) == n_prompt + 4 and elp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in elp.token_logprobs[1:])

    chat = client.chat.completions.create(model=MODEL, messages=HI,
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    offline = llm.chat(HI, greedy(5, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert offline.logprobs is not None and chat.choices[0].message.content == offline.text
    # The engine's strings (vLLM's: "" for part of a character, test_llm_vllm_parity).
    assert [t.token for t in content] == [e[t].decoded_token for t, e in zip(offline.token_ids, offline.logprobs)]
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)
        assert t.bytes == list(t.token.encode())
    streamed = client.chat.completions.create(model=MODEL, messages=HI,
                                              max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True)
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.content or []]
    assert tokens == [t.token for t in content]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_without_generation_scores_the_prompt(server: ServerProcess, llm: LLM, stream: bool) -> None:
    """echo with max_tokens 0 (OpenAI's legacy completions, vLLM's echo without generation): the
    prompt and its logprobs, nothing generated, no completion tokens counted."""
    prompt = "The quick brown fox jumps"
    ids = llm.get_tokenizer().encode(prompt)
    expected = llm.generate(prompt, greedy(1, prompt_logprobs=1), use_tqdm=False)[0].prompt_logprobs
    assert expected is not None and len(expected) == len(ids)
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "n": 2}
    choices: dict[int, dict[str, Any]] = {}
    if stream:
        usage = None
        with httpx.stream("POST", f"{server.base_url}/completions", timeout=60,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    for c in chunk["choices"]:
                        got = choices.setdefault(c["index"], {"text": "", "token_logprobs": []})
                        got["text"] += c["text"]
                        got["token_logprobs"] += (c["logprobs"] or {}).get("token_logprobs") or []
                        got["finish_reason"] = c["finish_reason"] or got.get("finish_reason")
    else:
        r = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        choices = {c["index"]: {**c, "token_logprobs": c["logprobs"]["token_logprobs"]} for c in r.json()["choices"]}
    assert usage == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                     "prompt_tokens_details": None}  # vLLM's null without --enable-prompt-tokens-details
    assert sorted(choices) == [0, 1]
    for c in choices.values():
        assert c["text"] == prompt and c["finish_reason"] == "length"
        assert c["token_logprobs"][0] is None and len(c["token_logprobs"]) == len(ids)
        for tid, got, entry in zip(ids[1:], c["token_logprobs"][1:], expected[1:]):
            assert entry is not None and got == pytest.approx(entry[tid].logprob, abs=1e-4)
    server.wait_blocks_free()


def test_n_null_and_truncated_prompts(server: ServerProcess, client: openai.OpenAI, llm: LLM) -> None:
    """n: null is 1 (OpenAI's "integer or null"); vLLM's truncate_prompt_tokens keeps the prompt's
    last k tokens (its first with truncation_side "right"; -1: max_model_len - 1), in both routes."""
    for path, body in (("/completions", {"prompt": "hi"}), ("/chat/completions", CHAT_OK)):
        r = httpx.post(f"{server.base_url}{path}", json={**body, "model": MODEL, "n": None, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    ids = llm.get_tokenizer().encode("word " * 40)
    assert len(ids) > 10
    r = client.completions.create(model=MODEL, prompt="word " * 40, max_tokens=6, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 10})
    assert r.usage is not None and r.usage.prompt_tokens == 10
    kept = llm.generate({"prompt_token_ids": ids[-10:]}, greedy(6), use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == kept.text
    chat = client.chat.completions.create(model=MODEL, messages=chat_messages(("user", "word " * 40)), max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 7})
    assert chat.usage is not None and chat.usage.prompt_tokens == 7
    first = client.completions.create(model=MODEL, prompt="word " * 40, max_tokens=6, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 10, "truncation_side": "right"})
    assert first.usage is not None and first.usage.prompt_tokens == 10
    head = llm.generate({"prompt_token_ids": ids[:10]}, greedy(6), use_tqdm=False)[0].outputs[0]
    assert first.choices[0].text == head.text
    # -1 leaves a token of room: a prompt past max_model_len (512) still generates.
    whole = client.completions.create(model=MODEL, prompt=list(range(1, 101)) * 6, max_tokens=4, temperature=0,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage is not None and whole.usage.prompt_tokens == 511 and whole.usage.completion_tokens == 1


def test_vllm_sampling_extras(client: openai.OpenAI) -> None:
    base: dict[str, Any] = {"model": MODEL, "prompt": "Hello", "temperature": 0}
    r = client.completions.create(max_tokens=40, extra_body={"ignore_eos": True}, **base)
    assert r.usage is not None and r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    r = client.completions.create(max_tokens=10, extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.2,
                                                             "min_tokens": 10}, **base)
    assert r.usage is not None and r.usage.completion_tokens == 10
    # logit_bias: +100 on one token makes greedy pick it every time.
    r = client.completions.create(max_tokens=5, logit_bias={"77": 100}, extra_body={"ignore_eos": True}, logprobs=0,
                                  **base)
    tok77 = r.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert tok77 is not None and len(set(tok77)) == 1
    # stop_token_ids: the biased token is also a stop token.
    r = client.completions.create(max_tokens=20, extra_body={"stop_token_ids": [77]}, logit_bias={"77": 100}, **base)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == 77  # type: ignore[attr-defined]
    assert r.usage is not None and r.usage.completion_tokens == 1
    r = client.completions.create(max_tokens=8, presence_penalty=1.5, frequency_penalty=-0.5, top_p=0.9, **base)
    assert r.usage is not None and r.usage.completion_tokens >= 1


def test_vllm_response_options(server: ServerProcess, llm: LLM) -> None:
    """vLLM's return_token_ids (the choices' and the prompt's token ids, streamed too),
    return_tokens_as_token_ids ("token_id:N" in logprobs), top_logprobs 0 without logprobs, the
    server's clamp of logit_bias to [-100, 100], and system_fingerprint (null) as vLLM sends them."""
    url = server.base_url
    prompt_ids = llm.get_tokenizer().encode("Hello there")
    expected = llm.generate({"prompt_token_ids": prompt_ids}, greedy(5, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/completions", json={**body, "return_token_ids": True}).json()
    assert r["system_fingerprint"] is None
    choice = r["choices"][0]
    assert choice["token_ids"] == list(expected.token_ids) and choice["prompt_token_ids"] == prompt_ids
    plain = httpx.post(f"{url}/completions", json=body).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None
    streamed_ids: list[int] = []
    prompts_seen = []
    with httpx.stream("POST", f"{url}/completions", json={**body, "return_token_ids": True, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                streamed_ids += c["token_ids"]
                prompts_seen.append(c["prompt_token_ids"])
    assert streamed_ids == list(expected.token_ids)
    assert prompts_seen[0] == prompt_ids and all(p is None for p in prompts_seen[1:])
    chat = {"model": MODEL, "messages": HI, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/chat/completions", json={**chat, "return_token_ids": True}).json()
    tok = llm.get_tokenizer()
    rendered = tok.encode(tok.apply_chat_template(HI, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    assert r["prompt_token_ids"] == rendered and len(r["choices"][0]["token_ids"]) == 4
    # Tokens named by id: the same logprobs, keys "token_id:N".
    lp = httpx.post(f"{url}/completions", json={**body, "logprobs": 2, "return_tokens_as_token_ids": True}).json()
    lp = lp["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in expected.token_ids]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    c = httpx.post(f"{url}/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2,
                                                     "return_tokens_as_token_ids": True}).json()
    content = c["choices"][0]["logprobs"]["content"]
    assert all(e["token"].startswith("token_id:") and e["top_logprobs"][0]["token"].startswith("token_id:")
               for e in content)
    # documents reach the template as apply_chat_template's argument (this template ignores them).
    with_docs = httpx.post(f"{url}/chat/completions", json={**chat, "documents": [{"title": "t", "text": "x"}]})
    assert with_docs.status_code == 200, with_docs.text
    assert with_docs.json()["usage"]["prompt_tokens"] == len(rendered)
    # top_logprobs 0 (OpenAI's default) asks for nothing: no logprobs needed.
    r0 = httpx.post(f"{url}/chat/completions", json={**chat, "top_logprobs": 0})
    assert r0.status_code == 200 and r0.json()["choices"][0]["logprobs"] is None
    # logit_bias past 100 is clamped to it, as vLLM's server does: the same tokens as +100.
    hundred = httpx.post(f"{url}/completions", json={**body, "logit_bias": {"77": 100}}).json()["choices"][0]["text"]
    over = httpx.post(f"{url}/completions", json={**body, "logit_bias": {"77": 500}})
    assert over.status_code == 200 and over.json()["choices"][0]["text"] == hundred
    server.wait_blocks_free()


def test_chat_template_variables() -> None:
    """reasoning_effort reaches the chat template as vLLM passes it (it also sets enable_thinking
    unless chat_template_kwargs does); documents go as apply_chat_template's own argument
    (test_vllm_response_options)."""
    from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": HI, "reasoning_effort": "none"})
    assert req.template_variables() == {"reasoning_effort": "none", "enable_thinking": False}
    req = ChatCompletionRequest.model_validate({"messages": HI, "reasoning_effort": "high",
                                                "chat_template_kwargs": {"enable_thinking": False, "x": 1}})
    assert req.template_variables() == {"enable_thinking": False, "x": 1, "reasoning_effort": "high"}


def test_allowed_token_ids(server: ServerProcess, client: openai.OpenAI) -> None:
    """vLLM's allowed_token_ids: only those are sampled, greedy or not, whatever the logits say."""
    allowed = [77, 78]
    strings = {httpx.post(f"{server.url}/detokenize", json={"tokens": [t]}).json()["prompt"] for t in allowed}
    for temperature in (0.0, 1.0):
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, logprobs=0, temperature=temperature,
                                      extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
        tokens = r.choices[0].logprobs.tokens  # type: ignore[union-attr]
        assert tokens is not None and len(tokens) == 6 and set(tokens) <= strings, tokens


def test_max_tokens_past_the_context_is_cut_to_it(client: openai.OpenAI) -> None:
    """vLLM 0.32's get_max_tokens: a prompt and max_tokens past max_model_len get the room left (512 -
    400), not a 400; only a max_tokens above max_model_len itself is refused (the table below)."""
    for body in ({"max_tokens": 200}, {"max_tokens": 512}):
        r = client.completions.create(model=MODEL, prompt=list(range(1, 401)), temperature=0,
                                      extra_body={"ignore_eos": True}, **body)  # type: ignore[arg-type]
        assert r.usage is not None and r.usage.completion_tokens == 112 and r.choices[0].finish_reason == "length"


def test_bad_words_as_offline(client: openai.OpenAI, llm: LLM) -> None:
    """vLLM's bad_words over HTTP: the tokens the offline engine gives with the same words."""
    tok = llm.get_tokenizer()
    prompt = tok.encode("Hello world")
    base = llm.generate({"prompt_token_ids": prompt}, greedy(12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    words = [tok.decode(base.token_ids[i:i + 2]).strip() for i in (2, 5)]
    expected = llm.generate({"prompt_token_ids": prompt}, greedy(12, ignore_eos=True, bad_words=words),
                            use_tqdm=False)[0].outputs[0]
    assert expected.token_ids != base.token_ids
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"bad_words": words, "ignore_eos": True})
    assert r.choices[0].text == expected.text
    messages = chat_messages(("user", "Hello world"))
    chat_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_base = llm.generate(chat_prompt, greedy(12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    chat_words = [tok.decode(chat_base.token_ids[i:i + 1]).strip() for i in (1, 3)]
    chat_expected = llm.generate(chat_prompt, greedy(12, ignore_eos=True, bad_words=chat_words),
                                 use_tqdm=False)[0].outputs[0]
    c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"bad_words": chat_words, "ignore_eos": True})
    assert c.choices[0].message.content == chat_expected.text


def test_generation_config_defaults(model_dir: Path, llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM's --generation-config: a sampling field a request leaves out takes the generation
    config's value (here --override-generation-config's), a field it sets keeps its own, and a chat
    request without max_tokens stops at max_new_tokens."""
    defaults = {"temperature": 0, "repetition_penalty": 1.5, "max_new_tokens": 7}
    tok = llm.get_tokenizer()
    chat_prompt = tok.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    with ServerProcess(model_dir, tmp_path_factory.mktemp("gen_config"), *CLI_ARGS, "--served-model-name", MODEL,
                       "--override-generation-config", json.dumps(defaults)) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60)
        c = client.chat.completions.create(model=MODEL, messages=HI, extra_body={"ignore_eos": True})
        expected = llm.generate(chat_prompt, greedy(7, repetition_penalty=1.5, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
        assert c.choices[0].message.content == expected.text and c.usage is not None
        assert c.usage.completion_tokens == 7
        own = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5,
                                             extra_body={"repetition_penalty": 1.0, "ignore_eos": True})
        plain = llm.generate(chat_prompt, greedy(5, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert own.choices[0].message.content == plain.text
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, extra_body={"ignore_eos": True})
        assert r.choices[0].text == llm.generate("Hello", greedy(6, repetition_penalty=1.5, ignore_eos=True),
                                                 use_tqdm=False)[0].outputs[0].text


def stream_chunks(server: ServerProcess, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.url}{route}", json={**body, "stream": True}, timeout=60) as r:
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_continuous_usage_is_per_choice_and_needs_include_usage(server: ServerProcess) -> None:
    """vLLM's continuous_usage_stats: each chunk's usage is its prompt's tokens and its choice's so far,
    only with include_usage; without it, no usage at all."""
    prompts = [list(range(5, 12)), list(range(20, 24))]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    plain = stream_chunks(server, "/v1/completions", {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all(c.get("usage") is None for c in plain)
    chunks = stream_chunks(server, "/v1/completions",
                           {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *choice_chunks, final = chunks
    assert final["choices"] == [] and final["usage"] == {"prompt_tokens": 11, "completion_tokens": 20,
                                                          "total_tokens": 31, "prompt_tokens_details": None}
    last: dict[int, int] = {}
    for c in choice_chunks:
        index = c["choices"][0]["index"]
        usage = c["usage"]
        assert usage["prompt_tokens"] == len(prompts[index // 2])
        assert usage["completion_tokens"] >= last.get(index, 0)
        last[index] = usage["completion_tokens"]
    assert last == {0: 5, 1: 5, 2: 5, 3: 5}
    chat = stream_chunks(server, "/v1/chat/completions",
                         {"model": MODEL, "messages": HI, "n": 2, "max_tokens": 4, "ignore_eos": True,
                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *chat_chunks, chat_final = chat
    n_prompt = chat_final["usage"]["prompt_tokens"]
    assert chat_final["usage"]["completion_tokens"] == 8
    seen: dict[int, int] = {}
    for c in chat_chunks:
        assert c["usage"]["prompt_tokens"] == n_prompt
        seen[c["choices"][0]["index"]] = c["usage"]["completion_tokens"]
    assert seen == {0: 4, 1: 4}


def test_server_bad_words_are_not_tokenized_on_the_engine_thread(model_dir: Path) -> None:
    """The server's rule (serving_base.Prompt.for_engine): "the tokenizer is only used by the
    server's text workers, never from the engine thread" -- a step waits for whatever the engine
    thread does. vLLM tokenizes bad_words in InputProcessor.process_inputs
    (vllm/v1/engine/input_processor.py, SamplingParams.update_from_tokenizer), in the API server,
    never in the engine core's loop. (A request's bad_words, up to max_request_bytes of text,
    would stall every running request's steps there.)"""
    llm = LLM(str(model_dir), device="cpu", **ENGINE_ARGS)
    tok = llm.get_tokenizer()
    threads: list[str] = []
    encode: Callable[..., Any] = tok.encode

    def recording_encode(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    tok.encode = recording_encode  # type: ignore[method-assign]
    app = build_app(llm.engine, ServerConfig(model_path=str(model_dir)))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": str(model_dir), "prompt": "hello world", "max_tokens": 4,
                                                 "temperature": 0, "bad_words": ["world", "hello"]})
        assert r.status_code == 200, r.text
    assert threads, "the tokenizer was used"
    assert "nanovllm-engine" not in threads, threads


def test_tokenize_detokenize(server: ServerProcess, llm: LLM) -> None:
    tok = llm.get_tokenizer()
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and len(body["token_strs"]) == body["count"]
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages})
    assert r.json()["tokens"] == llm.chat(messages, greedy(1), use_tqdm=False)[0].prompt_token_ids
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello world"}


# Concurrency -------------------------------------------------------------------------------


def test_64_concurrent_streaming_clients_match_llm(server: ServerProcess, llm: LLM) -> None:
    rng = random.Random(7)
    words = ["the", "a", "of", "cat", "dog", "house", "river", "mountain", "quick", "slow", "red", "green", "blue",
             "sings", "runs"]
    requests: list[tuple[str | list[int], int]] = []
    for i in range(64):
        max_tokens = rng.randrange(4, 33)
        if i % 2:
            requests.append(([rng.randrange(3, 512) for _ in range(rng.randrange(1, 120))], max_tokens))
        else:
            requests.append((" ".join(rng.choice(words) for _ in range(rng.randrange(1, 60))), max_tokens))
    expected = llm.generate([p for p, _ in requests], [greedy(m) for _, m in requests], use_tqdm=False)

    async def one(client: openai.AsyncOpenAI, prompt: str | list[int], max_tokens: int
                  ) -> tuple[str, str | None, float, float]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True)
        text, reason, first = "", None, 0.0
        async for chunk in stream:
            first = first or time.monotonic()
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
        return text, reason, first, time.monotonic()

    async def run() -> list[tuple[str, str | None, float, float]]:
        # The client's default pool (1000 connections) lets all 64 streams be open at once.
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        try:
            return list(await asyncio.gather(*(one(client, p, m) for p, m in requests)))
        finally:
            await client.close()

    results = asyncio.run(run())
    for i, ((text, reason, _, _), exp) in enumerate(zip(results, expected)):
        assert text == exp.outputs[0].text, f"request {i} differs"
        assert reason == exp.outputs[0].finish_reason
    # Batched requests stream at the same time: count the most streams between their first and last chunk at
    # once. Served one after another they would overlap by a chunk at most. (Sampling the running gauge from
    # /metrics instead missed the peak when the whole run took under a second.)
    events = sorted([(first, 1) for _, _, first, _ in results] + [(last, -1) for _, _, _, last in results])
    overlap = peak = 0
    for _, step in events:
        overlap += step
        peak = max(peak, overlap)
    assert peak >= 8, f"requests were not batched together (at most {peak} streams open at once)"
    server.wait_blocks_free()


# Bad requests ------------------------------------------------------------------------------

CHAT_OK = {"messages": [{"role": "user", "content": "hi"}]}
BAD_REQUESTS: list[tuple[str, str, object, int, str | None]] = [
    # (name, path, body (bytes are sent raw), status, param)
    ("malformed json", "/v1/completions", b'{"prompt": "hi",', 400, None),
    ("not an object", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("empty body", "/v1/completions", b"", 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("prompt of wrong type", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("max_tokens of wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("n of wrong type", "/v1/completions", {"prompt": "hi", "n": True}, 400, "n"),
    ("n = 0", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("temperature < 0", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p > 1", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("presence_penalty > 2", "/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("logprobs > 20", "/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("max_tokens = 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("min_tokens > max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400,
     "min_tokens"),
    ("stop of wrong type", "/v1/completions", {"prompt": "hi", "stop": 3}, 400, "stop"),
    ("empty stop string", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 2, 100000]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {"prompt": [[1, -2]]}, 400, "prompt"),
    ("token id out of vocab in the second prompt", "/v1/completions", {"prompt": [[1, 2], [3, 100000]]}, 400,
     "prompt"),
    ("stop_token_ids out of vocab", "/v1/completions", {"prompt": "hi", "stop_token_ids": [99999]}, 400,
     "stop_token_ids"),
    ("logit_bias key not a token id", "/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400,
     "logit_bias"),
    ("seed too large", "/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("prompt over max_model_len", "/v1/completions", {"prompt": list(range(1, 501)) * 2}, 400, "prompt"),
    ("max_tokens over max_model_len", "/v1/completions", {"prompt": "hi", "max_tokens": 513}, 400, "max_tokens"),
    ("unknown model", "/v1/completions", {"prompt": "hi", "model": "gpt-17"}, 404, "model"),
    ("suffix", "/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("best_of other than n", "/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("stream_options without a stream", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    # vLLM options that would change the output and that this server does not implement
    ("use_beam_search", "/v1/completions", {"prompt": "hi", "n": 2, "use_beam_search": True}, 400, "use_beam_search"),
    ("allowed_token_ids empty", "/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("allowed_token_ids out of vocab", "/v1/completions", {"prompt": "hi", "allowed_token_ids": [99999]}, 400,
     "allowed_token_ids"),
    ("bad_words with an empty word", "/v1/completions", {"prompt": "hi", "bad_words": ["x", ""]}, 400, "bad_words"),
    ("bad_words not a list", "/v1/completions", {"prompt": "hi", "bad_words": "x"}, 400, "bad_words"),
    ("bad_words of no tokens", "/v1/completions", {"prompt": "hi", "bad_words": ["   "]}, 400, "bad_words"),
    ("logits_processors", "/v1/completions", {"prompt": "hi", "logits_processors": ["m.p"]}, 400, "logits_processors"),
    ("prompt_embeds", "/v1/completions", {"prompt": "hi", "prompt_embeds": "AAAA"}, 400, "prompt_embeds"),
    ("spaces_between_special_tokens", "/v1/completions", {"prompt": "hi", "spaces_between_special_tokens": False},
     400, "spaces_between_special_tokens"),
    ("chat: bad_words of no tokens", "/v1/chat/completions", {**CHAT_OK, "bad_words": [" "]}, 400, "bad_words"),
    ("truncate_prompt_tokens = 0", "/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("truncate_prompt_tokens over max_model_len", "/v1/completions",
     {"prompt": "hi", "truncate_prompt_tokens": 600}, 400, "truncate_prompt_tokens"),
    ("truncation_side of neither side", "/v1/completions", {"prompt": "hi", "truncation_side": "middle"}, 400,
     "truncation_side"),
    ("logprob_token_ids", "/v1/completions", {"prompt": "hi", "logprob_token_ids": [1]}, 400, "logprob_token_ids"),
    ("thinking_token_budget", "/v1/chat/completions", {**CHAT_OK, "thinking_token_budget": 10}, 400,
     "thinking_token_budget"),
    ("repetition_detection", "/v1/completions", {"prompt": "hi", "repetition_detection": {"max_pattern_size": 4}},
     400, "repetition_detection"),
    ("watermarking", "/v1/completions", {"prompt": "hi", "watermarking": True}, 400, "watermarking"),
    ("vllm_xargs", "/v1/completions", {"prompt": "hi", "vllm_xargs": {"a": 1}}, 400, "vllm_xargs"),
    ("chat: return_prompt_text", "/v1/chat/completions", {**CHAT_OK, "return_prompt_text": True}, 400,
     "return_prompt_text"),
    ("chat: reasoning_effort unknown", "/v1/chat/completions", {**CHAT_OK, "reasoning_effort": "extreme"}, 400,
     "reasoning_effort"),
    ("max_tokens = 0 with echo, over max_model_len", "/v1/completions",
     {"prompt": list(range(1, 513)), "max_tokens": 0, "echo": True}, 400, "prompt"),
    ("chat: no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("chat: message without role", "/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages"),
    ("chat: image content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("chat: top_logprobs without logprobs", "/v1/chat/completions", {**CHAT_OK, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("chat: top_logprobs > 20", "/v1/chat/completions", {**CHAT_OK, "logprobs": True, "top_logprobs": 30}, 400,
     "logprobs"),
    ("chat: unknown model", "/v1/chat/completions", {**CHAT_OK, "model": "nope"}, 404, "model"),
    ("chat: over max_model_len", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "word " * 600}]}, 400, "prompt"),
    ("chat: max_tokens over max_model_len", "/v1/chat/completions", {**CHAT_OK, "max_tokens": 10_000}, 400,
     "max_tokens"),
    ("chat: max_completion_tokens over max_model_len", "/v1/chat/completions",
     {**CHAT_OK, "max_completion_tokens": 10_000}, 400, "max_completion_tokens"),
    ("chat: max_completion_tokens = 0", "/v1/chat/completions", {**CHAT_OK, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("detokenize out of vocab", "/detokenize", {"tokens": [1, 100000]}, 400, "tokens"),
    ("tokenize without prompt", "/tokenize", {"model": MODEL}, 400, "prompt"),
    ("top_k too large", "/v1/completions", {"prompt": "hi", "top_k": 2**70}, 400, "top_k"),
    ("lone surrogate in prompt", "/v1/completions", b'{"prompt": "\\ud800"}', 400, "prompt"),
    ("lone surrogate in stop", "/v1/completions", b'{"prompt": "hi", "stop": ["a\\udfff"]}', 400, "stop"),
    ("chat: lone surrogate", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     400, "messages"),
    ("unknown route", "/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request(server: ServerProcess, name: str, path: str, body: object, status: int,
                     param: str | None) -> None:
    url = f"{server.url}{path}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
    else:
        r = httpx.post(url, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["code"] == status
    if param is not None:
        assert err["param"] == param, err
    if "max_model_len" in name:
        assert "max_model_len" in err["message"]


def test_form_encoded_body_is_refused(server: ServerProcess) -> None:
    r = httpx.post(f"{server.base_url}/completions", data={"prompt": "hi"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_bad_requests_leave_the_server_whole(server: ServerProcess, client: openai.OpenAI) -> None:
    # Nothing a refused request touched stays behind in the engine (no waiting sequence).
    server.wait_blocks_free(timeout=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=HI)
    # A bad stream request is refused before the stream starts.
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": "hi", "stream": True, "top_p": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=3).choices[0].text is not None
    m = server.wait_blocks_free()
    assert m["nanovllm:kv_cache_blocks_total"] == 256


# Disconnects and metrics --------------------------------------------------------------------


def _long_request(stream: bool) -> dict[str, object]:
    return {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 450, "ignore_eos": True,
            "stream": stream}


def test_client_disconnect_mid_stream_frees_blocks(server: ServerProcess) -> None:
    before = server.metrics()
    for _ in range(2):
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{server.base_url}/completions", json=_long_request(True)) as r:
                assert r.status_code == 200
                lines = r.iter_lines()  # held, so that the connection stays open until the `with` ends
                for _ in range(6):
                    next(lines)
                assert server.metrics()["nanovllm:kv_cache_blocks_used"] > 0  # still generating
        # The connection is closed here, long before 450 tokens.
        m = server.wait_blocks_free(timeout=10)
    assert m["nanovllm:request_aborted_total"] >= before["nanovllm:request_aborted_total"] + 2
    assert m["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] < 2 * 450


def test_client_disconnect_while_waiting_for_non_stream_frees_blocks(server: ServerProcess) -> None:
    before = server.metrics()
    # The connection closes once the request is generating: a client timeout instead (0.2 s) now and
    # then outlasted the whole request (4 x 450 tokens of the tiny model).
    body = json.dumps({**_long_request(False), "n": 4}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(head + body)
        deadline = time.monotonic() + 10
        while server.metrics()["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] < 8:
            assert time.monotonic() < deadline, "the request never started generating"
            time.sleep(0.005)
    m = server.wait_blocks_free(timeout=10)
    assert m["nanovllm:request_aborted_total"] >= before["nanovllm:request_aborted_total"] + 1
    assert m["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] < 4 * 450


def test_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    long_prompt = "a shared prefix that spans several blocks " * 6
    before = server.metrics()
    for _ in range(2):  # the second one hits the prefix cache
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4, temperature=0)
    m = server.wait_blocks_free()
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("nanovllm:num_requests_running", "nanovllm:num_requests_waiting", "nanovllm:kv_cache_blocks_used",
                 "nanovllm:kv_cache_blocks_total", "nanovllm:kv_cache_usage_perc", "nanovllm:prefix_cache_hit_rate",
                 "nanovllm:num_preemptions_total", "nanovllm:prompt_tokens_total",
                 "nanovllm:generation_tokens_total", "nanovllm:time_to_first_token_seconds_bucket",
                 "nanovllm:inter_token_latency_seconds_bucket", "nanovllm:e2e_request_latency_seconds_bucket"):
        assert f"\n{name}{{" in text, name
    assert 'model_name="tiny"' in text
    assert m["nanovllm:kv_cache_blocks_total"] == 256
    assert m["nanovllm:prefix_cache_hits_total"] > before.get("nanovllm:prefix_cache_hits_total", 0)
    assert 0 < m["nanovllm:prefix_cache_hit_rate"] <= 1
    n_prompt = len(httpx.post(f"{server.url}/tokenize", json={"prompt": long_prompt}).json()["tokens"])
    assert m["nanovllm:prompt_tokens_total"] - before["nanovllm:prompt_tokens_total"] == 2 * n_prompt
    assert m["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] == 8
    assert m["nanovllm:time_to_first_token_seconds_count"] - before["nanovllm:time_to_first_token_seconds_count"] == 2
    assert m["nanovllm:inter_token_latency_seconds_count"] - before["nanovllm:inter_token_latency_seconds_count"] == 6
    assert m["nanovllm:e2e_request_latency_seconds_count"] - before["nanovllm:e2e_request_latency_seconds_count"] == 2


def test_idle_server_does_not_spin(server: ServerProcess) -> None:
    server.wait_blocks_free()
    time.sleep(0.2)
    before = server.cpu_seconds()
    time.sleep(1.0)
    assert server.cpu_seconds() - before < 0.2
