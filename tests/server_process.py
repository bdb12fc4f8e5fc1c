"""A real `nanovllm serve` process for the server tests: started on a free loopback port, waited
for on /health, stopped at teardown, its log kept for failure messages."""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir: Path, workdir: Path, *args: str, env: dict[str, str] | None = None,
                 max_open_files: int | None = None) -> None:
        """`max_open_files` caps the process's open-file limit (soft and hard, as `ulimit -n`)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        self.log_path = workdir / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "nanovllm.entrypoints.cli", "serve", str(model_dir), "--port", str(self.port),
               "--device", "cpu", "--disable-access-log", *args]
        with open(self.log_path, "w") as log:
            # cwd=workdir: `-m` puts the cwd first on sys.path, and the repository root would shadow
            # the installed package (with its compiled modules) by the bare source tree.
            limit = None if max_open_files is None else (max_open_files, max_open_files)
            self.proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(env or {})},
                                         preexec_fn=None if limit is None else
                                         lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit))
        self._wait_healthy()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        """The unlabelled-by-value samples of /metrics: `name` -> value (labels dropped; the
        histograms' _count and _sum kept)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE):
            name = m.group(1)
            if name.endswith("_bucket"):
                continue
            out[name] = out.get(name, 0.0) + float(m.group(2))
        return out

    def wait_blocks_free(self, timeout: float = 15.0) -> dict[str, float]:
        """Polls /metrics until no KV block is in use; returns the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["nanovllm:kv_cache_blocks_used"] == 0 and m["nanovllm:num_requests_running"] == 0 \
                    and m["nanovllm:num_requests_waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"KV blocks still in use after {timeout}s: {m}")
            time.sleep(0.05)

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process so far (Linux /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
