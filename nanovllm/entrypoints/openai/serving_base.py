"""What the completion, chat and tokenizer endpoints share: the served model, request checks,
prompt rendering, admission into the engine, and how a response outlives (or not) its client."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import weakref
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from nanovllm.chat_inputs import joined_text, template_conversation
from nanovllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestFailedError,
    RequestGroup,
    StreamStalledError,
)
from nanovllm.engine.llm_engine import PromptType, valid_text
from nanovllm.entrypoints.openai.errors import OpenAIError, error_body
from nanovllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIBaseModel,
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
)
from nanovllm.entrypoints.openai.text_workers import RenderTimeoutError, TextWorkers, run_with_deadline
from nanovllm.outputs import CompletionOutput, Logprob
from nanovllm.quote import quote, shorten
from nanovllm.sample.grammar import GrammarCacheFull, HeldGrammar
from nanovllm.sample.grammar_pool import GrammarPool, PoolClosed
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams, truncated_prompt

logger = logging.getLogger(__name__)

T = TypeVar("T")

# JSON has no -inf: a token the model rules out entirely is reported with this logprob (as vLLM).
MIN_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def sse(payload: BaseModel | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"

# What can still go wrong once a stream has started: reported as an error event, then [DONE].
STREAM_ERRORS = (RequestFailedError, EngineDeadError, StreamStalledError)


def stream_error(error: BaseException) -> str:
    status = 503 if isinstance(error, EngineDeadError) else 408 if isinstance(error, StreamStalledError) else 500
    return sse(error_body(status, str(error)))


# apply_chat_template's own options: chat_template_kwargs must not set them (`return_tensors: "np"`
# would change what it returns, `chat_template` would run the client's template).
_RESERVED_TEMPLATE_KWARGS = frozenset(
    name for name, p in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.items()
    if p.kind is not inspect.Parameter.VAR_KEYWORD) - {"self"}


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # None when the client sent token ids (or a conversation)

    def for_engine(self) -> PromptType:
        # The engine gets token ids only: the tokenizer is only used by the server's text workers,
        # never from the engine thread.
        return {"prompt_token_ids": self.token_ids, "prompt": self.text}


@dataclass
class ServingContext:
    engine: AsyncLLMEngine
    tokenizer: PreTrainedTokenizerBase
    model_names: list[str]  # the first is the name responses report
    model_path: str
    max_model_len: int
    workers: TextWorkers
    grammar_pool: GrammarPool
    render_timeout: float  # seconds a chat template may take to render
    trust_request_chat_template: bool = False
    # What a request that leaves a sampling field out gets (the engine's generation config), and
    # the most tokens any request gets (its max_new_tokens where vLLM makes it a server-wide limit).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    max_tokens_cap: int | None = None
    prompt_tokens_details: bool = False  # usage reports the prompt tokens the prefix cache held

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
        details = (PromptTokensDetails(cached_tokens=cached_tokens)
                   if self.prompt_tokens_details and cached_tokens is not None else None)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name and name not in self.model_names:  # None or "": the served model, as vLLM
            raise OpenAIError(404, f"The model {quote(name)} does not exist; this server serves "
                                   f"{', '.join(repr(n) for n in self.model_names)}.", param="model")

    def check_refused(self, request: SamplingRequest) -> None:
        refused = request.refused_field()
        if refused is not None:
            field, why = refused
            raise OpenAIError(400, f"{field} is not supported by this server ({why}); leave it out", param=field)

    def truncated(self, prompt: Prompt, request: SamplingRequest) -> Prompt:
        """vLLM's truncate_prompt_tokens (-1: max_model_len - 1) and truncation_side (the prompt's
        last tokens kept unless "right")."""
        keep = request.truncate_prompt_tokens
        if keep is None:
            return prompt
        if keep == 0:
            raise OpenAIError(400, "truncate_prompt_tokens must be >= 1 (or -1: to max_model_len - 1), got 0",
                              param="truncate_prompt_tokens")
        try:
            ids = truncated_prompt(prompt.token_ids, keep, self.max_model_len, request.truncation_side)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="truncate_prompt_tokens") from None
        return prompt if len(ids) == len(prompt.token_ids) else Prompt(ids, None)

    def warn_ignored(self, request: OpenAIBaseModel) -> None:
        ignored = request.ignored_fields()
        if ignored:
            logger.debug("ignoring unsupported request fields: %s", ", ".join(ignored))

    def max_tokens(self, prompt: Prompt, requested: int | None, field: str = "max_tokens") -> int:
        """The completion budget, as vLLM 0.32's get_max_tokens: what the request asks (else the
        generation config's default, else the room left), within the room left after the prompt and
        the server's cap. A prompt that leaves no room, or a max_tokens above max_model_len, is a 400
        naming `field` (the request's name for the budget)."""
        n = len(prompt.token_ids)
        if n == 0:
            raise OpenAIError(400, "the prompt is empty: it needs at least one token", param="prompt")
        if n >= self.max_model_len:
            raise OpenAIError(400, f"This model's maximum context length (max_model_len) is {self.max_model_len} "
                                   f"tokens, but the prompt has {n} tokens; leave room for at least one "
                                   "generated token.", param="prompt")
        room = min(self.max_model_len - n, self.max_tokens_cap or self.max_model_len)
        if requested is None:
            default = self.sampling_defaults.get("max_tokens", room)
            if not isinstance(default, int) or isinstance(default, bool) or default < 1:
                raise OpenAIError(400, f"the server's default max_tokens (its generation config's max_new_tokens, "
                                       f"{default!r}) is not valid; give max_tokens", param="max_tokens")
            return min(room, default)
        if requested < 1:
            raise OpenAIError(400, f"{field} must be an integer >= 1, got {requested}", param=field)
        if requested > self.max_model_len:
            raise OpenAIError(400, f"{field}={requested} cannot be greater than max_model_len={self.max_model_len}. "
                                   "Please request fewer output tokens.", param=field)
        return min(requested, room)

    def sampling_params(self, make: Any, *args: Any, **kwargs: Any) -> SamplingParams:
        """make(*args, **kwargs, defaults=the generation config's sampling defaults); a ValueError
        becomes a 400 naming the field."""
        try:
            return make(*args, **kwargs, defaults=self.sampling_defaults)
        except ValueError as e:
            raise OpenAIError(400, str(e), param=_leading_field(str(e))) from None

    async def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                          continue_final_message: bool, chat_template: str | None = None,
                          extra: dict[str, Any] | None = None, add_special_tokens: bool = False,
                          documents: list[dict[str, str]] | None = None) -> Prompt:
        """Applies the chat template (the model's; the request's only on a server that trusts
        them), as `LLM.chat` does, in a text worker and within the render time limit; `documents`
        (RAG) reach it as apply_chat_template's own argument, as vLLM passes them."""
        if add_generation_prompt and continue_final_message:
            raise OpenAIError(400, "add_generation_prompt and continue_final_message cannot both be true")
        kwargs: dict[str, Any] = dict(extra or {})
        if "chat_template" in kwargs:
            if chat_template is not None:
                raise OpenAIError(400, "give the chat template once: as chat_template, not also in "
                                       "chat_template_kwargs", param="chat_template")
            chat_template = kwargs.pop("chat_template")
        if chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIError(400, "this server does not run chat templates sent with a request (start it with "
                                   "--trust-request-chat-template to allow them); leave out chat_template",
                              param="chat_template")
        if chat_template is not None and not isinstance(chat_template, str):
            raise OpenAIError(400, "chat_template must be a string", param="chat_template")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise OpenAIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: those are options "
                                   "of the server, not template variables", param="chat_template_kwargs")
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError(400, "this model's tokenizer has no chat template; use /v1/completions")
        try:
            conversation = template_conversation([_message_dict(m) for m in messages],
                                                 chat_template or self.tokenizer.chat_template)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages") from None
        kwargs.update(add_generation_prompt=add_generation_prompt, chat_template=chat_template)
        if documents is not None:
            kwargs["documents"] = documents
        if continue_final_message:
            kwargs["continue_final_message"] = True
        return Prompt(await self.workers.run(self._render_and_encode, conversation, kwargs, add_special_tokens), None)

    def _render_and_encode(self, conversation: list[dict[str, Any]], kwargs: dict[str, Any],
                           add_special_tokens: bool) -> list[int]:
        """Runs in a text worker. Rendering to text, then encoding without special tokens (the
        template writes them; a request may ask for them), is exactly what
        apply_chat_template(tokenize=True) does."""
        try:
            text = run_with_deadline(
                lambda: self.tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs),
                self.render_timeout)
        except RenderTimeoutError as e:
            raise OpenAIError(400, str(e), param="messages") from None
        except Exception as e:  # jinja errors, bad roles, bad template variables: the request's fault
            raise OpenAIError(400, f"cannot apply the chat template: {shorten(str(e), 300)}",
                              param="messages") from None
        if not isinstance(text, str):
            raise OpenAIError(400, f"the chat template rendered {type(text).__name__}, not text", param="messages")
        return self._encode(text, add_special_tokens, "messages")

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            return list(self.tokenizer.encode(valid_text(text), add_special_tokens=add_special_tokens))
        except Exception as e:  # a lone surrogate ("\ud800"), or anything else the tokenizer refuses
            raise OpenAIError(400, f"cannot tokenize the {param}: {shorten(str(e), 300)}", param=param) from None

    async def tokenize_bad_words(self, params: list[SamplingParams]) -> None:
        """The requests' bad_words as token ids (vLLM's update_from_tokenizer), in the text workers:
        the engine, which would otherwise tokenize them, never runs the tokenizer on its thread."""
        if not any(p.bad_words for p in params):
            return
        try:
            await self.workers.run(lambda: [p.update_from_tokenizer(self.tokenizer) for p in params])
        except ValueError as e:
            raise OpenAIError(400, str(e), param="bad_words") from None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.workers.run(self._encode, text, add_special_tokens, "prompt")

    async def decode(self, token_ids: list[int]) -> str:
        return await self.workers.run(lambda: str(self.tokenizer.decode(token_ids)))

    def decode_token(self, token_id: int) -> str:
        """A token without a logprob entry (an echoed prompt's first; none at all without
        detokenization), named as vLLM names it: tokenizer.decode([id]), from the engine's table
        (thread-safe: its C code holds the GIL)."""
        return self.engine.engine.token_table.decode([token_id])

    def token_name(self, token_id: int, logprob: Logprob | None, as_id: bool) -> str:
        """How logprobs name a token: its text, or vLLM's "token_id:N" (return_tokens_as_token_ids)."""
        if as_id:
            return f"token_id:{token_id}"
        text = logprob.decoded_token if logprob is not None else None
        return text if text is not None else self.decode_token(token_id)  # "": part of a character

    async def prompt_text(self, prompt: Prompt) -> str:
        return prompt.text if prompt.text is not None else await self.decode(prompt.token_ids)

    async def compile_grammars(self, params: Sequence[SamplingParams]) -> list[HeldGrammar | None]:
        """Each request's output grammar, compiled before admission in the grammar pool (its own
        processes, under its time limit), so that a compile never holds up the engine's steps nor
        another request's tokenization, and ends when its client leaves (this task is cancelled).
        A spec shared by several prompts is compiled once and held once per prompt. An invalid or
        unenforceable spec, or one past the time limit, is a 400."""
        held: dict[tuple[str, int], HeldGrammar] = {}
        out: list[HeldGrammar | None] = []
        try:
            for p in params:
                spec = p.structured_outputs
                if spec is None:
                    out.append(None)
                    continue
                same = (spec.kind, id(getattr(spec, spec.kind)))  # the prompts of one request share it
                if same in held:
                    out.append(held[same].share())
                else:
                    held[same] = await self._compile(spec)
                    out.append(held[same])
        except BaseException:
            for grammar in out:
                if grammar is not None:
                    grammar.release()
            raise
        return out

    async def _compile(self, spec: StructuredOutputsParams) -> HeldGrammar:
        try:
            # A cached grammar never waits behind compiles. The key (a schema's json.dumps, kept by
            # the spec) is computed in a text worker, off the event loop.
            await self.workers.run(lambda: spec.key)
            cached = self.grammar_pool.compiler.lookup(spec.key)
            if cached is not None:
                return cached
            job = self.grammar_pool.submit(spec)
            try:
                return await asyncio.wrap_future(job.future)
            except asyncio.CancelledError:
                job.cancel()
                raise
        except ValueError as e:
            raise OpenAIError(400, str(e), param=_leading_field(str(e))) from None
        except (GrammarCacheFull, PoolClosed) as e:
            raise OpenAIError(503, str(e)) from None

    async def submit(self, requests: Sequence[tuple[str, Prompt, SamplingParams]],
                     arrival_time: float) -> RequestGroup:
        """Compiles the requests' grammars, then admits them into the engine (which holds the
        grammars until they finish); a rejected prompt, parameter or grammar is a 400."""
        grammars = await self.compile_grammars([params for _, _, params in requests])
        try:
            return await self.engine.add_requests(
                [(rid, prompt.for_engine(), params) for rid, prompt, params in requests], arrival_time, grammars)
        except ValueError as e:
            raise OpenAIError(400, str(e), param=_leading_field(str(e))) from None


@dataclass
class ChoiceState:
    """One choice of a non-streamed response, accumulated from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs:
            self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def response_id(prefix: str, raw: Request, request: SamplingRequest) -> str:
    """The id a response reports, as vLLM's: the client's X-Request-Id header, else the body's
    request_id, else a fresh one. The engine's request ids stay fresh: clients may reuse theirs."""
    given = raw.headers.get("X-Request-Id")
    if given is None:
        given = request.request_id
    return f"{prefix}-{uuid.uuid4().hex if given is None else given}"


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = dict(message.model_extra or {})
    d["role"] = message.role
    content = message.content
    try:
        d["content"] = joined_text(content if not isinstance(content, list) else [p.model_dump() for p in content])
    except ValueError as e:
        raise OpenAIError(400, str(e), param="messages") from None
    if message.name is not None:
        d["name"] = message.name
    return d


_REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)


def _leading_field(message: str) -> str | None:
    """SamplingParams' and the engine's messages start with the field they are about
    ("top_p must be ...", "stop_token_ids holds ...", "structured_outputs.regex is ...")."""
    head = message.split(" ", 1)[0].split(".", 1)[0].split("[", 1)[0].split("=", 1)[0]
    if head == "prompt_token_ids":  # the engine's name for the prompt a client sent
        return "prompt"
    return head if head in _REQUEST_FIELDS else None


def event_stream(events: AsyncIterator[str], group: RequestGroup) -> StreamingResponse:
    """An SSE response. The generator aborts its requests in its `finally`; a generator that
    never started (the client left before the first byte) has no frame to run it, so its
    collection aborts them too."""
    weakref.finalize(events, group.abort)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs `work` unless the client hangs up first; then cancels it (whose cleanup aborts the
    engine requests) instead of finishing a completion nobody will read."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        # The response goes nowhere; 499 is what nginx logs for this.
        raise OpenAIError(499, "client disconnected")
    return task.result()
