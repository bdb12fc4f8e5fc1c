"""Tensor parallelism end to end through the CLI (CPU, gloo, 2 ranks): `nanovllm serve
--tensor-parallel-size 2` answering the OpenAI client like one rank does, two "nodes" on
127.0.0.1 (node 0 serves, node 1 runs its worker `--headless`), what SIGTERM/SIGINT and a killed
worker leave behind (nothing), and an engine whose startup fails after its workers started."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_process import ServerProcess, free_port
from tiny_models import make_tiny_model
from tp_helpers import alive, children

from nanovllm import LLM, SamplingParams

CLI_ARGS = ["--num-kvcache-blocks", "64", "--max-model-len", "512", "--block-size", "16", "--served-model-name", "m"]
ENGINE = dict(device="cpu", num_kvcache_blocks=64, max_model_len=512, block_size=16)
PROMPTS = [[5, 17, 42, 99, 7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tp_server_model"), "qwen3")


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[str]:
    """Greedy completions of PROMPTS on one rank, in this process."""
    llm = LLM(str(model_dir), **ENGINE)  # type: ignore[arg-type]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def completions(base_url: str) -> list[str]:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    got = []
    for prompt in PROMPTS:
        r = client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        got.append(r.choices[0].text)
    return got


def shm_segments_of(pid: int) -> list[str]:
    prefix = f"nanovllm-{pid}-"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def assert_nothing_left(pid: int, workers: list[int]) -> None:
    assert not any(alive(w) for w in workers), f"workers {workers} outlived the server"
    assert shm_segments_of(pid) == [], "a step ring's segment was left in /dev/shm"


def tp_server(model_dir: Path, workdir: Path, *extra: str) -> tuple[ServerProcess, list[int]]:
    srv = ServerProcess(model_dir, workdir, *CLI_ARGS, "--tensor-parallel-size", "2", *extra)
    workers = children(srv.proc.pid)
    return srv, workers


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_tp2_answers_like_one_rank_and_a_signal_leaves_nothing(
        model_dir: Path, expected: list[str], tmp_path: Path, sig: signal.Signals) -> None:
    srv, workers = tp_server(model_dir, tmp_path)
    try:
        assert len(workers) == 1 and alive(workers[0])
        assert completions(srv.base_url) == expected
        srv.proc.send_signal(sig)
        assert srv.proc.wait(timeout=30) == 0, srv.log()[-3000:]
        assert_nothing_left(srv.proc.pid, workers)
        assert "exited with code" not in srv.log(), srv.log()[-3000:]  # no worker reported dead
    finally:
        srv.stop()


@pytest.mark.parametrize("node0_end", [signal.SIGTERM, signal.SIGKILL], ids=["node0_stops", "node0_dies"])
def test_two_nodes_on_loopback_answer_like_one_rank(model_dir: Path, expected: list[str], tmp_path: Path,
                                                    node0_end: signal.Signals) -> None:
    """Node 1 (`--headless`) runs rank 1; node 0 runs the engine and the server. The step goes
    through the broadcast channel (gloo), not the shared-memory ring. When node 0 stops, node 1
    exits 0; when node 0 dies (SIGKILL, no goodbye), node 1 fails within seconds, not at some
    timeout, and leaves no worker."""
    nodes = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(free_port())]
    log_path = tmp_path / "node1.log"
    with open(log_path, "w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "nanovllm.entrypoints.cli", "serve", str(model_dir),
                                  "--device", "cpu", *CLI_ARGS, *nodes, "--node-rank", "1", "--headless"],
                                 cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    srv = None
    try:
        srv = ServerProcess(model_dir, tmp_path, *CLI_ARGS, *nodes, "--node-rank", "0")
        assert children(srv.proc.pid) == []  # node 0 runs only rank 0
        [worker] = children(node1.pid)
        assert completions(srv.base_url) == expected
        srv.proc.send_signal(node0_end)
        if node0_end == signal.SIGTERM:
            assert srv.proc.wait(timeout=30) == 0, srv.log()[-3000:]
            assert node1.wait(timeout=30) == 0, log_path.read_text()[-3000:]
            assert "error" not in log_path.read_text().lower(), log_path.read_text()[-3000:]
        else:
            srv.proc.wait(timeout=30)
            assert node1.wait(timeout=30) != 0, log_path.read_text()[-3000:]
        assert not alive(worker)
    finally:
        if srv is not None:
            srv.stop()
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def start_long_request(srv: ServerProcess) -> tuple[threading.Thread, dict[str, httpx.Response]]:
    """A request that runs for many steps, started in a thread; returns once it is running.
    The response lands in the dict under "r"."""
    result: dict[str, httpx.Response] = {}

    def long_request() -> None:
        result["r"] = httpx.post(f"{srv.base_url}/completions", timeout=60,
                                 json={"prompt": PROMPTS[0], "max_tokens": 500, "ignore_eos": True})

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while srv.metrics()["nanovllm:num_requests_running"] < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    return t, result


def test_a_worker_killed_under_the_server_gives_503_and_a_nonzero_exit(model_dir: Path, tmp_path: Path) -> None:
    srv, [worker] = tp_server(model_dir, tmp_path)
    try:
        t, result = start_long_request(srv)
        os.kill(worker, signal.SIGKILL)
        t.join(timeout=30)
        r = result["r"]
        assert r.status_code == 503, r.text
        assert "worker rank 1" in r.text or "engine" in r.text, r.text
        assert srv.proc.wait(timeout=30) != 0, srv.log()[-3000:]
        assert "worker rank 1" in srv.log() and "exited with code -9" in srv.log(), srv.log()[-3000:]
        assert_nothing_left(srv.proc.pid, [worker])
    finally:
        srv.stop()


STEP_TIMEOUT_S = 2.0


def test_a_hung_worker_fails_the_step_after_the_step_timeout(model_dir: Path, tmp_path: Path) -> None:
    """A worker that stops (SIGSTOP) without dying: the step waiting for it makes no progress.
    After --step-timeout the request in flight gets a 503, /health stops answering 200, and the
    server exits non-zero on its own, leaving no worker behind."""
    srv, [worker] = tp_server(model_dir, tmp_path, "--step-timeout", str(STEP_TIMEOUT_S))
    try:
        t, result = start_long_request(srv)
        os.kill(worker, signal.SIGSTOP)
        stopped = time.monotonic()
        t.join(timeout=30)
        r = result["r"]
        assert r.status_code == 503 and "no progress" in r.text, r.text
        assert time.monotonic() - stopped < STEP_TIMEOUT_S + 8
        try:
            assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already gone
        assert srv.proc.wait(timeout=30) != 0, srv.log()[-3000:]
        assert time.monotonic() - stopped < STEP_TIMEOUT_S + 30
        assert_nothing_left(srv.proc.pid, [worker])
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)
        srv.stop()


def test_a_startup_failure_after_the_workers_started_stops_them_at_once(model_dir: Path) -> None:
    """The KV-pool check (a pool smaller than max_model_len) fails after the workers loaded their
    shards and agreed on the pool: they are stopped before the constructor raises, not when the
    half-built engine is collected."""
    gc.disable()  # nothing may depend on a collection
    try:
        before = set(children(os.getpid()))
        with pytest.raises(ValueError, match="the KV cache holds 4 blocks"):
            LLM(str(model_dir), tensor_parallel_size=2, **{**ENGINE, "num_kvcache_blocks": 4})  # type: ignore[arg-type]
        assert set(children(os.getpid())) - before == set(), "a worker outlived the failed constructor"
        assert shm_segments_of(os.getpid()) == []
    finally:
        gc.enable()
