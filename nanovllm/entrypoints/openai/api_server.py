"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLMEngine, run by uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (all /v1 routes need
`Authorization: Bearer <key>` when an API key is set), GET /health (and GET or POST /ping, its
vLLM alias), GET /version, GET /metrics (Prometheus), POST /tokenize, POST /detokenize.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from nanovllm.engine.async_engine import AsyncLLMEngine
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.entrypoints.openai.connection_guards import (
    BodyLimitMiddleware,
    default_limit_concurrency,
    default_max_request_bytes,
    guarded_protocol,
    quiet_accept_errors,
    raise_fd_limit,
)
from nanovllm.entrypoints.openai.errors import error_response, install_error_handlers
from nanovllm.entrypoints.openai.graceful import GracefulServer
from nanovllm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from nanovllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from nanovllm.entrypoints.openai.serving_base import ServingContext
from nanovllm.entrypoints.openai.serving_chat import ChatServing
from nanovllm.entrypoints.openai.serving_completion import CompletionServing
from nanovllm.entrypoints.openai.serving_tokenize import TokenizeServing
from nanovllm.entrypoints.openai.text_workers import TextWorkers
from nanovllm.sample.grammar_pool import GrammarPool

logger = logging.getLogger("nanovllm.server")

VERSION = "0.1.0"


@dataclass
class ServerConfig:
    model_path: str
    served_model_names: list[str] = field(default_factory=list)  # default: [model_path]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | Sequence[str] | None = None  # any of them (vLLM's --api-key takes several)
    max_queued_requests: int = 1024
    log_level: str = "info"
    access_log: bool = True
    max_request_bytes: int | None = None  # default: default_max_request_bytes(max_model_len)
    trust_request_chat_template: bool = False
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens, as vLLM's flag
    chat_template_timeout: float = 5.0  # seconds a chat template may render
    limit_concurrency: int | None = None  # connections + requests; default: from the open-file limit
    timeout_keep_alive: float = 5.0  # an idle keep-alive connection is closed after this
    header_timeout: float = 10.0  # for a request's headers, and for each piece of its body
    shutdown_timeout: float = 30.0  # requests in flight get this long to finish on SIGTERM
    stream_stall_timeout: float = 60.0  # a stream whose client reads nothing for this long is aborted
    grammar_compile_timeout: float = 30.0  # a structured-output grammar that compiles longer is a 400
    step_timeout: float = 300.0  # a step that makes no progress for this long stops the engine

    def __post_init__(self) -> None:
        for name in ("chat_template_timeout", "timeout_keep_alive", "header_timeout", "stream_stall_timeout",
                     "grammar_compile_timeout", "step_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        for name in ("max_queued_requests", "max_request_bytes", "limit_concurrency"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every /v1 route (plain ASGI, so that streaming
    responses and disconnect detection pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str | Sequence[str]) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        self._expected = [f"Bearer {key}".encode() for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope.get("method") != "OPTIONS":
            given = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
            # Every key compared (no early exit): the time taken says nothing about which matched.
            if not sum(hmac.compare_digest(given, expected) for expected in self._expected):
                response = error_response(401, "Unauthorized: a valid `Authorization: Bearer <api key>` header "
                                               "is required")
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    names = config.served_model_names or [config.model_path]
    async_engine = AsyncLLMEngine(engine, max_queued_requests=config.max_queued_requests,
                                  stall_timeout=config.stream_stall_timeout, step_timeout=config.step_timeout)
    metrics = ServerMetrics(async_engine.stats, names[0])
    async_engine.observer = metrics
    workers = TextWorkers()
    grammar_pool = GrammarPool(engine.grammars, config.grammar_compile_timeout)
    ctx = ServingContext(engine=async_engine, tokenizer=engine.tokenizer, model_names=names,
                         model_path=config.model_path, max_model_len=engine.max_model_len, workers=workers,
                         grammar_pool=grammar_pool, trust_request_chat_template=config.trust_request_chat_template,
                         render_timeout=config.chat_template_timeout, sampling_defaults=engine.sampling_defaults,
                         max_tokens_cap=engine.max_tokens_cap,
                         prompt_tokens_details=config.enable_prompt_tokens_details)
    max_request_bytes = config.max_request_bytes or default_max_request_bytes(engine.max_model_len)
    completions = CompletionServing(ctx)
    chat = ChatServing(ctx)
    tokenize = TokenizeServing(ctx, engine.vocab_size)

    async def stop() -> None:
        """Ends what is in flight: compiles (their requests get 503) and the engine's requests."""
        grammar_pool.close()
        await async_engine.shutdown()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        quiet_accept_errors(asyncio.get_running_loop())
        async_engine.start()
        s = engine.stats()
        logger.info("serving %s as %s on http://%s:%d (KV cache: %d blocks of %d tokens = %d tokens; "
                    "max_model_len %d; device %s; at most %d queued requests%s)",
                    config.model_path, ", ".join(names), config.host, config.port, s["num_total_blocks"],
                    s["block_size"], s["num_total_blocks"] * s["block_size"], s["max_model_len"], engine.device,
                    config.max_queued_requests, "; API key required on /v1" if config.api_key else "")
        logger.info("request bodies up to %d bytes; request chat templates %s", max_request_bytes,
                    "trusted" if config.trust_request_chat_template else "refused")
        try:
            yield
        finally:
            await stop()
            workers.shutdown()

    app = FastAPI(title="nanovllm OpenAI-compatible server", version=VERSION, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    # Added last is outermost: the API key is checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes, read_timeout=config.header_timeout)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.stop = stop

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) name for the same check
    async def health() -> Response:
        if not async_engine.is_running:
            return error_response(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return tokenize.models()

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create(body, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize.tokenize(body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenize.detokenize(body)

    return app


def run_server(engine: LLMEngine, config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT (exit status 0) or until the engine dies (1; also when it died
    during a shutdown)."""
    app = build_app(engine, config)
    fd_limit = raise_fd_limit()
    limit_concurrency = config.limit_concurrency or default_limit_concurrency(fd_limit)
    logger.info("at most %d connections and requests at once (open-file limit %d)", limit_concurrency, fd_limit)
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                        access_log=config.access_log, http=guarded_protocol(config.header_timeout, limit_concurrency),
                        timeout_keep_alive=config.timeout_keep_alive)  # type: ignore[arg-type]
    async_engine = app.state.async_engine
    server = GracefulServer(uv, app.state.stop, config.shutdown_timeout, lambda: async_engine.crashed)
    server.run()
    return 1 if server.engine_died or async_engine.crashed else 0
