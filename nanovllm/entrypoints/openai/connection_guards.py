"""What keeps clients from exhausting the server below the routes: the request body limit, the
read timeouts of a connection, the file-descriptor limit and the accept() error log."""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Sized
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanovllm.entrypoints.openai.errors import error_response

logger = logging.getLogger("nanovllm.server")

# A request body may hold this many bytes per token of max_model_len (JSON token ids take up to
# ~8 bytes each, text ~4 on average but much more for escaped non-ASCII), and never less than 1 MiB.
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 1 << 20
# File descriptors kept for the process itself (model files, pipes, threads, logs) when the
# connection limit is derived from the descriptor limit.
FD_RESERVE = 128
MAX_DEFAULT_CONCURRENCY = 8192


def default_max_request_bytes(max_model_len: int) -> int:
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


class BodyLimitMiddleware:
    """Answers 413 before a body over `max_bytes` is parsed: at once when Content-Length says so
    (the body is never read; uvicorn discards it), else as soon as the chunks received pass the
    limit. The body must also keep arriving: a wait over `read_timeout` for the next piece is a
    408. A body within bounds is handed on whole."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except asyncio.TimeoutError:
                await error_response(408, f"the request body did not arrive within {self.read_timeout:g} s "
                                          "of its previous part")(scope, receive, send)
                return
            if message["type"] != "http.request":  # the client left: let the app see it
                pending: list[Message] = [message]
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
                break

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(413, f"the request body is larger than this server's limit of {self.max_bytes} "
                                  "bytes (--max-request-bytes)")(scope, receive, send)


def guarded_protocol(header_timeout: float, limit_concurrency: int) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with two changes.

    A connection that has not sent a request's complete headers within `header_timeout` seconds
    of connecting or of its previous response is closed (uvicorn has no such limit: a socket that
    never finishes its headers would be held for ever).

    Past `limit_concurrency` open connections or running requests, a request gets a JSON 503 in
    the OpenAI error shape (uvicorn's own limit answers in plain text, logging a line each time).
    """

    class GuardedProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.limit_concurrency = None  # uvicorn's check, replaced by the app wrapper
            self.app = _concurrency_limited(self.app, self.connections, self.tasks, limit_concurrency)

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            waiting_on = self.cycle  # a new request replaces the cycle
            self._header_timer = self.loop.call_later(header_timeout, self._header_timeout, waiting_on)

        def _header_timeout(self, waiting_on: Any) -> None:
            self._header_timer = None
            idle = self.cycle is waiting_on and (self.cycle is None or self.cycle.response_complete)
            if idle and not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol


def _concurrency_limited(app: ASGIApp, connections: Sized, tasks: Sized, limit: int) -> ASGIApp:
    async def limited(scope: Scope, receive: Receive, send: Send) -> None:
        # This request's own connection and task are already counted.
        if len(connections) > limit or len(tasks) > limit:
            response = error_response(503, f"the server is at its limit of {limit} connections or requests "
                                           "at once (--limit-concurrency); retry later")
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        await app(scope, receive, send)

    return limited


def raise_fd_limit() -> int:
    """Raises the soft limit on open files to the hard limit (each connection holds one);
    returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The kernel refuses an unlimited soft limit for open files.
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft if soft != resource.RLIM_INFINITY else target


def default_limit_concurrency(fd_limit: int) -> int:
    return max(16, min(MAX_DEFAULT_CONCURRENCY, fd_limit - FD_RESERVE))


_ACCEPT_FAILED = "socket.accept() out of system resource"
ACCEPT_REPORT_INTERVAL_S = 60.0


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio logs, with a traceback, every accept() that fails for want of file descriptors;
    under a connection flood that is a log line per attempt. Count them instead, and report the
    count at most once a minute."""
    failures = 0
    last_report = -ACCEPT_REPORT_INTERVAL_S
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        nonlocal failures, last_report
        if context.get("message") != _ACCEPT_FAILED:
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        failures += 1
        now = time.monotonic()
        if now - last_report >= ACCEPT_REPORT_INTERVAL_S:
            logger.warning("could not accept %d connection(s): out of file descriptors (%s); raise the "
                           "open-file limit (ulimit -n). Further failures are reported once a minute",
                           failures, context.get("exception"))
            failures, last_report = 0, now

    loop.set_exception_handler(handler)
