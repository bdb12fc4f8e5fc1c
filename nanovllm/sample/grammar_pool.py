"""Grammar compiles in worker processes: bounded in number, in time, and cancellable.

A schema can take minutes to compile (nesting makes xgrammar's conversion grow about cubically),
and a compile running in a thread can be neither stopped nor left behind: it holds its thread
(and a core) to the end, and interpreter exit waits for it. So the server compiles in a few
worker processes, one compile at a time each, driven by one thread each:

- a compile that runs past `timeout` seconds is a `CompileTimeout` (a ValueError: the request's
  fault, a 400), and its worker is killed;
- `GrammarJob.cancel()` (its client left) kills the worker of a running compile and drops a
  queued one;
- `close()` (shutdown) kills every worker and fails every job with `PoolClosed`.

A killed worker is replaced at its thread's next job; workers are forked from a forkserver that
has imported xgrammar already, so that takes milliseconds, not the seconds of a fresh
interpreter. A worker compiles with `compile_spec` (checks included) and sends the grammar back
serialized; the thread deserializes it (xgrammar releases the GIL there) and caches it in the
GrammarCompiler, held for the request (`insert`). Workers die with the server (PR_SET_PDEATHSIG
on the forkserver, which exits with its parent).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import xgrammar as xgr

from nanovllm.sample.grammar import GrammarCompiler, HeldGrammar, compile_spec
from nanovllm.sampling_params import StructuredOutputsParams

# Few: each compile takes a core, and they compete with the engine thread.
DEFAULT_PROCESSES = max(1, min(4, (os.cpu_count() or 2) // 2))
POLL_S = 0.02  # how often a waiting thread looks for cancellation, the deadline and shutdown


class CompileTimeout(ValueError):
    """The compile ran past the pool's time limit."""


class PoolClosed(RuntimeError):
    """The pool was closed (the server is shutting down)."""


class _Cancelled(Exception):
    pass


@dataclass(eq=False)
class GrammarJob:
    spec: StructuredOutputsParams
    future: concurrent.futures.Future[HeldGrammar] = field(default_factory=concurrent.futures.Future)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop the compile (its worker is killed) or drop it from the queue. A grammar that was
        already handed over is released."""
        self.cancelled.set()
        if not self.future.cancel() and self.future.done() and self.future.exception() is None:
            self.future.result().release()


def _worker_main(conn: Connection, info_json: str, max_threads: int) -> None:
    """One worker process: compile what comes in, until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops its workers itself
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the forkserver
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=max_threads,
                                   cache_enabled=False)
    while True:
        try:
            kind, text = conn.recv()
        except EOFError:
            return
        try:
            grammar = compile_spec(compiler, kind, text)
        except ValueError as e:  # the spec's fault
            conn.send(("invalid", str(e)))
            continue
        except Exception as e:  # noqa: BLE001  (ours: reported, and the worker goes on)
            conn.send(("failed", f"{type(e).__name__}: {e}"))
            continue
        conn.send(("ok", grammar.memory_size_bytes))
        if conn.recv():  # the pool wants it (it has room for its size)
            conn.send(grammar.serialize_json())


class _Worker:
    """One worker process and its pipe."""

    def __init__(self, context: multiprocessing.context.BaseContext, info_json: str, max_threads: int) -> None:
        self.conn, child = context.Pipe()
        self.proc: BaseProcess = context.Process(target=_worker_main, args=(child, info_json, max_threads),
                                                 name="nanovllm-grammar", daemon=True)
        self.proc.start()
        child.close()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class GrammarPool:
    def __init__(self, compiler: GrammarCompiler, timeout: float, processes: int = DEFAULT_PROCESSES) -> None:
        """Compiles for `compiler` (whose cache receives the results) in `processes` workers,
        `timeout` seconds at most each."""
        if not timeout > 0:
            raise ValueError(f"the grammar compile timeout must be > 0, got {timeout}")
        self.compiler = compiler
        self.timeout = timeout
        self._jobs: queue.SimpleQueue[GrammarJob | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._threads = [threading.Thread(target=self._run, name=f"nanovllm-grammar-{i}", daemon=True)
                         for i in range(processes)]
        self._started = False
        self._context: multiprocessing.context.BaseContext | None = None
        self._info_json = ""

    def submit(self, spec: StructuredOutputsParams) -> GrammarJob:
        """Queue the compile of `spec`; the job's future gets the held grammar, or a ValueError
        (invalid spec, CompileTimeout), GrammarCacheFull or PoolClosed."""
        job = GrammarJob(spec)
        with self._lock:
            if self._closed.is_set():
                raise PoolClosed("the server is shutting down")
            if not self._started:  # threads (and processes) only once someone compiles
                self._started = True
                for t in self._threads:
                    t.start()
        self._jobs.put(job)
        return job

    def close(self) -> None:
        """Kill every worker; fail every job, queued or running, with PoolClosed. Waits for nothing."""
        with self._lock:
            self._closed.set()
            workers, self._workers = self._workers, []
        for w in workers:
            w.kill()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(PoolClosed("the server is shutting down"))
        for _ in self._threads:  # each idle thread wakes up and leaves
            self._jobs.put(None)

    # Pool threads ---------------------------------------------------------------------------

    def _run(self) -> None:
        worker: _Worker | None = None
        while True:
            job = self._jobs.get()
            if job is None or self._closed.is_set():
                if job is not None and job.future.set_running_or_notify_cancel():
                    job.future.set_exception(PoolClosed("the server is shutting down"))
                return
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                held = self.compiler.lookup(job.spec.key)  # (another job may have compiled it meanwhile)
                if held is None:
                    # A worker that was killed (timeout, cancellation) or died is replaced.
                    worker = worker if worker is not None and worker.proc.is_alive() else self._start_worker()
                    held = self._compile(worker, job)
            except _Cancelled:  # nobody waits for it any more
                job.future.set_exception(concurrent.futures.CancelledError())
                continue
            except BaseException as e:  # noqa: BLE001  (handed to whoever waits)
                job.future.set_exception(PoolClosed("the server is shutting down") if self._closed.is_set()
                                         else e)
                continue
            job.future.set_result(held)
            if job.cancelled.is_set():  # its client left while it was handed over
                held.release()

    def _start_worker(self) -> _Worker:
        # Starting the forkserver takes seconds (it imports xgrammar): under its own lock, never
        # the one submit() takes on the event loop.
        with self._start_lock:
            if self._context is None:
                self._info_json = self.compiler.tokenizer_info.serialize_json()
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload([__name__])
                self._context = context
            worker = _Worker(self._context, self._info_json, 1)
        with self._lock:
            if not self._closed.is_set():
                self._workers.append(worker)
                return worker
        worker.kill()
        raise PoolClosed("the server is shutting down")

    def _forget(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)
        worker.kill()

    def _compile(self, worker: _Worker, job: GrammarJob) -> HeldGrammar:
        kind, text = job.spec.key
        deadline = time.monotonic() + self.timeout  # for the compile and for sending it back
        worker.conn.send((kind, text))
        status, value = self._receive(worker, job, deadline)
        if status == "invalid":
            raise ValueError(value)
        if status == "failed":
            raise RuntimeError(f"compiling structured_outputs.{kind} failed: {value}")
        try:
            self.compiler.check_fits(value)
        except ValueError:
            worker.conn.send(False)
            raise
        worker.conn.send(True)
        serialized = self._receive(worker, job, deadline)
        compiled = xgr.CompiledGrammar.deserialize_json(serialized, self.compiler.tokenizer_info)
        return self.compiler.insert(job.spec.key, compiled)

    def _receive(self, worker: _Worker, job: GrammarJob, deadline: float) -> Any:
        """The worker's next message, unless the job is cancelled, the deadline passes or the pool
        closes first (then the worker is killed)."""
        kind = job.spec.kind
        while not worker.conn.poll(POLL_S):
            if self._closed.is_set():
                raise PoolClosed("the server is shutting down")
            if job.cancelled.is_set():
                self._forget(worker)
                raise _Cancelled
            if time.monotonic() > deadline:
                self._forget(worker)
                raise CompileTimeout(f"compiling structured_outputs.{kind} took longer than {self.timeout:g} s, the "
                                     "limit this server sets (--grammar-compile-timeout); simplify it")
        try:
            return worker.conn.recv()
        except EOFError:
            code = worker.proc.exitcode
            self._forget(worker)
            raise ValueError(f"structured_outputs.{kind}: the grammar compiler failed on it (its process exited "
                             f"with code {code})") from None
