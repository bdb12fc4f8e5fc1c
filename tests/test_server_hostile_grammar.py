"""A hostile client against structured output and fan-out in `nanovllm serve` (issue 26): schemas
that take seconds to minutes to compile, clients that leave while they compile, schema keywords
the grammar cannot enforce, schemas and grammars nothing satisfies, strings that are not JSON
text, n > 1 past max_num_seqs, fields that must not be ignored, SIGTERM during a compile.

After every probe of the shared server the KV pool is whole and a reference greedy completion is
unchanged. Every wait is bounded; the slow schemas take far longer to compile than the bounds the
tests check (seconds), so a compile that is waited for instead of cancelled fails the test.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from hostile_helpers import error_of, reference, server_stays_whole  # noqa: F401 (fixtures)
from server_process import ServerProcess
from tiny_models import make_tiny_model
from transformers import AutoTokenizer

COMPILE_TIMEOUT_S = 4.0
MAX_NUM_SEQS = 8
HI = [{"role": "user", "content": "hi"}]


def nested_arrays(depth: int) -> dict[str, Any]:
    """A schema whose compile time grows about with depth**3: depth 600 takes ~20 s on a 2-core
    machine, depth 400 ~5 s."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


SLOW = {"prompt": "x", "max_tokens": 4, "structured_outputs": {"json": nested_arrays(600)}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hostile_grammar_model"), "qwen3")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess(model_dir, tmp_path_factory.mktemp("hostile_grammar"), "--num-kvcache-blocks", "1024",
                       "--max-model-len", "512", "--max-num-seqs", str(MAX_NUM_SEQS),
                       "--grammar-compile-timeout", str(COMPILE_TIMEOUT_S)) as srv:
        yield srv


def _post(srv: ServerProcess, path: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, timeout=timeout)


# 1: compiles run in their own pool, under a time limit, and end when their client leaves --------


def test_slow_compiles_never_hold_up_text_prompts_and_end_with_their_clients(server: ServerProcess) -> None:
    """Four clients send a schema that takes ~20 s to compile and give up after 2 s. Meanwhile a
    plain prompt is tokenized and answered at once; once they left, their compiles are gone, so
    a small grammar compiles at once too."""
    # The compile workers' first start (seconds of imports) is not what this measures.
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                             "structured_outputs": {"regex": "[0-9]"}}).status_code == 200
    left: list[BaseException] = []

    def impatient() -> None:
        try:
            _post(server, "/v1/completions", SLOW, timeout=2)
        except httpx.TimeoutException as e:
            left.append(e)

    clients = [threading.Thread(target=impatient) for _ in range(4)]
    for t in clients:
        t.start()
    time.sleep(0.5)
    start = time.monotonic()
    r = _post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < 3.0, f"a plain prompt took {time.monotonic() - start:.1f} s"
    for t in clients:
        t.join(timeout=30)
    assert len(left) == 4
    start = time.monotonic()
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "structured_outputs": {"choice": ["a", "b"]}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("a", "b"), r.text
    assert time.monotonic() - start < 5.0, f"a small grammar waited {time.monotonic() - start:.1f} s"


def test_a_compile_past_the_time_limit_is_a_400_naming_it(server: ServerProcess) -> None:
    start = time.monotonic()
    err = error_of(_post(server, "/v1/completions", SLOW), 400)
    assert time.monotonic() - start < COMPILE_TIMEOUT_S + 6
    assert "--grammar-compile-timeout" in err["message"] and f"{COMPILE_TIMEOUT_S:g} s" in err["message"]
    assert len(err["message"]) < 500


# 3: n > 1 within max_num_seqs ------------------------------------------------------------------


def test_fan_out_stays_within_max_num_seqs(server: ServerProcess) -> None:
    """4 prompts x n=8 on a server running at most 8 sequences: all 32 samples come back, and
    the engine never runs more than 8 at once (the prompts are admitted as room frees up)."""
    running: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            running.append(server.metrics()["nanovllm:num_requests_running"])
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = _post(server, "/v1/completions", {"prompt": ["a", "b", "c", "d"], "n": 8, "max_tokens": 40,
                                              "ignore_eos": True, "temperature": 1.0})
    finally:
        done.set()
        watcher.join()
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(32))
    assert all(c["finish_reason"] == "length" for c in choices)
    assert max(running) <= MAX_NUM_SEQS, max(running)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "n": 2 * MAX_NUM_SEQS, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": HI, "n": MAX_NUM_SEQS + 1, "max_tokens": 2}),
])
def test_n_past_max_num_seqs_is_a_400_that_says_so(server: ServerProcess, path: str, body: dict[str, Any]) -> None:
    err = error_of(_post(server, path, body), 400)
    assert err["param"] == "n" and "max_num_seqs" in err["message"] and str(MAX_NUM_SEQS) in err["message"]


# 4 and 9: what the grammar cannot enforce, and what nothing satisfies, is a 400 naming it ------

UNENFORCEABLE = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "contains"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"properties": {"a": {"const": 1}}},
      "then": {"required": ["b"]}}, "if"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"],
      "additionalProperties": False}, "required"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
    ({"anyOf": []}, "anyOf"),
    ({"type": "string", "minLength": 3, "pattern": "^a$"}, "minLength"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}, "anyOf"),
    ({"type": "string", "format": "idn-email"}, "format"),
    ({"type": "string", "enum": [1]}, "enum"),
    ({"$ref": "http://example.com/schema.json"}, "$ref"),
]


@pytest.mark.parametrize("schema, keyword", UNENFORCEABLE, ids=[k for _, k in UNENFORCEABLE])
def test_schema_keywords_the_grammar_cannot_enforce_are_400(server: ServerProcess, schema: dict[str, Any],
                                                           keyword: str) -> None:
    for path, body in (("/v1/completions", {"prompt": "x", "structured_outputs": {"json": schema}}),
                       ("/v1/chat/completions", {"messages": HI, "response_format": {
                           "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})):
        err = error_of(_post(server, path, {**body, "max_tokens": 8}), 400)
        assert keyword in err["message"], err["message"]


@pytest.mark.parametrize("spec", [{"grammar": "root ::= root"}, {"regex": r"[^\s\S]"}], ids=["grammar", "regex"])
def test_a_grammar_that_matches_nothing_is_a_400(server: ServerProcess, spec: dict[str, str]) -> None:
    err = error_of(_post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "structured_outputs": spec}), 400)
    assert "matches nothing" in err["message"], err["message"]


# 5: constrained strings are text -------------------------------------------------------------


def test_length_bounded_strings_are_json_text_counted_in_characters(server: ServerProcess) -> None:
    schema = {"type": "string", "maxLength": 8}
    texts = []
    for seed in range(8):
        r = _post(server, "/v1/completions", {"prompt": ["a", "b"], "n": 4, "max_tokens": 40, "temperature": 1.5,
                                              "seed": seed, "structured_outputs": {"json": schema}})
        assert r.status_code == 200, r.text
        texts += [c["text"] for c in r.json()["choices"] if c["finish_reason"] == "stop"]
    assert len(texts) >= 32
    for text in texts:
        value = json.loads(text)  # raw control characters would make this fail
        assert "\ufffd" not in value, text
        jsonschema.validate(value, schema)


# 7: fields are honoured or refused, never ignored --------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}),
    ("/v1/completions", {"guided_json": PERSON}),
    ("/v1/chat/completions", {"guided_json": json.dumps(PERSON)}),
], ids=["completions-response_format", "completions-guided_json", "chat-guided_json"])
def test_json_constraints_on_every_route(server: ServerProcess, path: str, extra: dict[str, Any]) -> None:
    body: dict[str, Any] = {"prompt": "x"} if path == "/v1/completions" else {"messages": HI}
    r = _post(server, path, {**body, **extra, "n": 3, "max_tokens": 60, "temperature": 1.0, "seed": 1})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        text = c["text"] if "text" in c else c["message"]["content"]
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("extra, ok", [
    ({"guided_regex": "[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_grammar": 'root ::= "ab" | "cd"'}, lambda t: t in ("ab", "cd")),
], ids=["guided_regex", "guided_choice", "guided_grammar"])
def test_guided_aliases(server: ServerProcess, extra: dict[str, Any], ok: Any) -> None:
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": HI})):
        r = _post(server, path, {**body, **extra, "n": 2, "max_tokens": 20, "temperature": 1.0})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            text = c["text"] if "text" in c else c["message"]["content"]
            assert ok(text) and c["finish_reason"] == "stop", c


def test_two_constraints_at_once_are_a_400(server: ServerProcess) -> None:
    err = error_of(_post(server, "/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}), 400)
    assert "guided_regex" in err["message"] and "guided_choice" in err["message"]


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("extra, field", [
    ({"tools": [TOOL], "tool_choice": "required"}, "tools"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"tools": [TOOL]}, "tools"),
    ({"functions": [TOOL["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
    ({"echo": True}, "echo"),
], ids=["tool_choice-required", "tool_choice-named", "tools", "functions", "function_call", "audio", "echo"])
def test_chat_fields_we_do_not_support_are_400_naming_them(server: ServerProcess, extra: dict[str, Any],
                                                          field: str) -> None:
    err = error_of(_post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, **extra}), 400)
    assert err["param"] == field and field in err["message"], err


def test_prompt_logprobs_on_completions(server: ServerProcess, model_dir: Path) -> None:
    prompt = [5, 17, 42, 99]
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for token, entry in zip(prompt[1:], entries[1:]):
        assert str(token) in entry and len(entry) >= 2
        assert all(v["logprob"] <= 0 and "rank" in v and "decoded_token" in v for v in entry.values())


# 9: stop_reason, logit_bias keys, short errors -----------------------------------------------


def test_eos_has_stop_reason_null_and_a_stop_id_its_id(server: ServerProcess, model_dir: Path) -> None:
    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "logit_bias": {str(eos): 100}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None, choice
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "logit_bias": {"7": 100},
                                          "stop_token_ids": [7]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == 7, choice


@pytest.mark.parametrize("key", ["1_0", " 10", "+10", "10.0", "0x0a", "\u0661\u0660", "9" * 5000],
                         ids=["underscore", "space", "plus", "float", "hex", "arabic-digits", "5000-digits"])
def test_logit_bias_keys_must_be_plain_decimal_token_ids(server: ServerProcess, key: str) -> None:
    err = error_of(_post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {key: 1}}), 400)
    assert err["param"] == "logit_bias" and len(err["message"]) < 300, err


@pytest.mark.parametrize("body", [
    {"prompt": "x", "logit_bias": {"k" * 100_000: 1}},
    {"prompt": "x", "model": "m" * 100_000},
    {"prompt": "x", "structured_outputs": {"regex": "(" * 100_000}},
    {"prompt": "x", "structured_outputs": {"grammar": "root ::= " + "x" * 100_000}},
    {"prompt": "x", "structured_outputs": {"json": {"type": "t" * 100_000}}},
    {"prompt": "x", "structured_outputs": {"choice": ["a", 5, "b" * 100_000]}},
    {"prompt": "x", "stop": ["\ud800" + "s" * 100_000]},
], ids=["logit_bias", "model", "regex", "grammar", "json", "choice", "stop"])
def test_errors_quote_only_a_short_prefix_of_bad_input(server: ServerProcess, body: dict[str, Any]) -> None:
    r = httpx.post(f"{server.base_url}/completions", content=json.dumps({**body, "max_tokens": 2}),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500, r.text[:500]
    assert len(r.json()["error"]["message"]) < 1000, r.text[:2000]


# 6: shutdown during a compile ------------------------------------------------------------------

SHUTDOWN_TIMEOUT_S = 2.0


def test_sigterm_during_a_compile_gives_a_json_503_and_exits_in_time(model_dir: Path, tmp_path: Path) -> None:
    srv = ServerProcess(model_dir, tmp_path, "--num-kvcache-blocks", "256", "--max-model-len", "512",
                        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    result: dict[str, httpx.Response] = {}
    try:
        t = threading.Thread(target=lambda: result.update(r=_post(srv, "/v1/completions", SLOW, timeout=120)))
        t.start()
        time.sleep(1.0)  # the compile is under way
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 10)
        elapsed = time.monotonic() - start
        t.join(timeout=10)
        assert code == 0, srv.log()[-3000:]
        assert elapsed < SHUTDOWN_TIMEOUT_S + 6, f"exited {elapsed:.1f} s after SIGTERM"
        error_of(result["r"], 503)
    finally:
        srv.stop()
