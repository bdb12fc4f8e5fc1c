"""A hostile client against a real `nanovllm serve`: huge and slow bodies, half-open sockets,
connection floods, lone surrogates, request chat templates, a client that stops reading its
stream, and SIGTERM in the middle of requests. After every probe the KV pool is whole and a
reference greedy completion is unchanged.

Timeouts are set low on these servers (1 s) so that the suite runs fast; the bounds the tests
check are generous against them.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hostile_helpers import error_of, reference, server_stays_whole  # noqa: F401 (fixtures)
from server_process import ServerProcess
from tiny_models import TINY_SPECS, make_tiny_model
from transformers import AutoTokenizer

from nanovllm.builtin_model import create_model_dir
from nanovllm.entrypoints import cli

HEADER_TIMEOUT_S = 1.0
STALL_TIMEOUT_S = 1.0
MAX_QUEUED = 4
LIMIT_CONCURRENCY = 24
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hostile_model"), "qwen3")


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess(model_dir, tmp_path_factory.mktemp("hostile"), "--num-kvcache-blocks", "2048",
                       "--max-model-len", "4096", "--header-timeout", str(HEADER_TIMEOUT_S),
                       "--timeout-keep-alive", "1", "--stream-stall-timeout", str(STALL_TIMEOUT_S),
                       "--max-queued-requests", str(MAX_QUEUED), "--limit-concurrency", str(LIMIT_CONCURRENCY)) as srv:
        yield srv


# Bodies -------------------------------------------------------------------------------------


def test_health_stays_fast_while_huge_bodies_are_refused(server: ServerProcess) -> None:
    """10 MB bodies (declared, and chunked) get a 413 before anything parses them, on every
    route that takes a body; a large prompt within the limit is tokenized off the event loop.
    /health answers within a second throughout."""
    huge = b"a" * (10 << 20)  # not even JSON: a 413 proves the body was never parsed
    words = ("lorem ipsum dolor sit amet " * 36_000)[:900_000]  # under the 1 MiB default limit
    responses: dict[str, httpx.Response] = {}

    def post(name: str, path: str, content: Any) -> None:
        responses[name] = httpx.post(f"{server.url}{path}", content=content, timeout=120,
                                     headers={"Content-Type": "application/json"})

    jobs = [("declared /tokenize", "/tokenize", huge), ("declared /detokenize", "/detokenize", huge),
            ("declared /v1/completions", "/v1/completions", huge),
            ("chunked /v1/chat/completions", "/v1/chat/completions",
             (huge[i:i + (1 << 16)] for i in range(0, len(huge), 1 << 16))),
            ("large prompt", "/tokenize", json.dumps({"prompt": words}).encode())]
    threads = [threading.Thread(target=post, args=job) for job in jobs]
    latencies = []
    with httpx.Client(timeout=10) as http:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            start = time.monotonic()
            assert http.get(f"{server.url}/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    for t in threads:
        t.join()
    assert max(latencies) < 1.0, f"/health took {max(latencies):.2f} s"
    for name, _, _ in jobs[:-1]:
        assert "--max-request-bytes" in error_of(responses[name], 413)["message"], name
    assert responses["large prompt"].status_code == 200
    assert responses["large prompt"].json()["count"] > 100_000


def test_a_body_that_stops_arriving_gets_408(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        s.settimeout(HEADER_TIMEOUT_S + 10)
        start = time.monotonic()
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 408"), head
    assert time.monotonic() - start < HEADER_TIMEOUT_S + 5


# Connections --------------------------------------------------------------------------------


def _closed_by_server(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_half_open_sockets_are_closed_by_the_server(server: ServerProcess) -> None:
    """20 sockets that never complete a request's headers (10 silent, 10 halfway through) are
    closed within the header timeout; without one they would be held for ever."""
    start = time.monotonic()
    sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
    try:
        for s in sockets[10:]:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        assert all(_closed_by_server(s, HEADER_TIMEOUT_S + 10) for s in sockets)
        assert time.monotonic() - start < HEADER_TIMEOUT_S + 8
    finally:
        for s in sockets:
            s.close()


def test_connections_past_the_limit_get_503_then_serve_again(server: ServerProcess) -> None:
    sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(LIMIT_CONCURRENCY)]
    try:
        assert "--limit-concurrency" in error_of(httpx.get(f"{server.url}/health", timeout=10), 503)["message"]
        assert all(_closed_by_server(s, HEADER_TIMEOUT_S + 10) for s in sockets)
    finally:
        for s in sockets:
            s.close()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# Bad input ----------------------------------------------------------------------------------

SURROGATE_REQUESTS: list[tuple[str, bytes, int]] = [
    ("/v1/completions", b'{"prompt": "hi", "model": "\\ud800"}', 404),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "model": "\\udfff"}', 404),
    ("/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "hi"}]}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     400),
    ("/v1/completions", b'{"prompt": ["ok", "a\\ud800b"]}', 400),
    ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"\\ud800": 1}}', 400),
    ("/tokenize", b'{"prompt": "\\ud800"}', 400),
    ("/tokenize", b'{"prompt": "hi", "model": "\\ud800"}', 404),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\udbff"}]}', 400),
    ("/detokenize", b'{"tokens": [1], "model": "\\ud800"}', 404),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400),  # not UTF-8 at all
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "user": "\\ud800"}', 200),  # ignored field
]


@pytest.mark.parametrize("path,body,status", SURROGATE_REQUESTS)
def test_lone_surrogates_and_non_utf8_get_4xx(server: ServerProcess, path: str, body: bytes, status: int) -> None:
    r = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"})
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        error_of(r, status)


@pytest.mark.parametrize("kwargs", [{"return_tensors": "np"}, {"tokenize": True}, {"return_dict": True},
                                    {"add_generation_prompt": "yes"}, {"messages": 5}, {"conversation": []},
                                    {"chat_template": "{{ 1 }}"}])
def test_chat_template_kwargs_that_break_rendering_get_400(server: ServerProcess, kwargs: dict[str, Any]) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(f"{server.url}{path}", json={"messages": HI, "max_tokens": 2, "chat_template_kwargs": kwargs})
        error_of(r, 400)
    # Template variables the template does not use are harmless.
    r = httpx.post(f"{server.base_url}/chat/completions",
                   json={"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text


def test_request_chat_templates_are_refused_by_default(server: ServerProcess) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(f"{server.url}{path}", json={"messages": HI, "chat_template": "{{ messages }}"})
        err = error_of(r, 400)
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]


def test_more_prompts_than_the_queue_holds_is_a_400(server: ServerProcess) -> None:
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": ["a"] * (MAX_QUEUED + 1), "max_tokens": 2})
    err = error_of(r, 400)
    assert err["param"] == "prompt" and str(MAX_QUEUED) in err["message"]


def test_token_ids_and_seeds_past_64_bits(server: ServerProcess) -> None:
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": [1, 2**63], "max_tokens": 2})
    assert str(2**63) in error_of(r, 400)["message"]
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [1, 2**63]})
    assert str(2**63) in error_of(r, 400)["message"]
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": "hi", "seed": 2**64})
    assert error_of(r, 400)["param"] == "seed"


# Backpressure -------------------------------------------------------------------------------


def test_a_stream_whose_client_stops_reading_is_aborted(server: ServerProcess) -> None:
    """The client reads nothing after sending its request: once the socket buffers are full
    the outputs wait unread, and after the stall timeout the request is aborted, its blocks
    freed while the connection is still open. A client that then reads gets an error event and
    [DONE] after what was already sent."""
    before = server.metrics()["nanovllm:stream_stall_aborts_total"]
    # 8 x 3,900 tokens: seconds of decode steps on any machine, so the request is still running
    # when the stall timeout fires (a finished request is never aborted).
    body = json.dumps({"messages": HI, "max_tokens": 3900, "ignore_eos": True, "n": 8, "logprobs": True,
                       "top_logprobs": 20, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while server.metrics()["nanovllm:stream_stall_aborts_total"] == before:
            assert time.monotonic() < deadline, "the stalled stream was never aborted"
            time.sleep(0.2)
        m = server.wait_blocks_free(timeout=10)
        assert m["nanovllm:generation_tokens_total"] > 0
        # Now read: the stream ends with the abort's error event, then [DONE].
        s.settimeout(30)
        received = b""
        while b"data: [DONE]" not in received:
            chunk = s.recv(1 << 20)
            assert chunk, "the connection closed before [DONE]"
            received += chunk
    finally:
        s.close()
    events = [line for line in received.decode().split("\n") if line.startswith("data: {\"error\"")]
    assert len(events) == 1 and json.loads(events[0][6:])["error"]["code"] == 408
    assert "stopped reading" in events[0]


# Startup ------------------------------------------------------------------------------------


def test_serve_refuses_a_pool_smaller_than_max_model_len(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["serve", str(model_dir), "--device", "cpu", "--num-kvcache-blocks", "8", "--max-model-len", "512"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "max_model_len=512" in err and "8 blocks of 16 tokens = 128 tokens" in err
    assert "lower max_model_len to at most 128" in err


# A second server: trusted templates, few file descriptors, and shutdown (by the last test) ---

OPEN_FILES = 128  # connection limit: the 16 it leaves (the default keeps 128 for the process)

# Long enough to outlast the shutdown timeout however fast the CPU (4,000 tokens of the tiny model
# came within it once the layers ran as one C++ call): the trusting server's model takes 32,768.
LONG = {"prompt": "Tell me everything", "max_tokens": 30000, "ignore_eos": True}


@pytest.fixture(scope="module")
def trusting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    spec = dataclasses.replace(TINY_SPECS["qwen3"], max_position_embeddings=32768)
    long_model = create_model_dir(tmp_path_factory.mktemp("long_model") / "qwen3", spec=spec)
    with ServerProcess(long_model, tmp_path_factory.mktemp("trusting"), "--num-kvcache-blocks", "4096",
                       "--max-model-len", "32768", "--trust-request-chat-template", "--chat-template-timeout", "0.5",
                       "--shutdown-timeout", "3", "--header-timeout", str(HEADER_TIMEOUT_S),
                       max_open_files=OPEN_FILES) as srv:
        yield srv


def test_trusted_request_templates_render_sandboxed_and_time_limited(trusting: ServerProcess,
                                                                    model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    plain = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    r = httpx.post(f"{trusting.url}/tokenize", json={"messages": HI, "chat_template": plain})
    assert r.status_code == 200 and r.json()["tokens"] == tokenizer.encode("[user] hi", add_special_tokens=False)
    # The sandbox refuses Python internals.
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    assert "cannot apply the chat template" in error_of(
        httpx.post(f"{trusting.url}/tokenize", json={"messages": HI, "chat_template": escape}), 400)["message"]
    # A template that would loop for hours ends at the time limit; the server keeps answering.
    endless = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    result: dict[str, httpx.Response] = {}
    start = time.monotonic()
    t = threading.Thread(target=lambda: result.update(r=httpx.post(
        f"{trusting.base_url}/chat/completions", json={"messages": HI, "chat_template": endless}, timeout=60)))
    t.start()
    while t.is_alive():
        assert httpx.get(f"{trusting.url}/health", timeout=1.0).status_code == 200
        time.sleep(0.05)
    assert "0.5 s" in error_of(result["r"], 400)["message"]
    assert time.monotonic() - start < 10
    trusting.wait_blocks_free()


def test_silent_sockets_past_the_open_file_limit_do_not_lock_clients_out(trusting: ServerProcess) -> None:
    """Under `ulimit -n 128`, 300 silent sockets exhaust the descriptors: accept() fails (logged
    once, not per attempt) until the header timeout closes them, and then valid requests are
    served again."""
    assert "at most 16 connections" in trusting.log()
    sockets = []
    try:
        for _ in range(300):
            sockets.append(socket.create_connection(("127.0.0.1", trusting.port)))
        assert all(_closed_by_server(s, 30) for s in sockets)
    finally:
        for s in sockets:
            s.close()
    r = httpx.post(f"{trusting.base_url}/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
    log = trusting.log()
    assert "out of file descriptors" in log and log.count("accept") <= 2, log[-3000:]


def test_sigterm_drains_then_ends_requests_cleanly_and_exits_0(trusting: ServerProcess) -> None:
    """On SIGTERM a short request in flight finishes; after --shutdown-timeout (3 s) a stream
    still running ends with an error event and [DONE], a non-streamed request gets a JSON 503;
    new connections are refused; the process exits 0."""
    results: dict[str, Any] = {}
    stream_started = threading.Event()

    def stream() -> None:
        events = []
        with httpx.stream("POST", f"{trusting.base_url}/completions", json={**LONG, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    stream_started.set()
        results["stream"] = events

    def post(name: str, body: dict[str, Any]) -> None:
        results[name] = httpx.post(f"{trusting.base_url}/completions", json=body, timeout=60)

    threads = [threading.Thread(target=stream), threading.Thread(target=post, args=("long", LONG))]
    for t in threads:
        t.start()
    assert stream_started.wait(60)
    short = threading.Thread(target=post, args=("short", {"prompt": "hi", "max_tokens": 5, "ignore_eos": True}))
    short.start()
    time.sleep(0.3)  # the short request is in flight
    trusting.proc.send_signal(signal.SIGTERM)
    for t in [*threads, short]:
        t.join(timeout=30)
    assert trusting.proc.wait(timeout=30) == 0, trusting.log()[-3000:]
    assert results["short"].status_code == 200
    assert results["short"].json()["usage"]["completion_tokens"] == 5
    events = results["stream"]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == 503
    assert all("error" not in json.loads(e[6:]) for e in events[:-2])
    error_of(results["long"], 503)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{trusting.url}/health", timeout=2)
