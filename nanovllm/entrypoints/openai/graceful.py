"""uvicorn's server with the shutdown an inference server needs.

On SIGTERM or SIGINT uvicorn stops accepting connections, closes the idle ones and waits for the
requests in flight. Once `drain_timeout` seconds have passed, this server stops the engine, which
ends every request still running cleanly (AsyncLLMEngine fails them with EngineDeadError): a stream
gets an error event and `[DONE]`, a non-streamed request a JSON 503; so does a request whose
grammar is still compiling (the compile is abandoned: its worker process is killed). uvicorn's own
limit, which cancels the request tasks mid-response, stays only as a backstop for writes that
cannot finish (a client that does not read).

The process then exits 0: uvicorn re-raises the signal it caught once it has shut down, so the
process would die by it even after a clean drain. When the engine itself dies (`engine_crashed()`,
e.g. a tensor-parallel worker was lost or a step hung) the server shuts down the same way and
`run_server` exits non-zero, also when the engine died while a signal's shutdown was under way;
requests meanwhile get 503.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

logger = logging.getLogger("nanovllm.server")

# How long uvicorn waits past the drain for the last responses to be written.
BACKSTOP_S = 5.0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, stop_engine: Callable[[], Awaitable[None]],
                 drain_timeout: float, engine_crashed: Callable[[], bool] = lambda: False) -> None:
        config.timeout_graceful_shutdown = int(drain_timeout + BACKSTOP_S + 0.999)
        super().__init__(config)
        self._engine_crashed = engine_crashed
        self.engine_died = False
        self._stop_engine = stop_engine
        self.drain_timeout = drain_timeout
        self._stopping: asyncio.Future[None] | None = None

    async def on_tick(self, counter: int) -> bool:
        if not self.engine_died and self._engine_crashed():
            logger.error("the engine died: shutting down")
            self.engine_died = True
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's, without recording the signal to re-raise after the shutdown.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logger.info("shutting down: %d request(s) in flight get up to %g s to finish",
                    len(self.server_state.tasks), self.drain_timeout)
        expiry = asyncio.get_running_loop().call_later(self.drain_timeout, self._expire)
        try:
            await super().shutdown(sockets)
        finally:
            expiry.cancel()

    def _expire(self) -> None:
        if self.server_state.tasks:
            logger.warning("shutdown timeout: ending %d request(s) still in flight", len(self.server_state.tasks))
        self._stopping = asyncio.ensure_future(self._stop_engine())
