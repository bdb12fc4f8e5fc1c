"""Starting, watching and stopping the worker processes of one node.

Workers are separate interpreters (`python -m nanovllm.worker`), not multiprocessing
children: nothing of the caller's `__main__` is re-imported, and a worker's whole input is its
WorkerSpec. A watcher thread per worker waits for its exit; one that exits while the engine runs
is recorded (and `on_death` called), so the engine can fail the step at once instead of waiting
for a collective to time out.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import nanovllm

from nanovllm.config import EngineConfig
from nanovllm.distributed import WorkerDiedError
from nanovllm.distributed.parallel_state import ParallelConfig
from nanovllm.worker.worker import WorkerSpec

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
PACKAGE_ROOT = str(Path(nanovllm.__file__).resolve().parent.parent)


class WorkerProcesses:
    def __init__(self, config: EngineConfig, parallel: ParallelConfig, ranks: range,
                 on_death: Callable[[], None] = lambda: None) -> None:
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._stopping = False
        self._stop_sent = False  # a clean exit (0) is then expected, not a death
        self._dead: str | None = None
        self._on_death = on_death
        self._lock = threading.Lock()
        config = replace(config, model=str(Path(config.model).resolve()))  # the workers run elsewhere
        try:
            for rank in ranks:
                spec = WorkerSpec(config, parallel, rank, os.getpid())
                # Run from the directory this nanovllm was imported from: `-m` puts the working
                # directory first on sys.path, so the worker imports the very same package (not,
                # say, a source tree that happens to be the caller's working directory).
                self._procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "nanovllm.worker", spec.to_json()], stdin=subprocess.DEVNULL,
                    cwd=PACKAGE_ROOT)
        except BaseException:
            self.stop()
            raise
        for rank, proc in self._procs.items():
            threading.Thread(target=self._watch, args=(rank, proc), name=f"nanovllm-tp-watch-{rank}",
                             daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        with self._lock:
            if self._stopping or self._dead is not None or (self._stop_sent and code == 0):
                return
            self._dead = f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}"
        logger.error("%s", self._dead)
        self._on_death()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values()]

    def check(self) -> None:
        """Raise WorkerDiedError if a worker has exited."""
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        for rank, proc in self._procs.items():
            code = proc.poll()
            if code is not None and not self._stopping:
                raise WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}")

    def wait(self) -> int:
        """Wait for every worker (a headless node); the first non-zero exit code, else 0."""
        codes = [p.wait() for p in self._procs.values()]
        return next((c for c in codes if c), 0)

    def expect_exit(self) -> None:
        """The workers were told to stop (or, headless, end when the engine does): an exit with
        code 0 is no longer a death."""
        self._stop_sent = True

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Wait up to `timeout` for the workers to leave (after STOP), then kill what is left."""
        with self._lock:
            self._stopping = True
        for proc in self._procs.values():
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
