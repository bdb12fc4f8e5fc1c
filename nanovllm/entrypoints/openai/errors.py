"""Every failure leaves the server as an OpenAI-style error body: `{"error": {"message", "type",
"param", "code"}}`. The handlers below map what FastAPI and the engine raise onto status codes,
so a bad request is always a 4xx (never a 500 and never a hung connection). Building an error
response never raises itself: a message quoting the client's lone surrogate ("\ud800") cannot
be encoded as UTF-8 and would otherwise turn a 4xx into a 500."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.engine.async_engine import EngineDeadError, QueueFullError, RequestFailedError
from nanovllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from nanovllm.quote import shorten

logger = logging.getLogger(__name__)

# OpenAI's client names its exceptions after these; vLLM uses the same strings.
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


# The last resort when even an error body cannot be built.
_FALLBACK_BODY = b'{"error":{"message":"internal error","type":"InternalServerError","param":null,"code":500}}'


def _printable(text: str) -> str:
    """`text` with anything UTF-8 cannot carry (lone surrogates) written as escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    kind = _ERROR_TYPES.get(status)
    if kind is None:
        try:
            kind = HTTPStatus(status).phrase.replace(" ", "") + "Error"
        except ValueError:  # a status http.HTTPStatus does not know
            kind = "Error"
    return ErrorResponse(error=ErrorInfo(message=_printable(message), type=kind,
                                         param=None if param is None else _printable(param), code=status))


def error_response(status: int, message: str, param: str | None = None,
                   headers: Mapping[str, str] | None = None) -> Response:
    try:
        return JSONResponse(error_body(status, message, param).model_dump(), status_code=status, headers=headers)
    except Exception:
        logger.exception("could not build an error response")
        return Response(_FALLBACK_BODY, status_code=500, media_type="application/json")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts = []
    param = None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        if not loc and err.get("type") in ("model_attributes_type", "dict_type", "missing"):
            return "the request body must be a JSON object (sent with Content-Type: application/json)", None
        field = shorten(".".join(loc), 80)
        param = param or (loc[0] if loc else None)
        parts.append(f"{field}: {err.get('msg')}" if field else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts[:5]), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> Response:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)  # e.g. 405's Allow

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, exc: QueueFullError) -> Response:
        return error_response(503, str(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> Response:
        return error_response(503, str(exc))

    @app.exception_handler(RequestFailedError)
    async def _failed(_: Request, exc: RequestFailedError) -> Response:
        return error_response(500, str(exc))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}")
