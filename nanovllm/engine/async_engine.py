"""AsyncLLMEngine: one background thread steps the LLMEngine while asyncio code adds requests.

Why a dedicated thread: `LLMEngine.step()` blocks for a whole forward pass, and the engine is not
thread-safe (an abort while a step runs would free blocks that step is writing). So exactly one
thread ever touches the engine. It applies queued adds and aborts between steps, steps while there
is work, and sleeps on its command queue when there is none (no busy spin). The event loop only
enqueues commands and receives outputs through `call_soon_threadsafe`: it never waits on the
model, and a request that arrives during a step joins the very next batch, so concurrent requests
are batched by the scheduler rather than served one after another.

Every request is added with `stream=True`, so each output carries only what is new (a delta);
callers that want the whole completion accumulate the deltas.

A request with structured output comes with its grammar compiled (`add_requests(..., grammars=)`):
the engine thread never compiles. A step that makes no progress for `step_timeout` seconds (a
hung tensor-parallel worker, say) stops the engine: a watchdog fails every request in flight with
EngineDeadError, `crashed` turns true, and the runner is told to give up its step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from nanovllm.distributed import WorkerDiedError
from nanovllm.engine.llm_engine import LLMEngine, PromptType
from nanovllm.engine.output_buffer import DEFAULT_ENTRIES_PER_REQUEST, OutputBuffer
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # (the grammar module imports xgrammar: only structured output needs it)
    from nanovllm.sample.grammar import HeldGrammar

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Too many requests are waiting for the scheduler; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or an unexpected error); no request can be served."""


class RequestFailedError(RuntimeError):
    """The step running this request raised; the engine dropped the request and kept going."""


class StreamStalledError(RuntimeError):
    """The consumer stopped taking this request's outputs (a client that does not read its
    stream); the request was aborted and its blocks freed."""


class RequestObserver(Protocol):
    """Sees every output as it is delivered (e.g. to keep metrics); called on the event loop."""

    def on_output(self, output: RequestOutput, now: float) -> None: ...

    def on_abort(self, request_id: str) -> None: ...

    def on_stall(self) -> None: ...


@dataclass
class _Add:
    """Requests admitted together: all of them between the same two steps, or none."""

    requests: list[tuple[str, PromptType, SamplingParams]]
    grammars: list[HeldGrammar | None]  # one per request, held by it once admitted
    arrival_time: float
    future: asyncio.Future[None]

    def release_grammars(self, start: int = 0) -> None:
        """The grammars of requests[start:], which were not admitted."""
        for grammar in self.grammars[start:]:
            if grammar is not None:
                grammar.release()


@dataclass
class _Abort:
    request_id: str


_STOP = object()
_Command = _Add | _Abort | object


class RequestGroup:
    """The outputs of requests added together, in the order the engine produced them.

    Iterating yields `RequestOutput` deltas until every request of the group finished. `abort()`
    (idempotent, synchronous) drops whatever is unfinished; call it in a `finally` so that a
    cancelled or abandoned consumer frees its KV blocks at once.
    """

    def __init__(self, engine: AsyncLLMEngine, request_ids: Sequence[str], outputs: OutputBuffer) -> None:
        self._engine = engine
        self.request_ids = list(request_ids)
        self._pending = set(request_ids)
        self._outputs = outputs

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._pending:
            raise StopAsyncIteration
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._pending.clear()  # the engine already dropped them
            raise item
        if item.finished:
            self._pending.discard(item.request_id)
        return item

    @property
    def finished(self) -> bool:
        return not self._pending

    def abort(self) -> None:
        if self._pending:
            self._engine.abort(list(self._pending))
            self._pending.clear()


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None,
                 observer: RequestObserver | None = None, stall_timeout: float | None = None,
                 buffer_entries_per_request: int = DEFAULT_ENTRIES_PER_REQUEST,
                 step_timeout: float | None = None) -> None:
        """`stall_timeout` (seconds) and `buffer_entries_per_request` bound what waits for a slow
        consumer: past either, its requests are aborted (see OutputBuffer). A step running longer
        than `step_timeout` seconds stops the engine (None: no limit)."""
        if step_timeout is not None and not step_timeout > 0:
            raise ValueError(f"step_timeout must be > 0, got {step_timeout}")
        self.engine = engine
        self.step_timeout = step_timeout
        self.max_queued_requests = max_queued_requests
        self.observer = observer
        self.stall_timeout = stall_timeout
        self.buffer_entries_per_request = buffer_entries_per_request
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._sinks: dict[str, OutputBuffer] = {}  # event-loop side: request id -> its group's buffer
        self._live: set[str] = set()  # engine-thread side: requests the engine holds
        self._stats = engine.stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._crashed = False
        self._step_started: float | None = None  # monotonic start of the step running now
        self._hung = False

    # Lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the engine thread; call from the event loop that will consume the outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)
        self._thread.start()
        if self.step_timeout is not None:
            threading.Thread(target=self._watch_steps, name="nanovllm-step-watchdog", daemon=True).start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)
        # A hung step never returns: waiting for the engine thread would only delay the exit.
        await asyncio.to_thread(self._thread.join, 0 if self._hung else timeout)

    @property
    def crashed(self) -> bool:
        """The engine thread stopped on an error (not a shutdown): the server should exit."""
        return self._crashed

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def stats(self) -> dict[str, int]:
        """The engine's counters as of the end of the last step (a snapshot: reading the core
        while a step runs would race with it)."""
        return self._stats

    # Requests ----------------------------------------------------------------------------

    async def add_requests(self, requests: Sequence[tuple[str, PromptType, SamplingParams]],
                           arrival_time: float | None = None,
                           grammars: Sequence[HeldGrammar | None] | None = None) -> RequestGroup:
        """Queues requests and waits until the engine admitted all of them, or none: the first
        rejection (ValueError for a bad prompt or parameter, QueueFullError) is raised. Admission
        happens between two steps, so it waits at most one step. `grammars[i]` is request i's
        compiled grammar (needed with structured output); each is held by its request, or
        released if the requests are not admitted."""
        add = _Add(list(requests), list(grammars) if grammars is not None else [None] * len(requests),
                   arrival_time if arrival_time is not None else time.time(),
                   asyncio.get_running_loop().create_future())
        try:
            if not self.is_running:
                raise EngineDeadError("the engine is not running") from self._error
            if self.max_queued_requests is not None and len(requests) > self.max_queued_requests:
                # No wait would ever make room for them: the request itself is too big (not a 503).
                raise ValueError(f"prompt holds {len(requests)} prompts, more than the {self.max_queued_requests} "
                                 "this server queues at once; send fewer per request")
            ids = [rid for rid, _, _ in requests]
            if len(add.grammars) != len(ids):
                raise ValueError(f"got {len(add.grammars)} grammars for {len(ids)} requests")
            if len(set(ids)) != len(ids) or any(rid in self._sinks for rid in ids):
                raise ValueError("request ids must be unique")
        except BaseException:
            add.release_grammars()
            raise
        outputs = OutputBuffer(ids, self.buffer_entries_per_request * len(ids))
        for rid in ids:
            self._sinks[rid] = outputs
        future = add.future
        self._commands.put(add)
        group = RequestGroup(self, ids, outputs)
        try:
            await future
        except asyncio.CancelledError:  # the caller left; if the add went through, undo it
            group.abort()
            raise
        except BaseException:  # rejected: the engine thread already took back whatever it added
            for rid in ids:
                self._sinks.pop(rid, None)
            raise
        return group

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """The output deltas of one request. Closing or cancelling the iterator aborts it."""
        group = await self.add_requests([(request_id, prompt, params)], arrival_time)
        try:
            async for out in group:
                yield out
        finally:
            group.abort()

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drops requests (unknown or finished ids are ignored); their blocks are freed before the
        next step. Call from the event loop."""
        for rid in request_ids:
            if self._sinks.pop(rid, None) is not None:
                self._commands.put(_Abort(rid))
                if self.observer is not None:
                    self.observer.on_abort(rid)

    # Event-loop side of the hand-off -------------------------------------------------------

    def _post(self, fn: object, *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]
        except RuntimeError:  # the loop closed during shutdown: nobody is left to tell
            pass

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        touched: dict[int, OutputBuffer] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # aborted by its consumer; the engine drops it before the next step
            if self.observer is not None:
                try:
                    self.observer.on_output(out, now)
                except Exception:  # metrics must never cost a request its output
                    logger.exception("request observer failed")
            sink.put(out)
            touched[id(sink)] = sink
            if out.finished:
                del self._sinks[out.request_id]
        for sink in touched.values():
            live = [rid for rid in sink.request_ids if self._sinks.get(rid) is sink]
            reason = sink.stall(self.stall_timeout) if live else None  # a finished group grows no more
            if reason is not None:
                self._stalled(sink, live, reason)

    def _stalled(self, sink: OutputBuffer, live: list[str], reason: str) -> None:
        logger.warning("aborting %s: its client stopped reading (%s)", ", ".join(live), reason)
        self.abort(live)
        sink.fail(StreamStalledError(f"the request was aborted because its client stopped reading: {reason}"))
        if self.observer is not None:
            self.observer.on_stall()

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink.put(error)
                if self.observer is not None:
                    self.observer.on_abort(rid)

    @staticmethod
    def _settle(fut: asyncio.Future[None], error: BaseException | None) -> None:
        if fut.done():  # the caller gave up waiting (cancelled)
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    # Engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine.make_device_current()  # the current CUDA device is per thread
            while self._iterate():
                pass
        except BaseException as e:  # a bug outside step(): stop serving rather than hang requests
            if self._hung:  # the watchdog gave up on this step already; this is how it ended
                logger.warning("the abandoned step ended: %s", e)
            else:
                logger.exception("engine thread crashed")
                self._error = e
                self._crashed = True
            self._abort_live(EngineDeadError(f"the engine thread crashed: {e!r}"))
        finally:
            if self._error is None:
                self._error = EngineDeadError("the engine was shut down")
            try:
                self._abort_live(EngineDeadError("the engine was shut down"))
            except Exception:
                logger.exception("could not abort the requests in flight")
            self._refuse_queued_adds(EngineDeadError("the engine was shut down"))

    def _refuse_queued_adds(self, error: BaseException, taken: Sequence[_Command] = ()) -> None:
        """Adds still queued (and those in `taken`, off the queue already) would otherwise wait
        forever."""
        commands = list(taken)
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for cmd in commands:
            if isinstance(cmd, _Add):
                cmd.release_grammars()
                self._post(self._settle, cmd.future, error)

    def _watch_steps(self) -> None:
        """Watchdog thread: a step past step_timeout stops the engine (see the module docstring)."""
        assert self.step_timeout is not None
        while self._thread is not None and self._thread.is_alive() and not self._crashed:
            time.sleep(min(1.0, self.step_timeout / 4))
            started = self._step_started
            if started is None or time.monotonic() - started <= self.step_timeout:
                continue
            reason = (f"a step made no progress for {time.monotonic() - started:.0f} s (the step timeout is "
                      f"{self.step_timeout:g} s): the engine is stopped")
            logger.error("%s", reason)
            error = EngineDeadError(reason)
            self._hung = True
            self._error = error
            self._crashed = True
            self._post(self._fail_all, error)
            self._refuse_queued_adds(error)
            try:
                self.engine.abandon_step(reason)  # e.g. unblocks a collective waiting on a hung worker
            except Exception:
                logger.exception("could not abandon the hung step")
            return

    def _fail_all(self, error: BaseException) -> None:
        """Event loop: every request still delivering gets `error` (the engine thread is stuck)."""
        self._fail(list(self._sinks), error)

    def _iterate(self) -> bool:
        """Applies the queued commands, runs one step if there is work; False once told to stop."""
        engine = self.engine
        # Sleep on the queue when idle; otherwise only take what is already there.
        block = not engine.has_unfinished_requests()
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for i, cmd in enumerate(commands):
            if cmd is _STOP or self._crashed:
                error = self._error or EngineDeadError("the engine was shut down")
                self._refuse_queued_adds(error, commands[i:])
                return False
            if isinstance(cmd, _Add):
                self._apply_add(cmd)
            elif isinstance(cmd, _Abort):
                engine.abort_request(cmd.request_id)
                self._live.discard(cmd.request_id)
        outputs: list[RequestOutput] = []
        if engine.has_unfinished_requests():
            self._step_started = time.monotonic()
            try:
                outputs = engine.step()
            except WorkerDiedError:
                raise  # the engine cannot run any more step: the thread stops, the server exits
            except Exception as e:
                # step() dropped its batch and left the engine consistent; fail everything in
                # flight (simplest sound choice: we cannot tell which requests were in the batch).
                logger.exception("engine step failed")
                self._abort_live(RequestFailedError(f"the engine step failed: {e!r}"))
            finally:
                self._step_started = None
        if self._crashed:  # the watchdog gave up on this step: its outputs go nowhere
            return False
        now = time.time()
        self._stats = engine.stats()
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        if outputs:
            self._post(self._deliver, outputs, now)
        return True

    def _apply_add(self, cmd: _Add) -> None:
        if cmd.future.cancelled():
            cmd.release_grammars()
            return  # its caller is gone (and has dropped its outputs)
        added: list[str] = []
        error: BaseException | None = None
        for i, (rid, prompt, params) in enumerate(cmd.requests):
            if self.max_queued_requests is not None and \
                    self.engine.stats()["num_waiting"] >= self.max_queued_requests:
                error = QueueFullError(f"the server is at capacity: {self.max_queued_requests} sequences are "
                                       "already waiting to be scheduled; retry later")
                cmd.release_grammars(i)
                break
            # add_request holds the grammar from here on (and releases it if it refuses).
            grammar, cmd.grammars[i] = cmd.grammars[i], None
            try:
                self.engine.add_request(rid, prompt, params, arrival_time=cmd.arrival_time, stream=True,
                                        grammar=grammar)
            except ValueError as e:
                error = e
                break
            except Exception as e:  # anything else is still only this request's problem
                logger.exception("add_request failed")
                error = ValueError(str(e))
                break
            added.append(rid)
        if error is not None:
            cmd.release_grammars()
            for rid in added:  # all or nothing
                self.engine.abort_request(rid)
        else:
            self._live.update(added)
        self._post(self._settle, cmd.future, error)

    def _abort_live(self, error: BaseException) -> None:
        rids = list(self._live)
        for rid in rids:
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort_request(%r) failed", rid)
        self._live.clear()
        self._stats = self.engine.stats()
        if rids:
            self._post(self._fail, rids, error)
