"""Request and response bodies of the OpenAI-compatible API, with vLLM's extra fields.

Requests validate types strictly (a string where a number belongs is a 400, not a silent
coercion) but ignore unknown fields, as vLLM does, so clients that send fields that change nothing
(`user`, `metadata`, ...) keep working. Fields that would change the output and that this server
does not implement (tools, functions, audio, `echo` on chat, beam search, logits processors,
prompt embeddings) are refused by name (`refused_field`), never ignored. Value
ranges are checked by `SamplingParams`, whose messages name the field.

An output constraint comes from exactly one of `structured_outputs`, `response_format` or vLLM's
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import fields
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictStr, field_validator

from nanovllm.quote import quote
from nanovllm.sampling_params import KINDS, SEED_MAX, SEED_MIN, SamplingParams, StructuredOutputsParams

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # strict floats still accept JSON integers
Bool = StrictBool
Str = StrictStr

Seed = Annotated[int, Strict(), Field(ge=SEED_MIN, le=SEED_MAX)]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


# Requests --------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: Bool | None = False
    continuous_usage_stats: Bool | None = False  # vLLM: usage on every chunk


class JsonSchemaFormat(OpenAIBaseModel):
    name: Str | None = None
    description: Str | None = None
    # "schema" would shadow a (deprecated) BaseModel method: the field takes it as its alias.
    json_schema: dict[Str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=self.json_schema.json_schema)


# The sampling values of a request that leaves a field out, where the server's generation config sets
# none (vLLM's _DEFAULT_SAMPLING_PARAMS; top_k -1 and 0 both mean off).
NEUTRAL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "repetition_penalty": 1.0}

# vLLM's older names for structured_outputs' kinds.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat share: everything that becomes a SamplingParams."""

    model: Str | None = None
    n: Annotated[int, Strict(), Field(ge=1, le=128)] = 1  # null: 1 (OpenAI's "integer or null")
    temperature: Float | None = None
    top_p: Float | None = None
    seed: Seed | None = None
    stop: Str | list[Str] | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[Str, Float] | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    user: Str | None = None
    # vLLM's extra sampling parameters.
    top_k: Annotated[int, Strict(), Field(le=2**31 - 1)] | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: Bool | None = None
    min_tokens: Int | None = None
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: Bool | None = None
    allowed_token_ids: list[Int] | None = None
    bad_words: list[Str] | None = None
    skip_special_tokens: Bool | None = None
    # vLLM's structured outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}.
    structured_outputs: dict[Str, Any] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[Str, Any] | Str | None = None
    guided_regex: Str | None = None
    guided_choice: list[Str] | None = None
    guided_grammar: Str | None = None

    # vLLM's: keep k of the prompt's tokens (-1: max_model_len - 1), its last ones unless
    # truncation_side is "right" (its first).
    truncate_prompt_tokens: Annotated[int, Strict(), Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: logprobs name tokens "token_id:N" (a token that is not text on its own stays exact);
    # each choice carries its token ids, and the response (or the choice) the prompt's.
    return_tokens_as_token_ids: Bool | None = None
    return_token_ids: Bool | None = None
    # vLLM's: the id the response reports (after the X-Request-Id header, which wins).
    request_id: Str | None = None

    @field_validator("n", mode="before")
    @classmethod
    def _n_default(cls, value: Any) -> Any:
        return 1 if value is None else value

    def refused_field(self) -> tuple[str, str] | None:
        """(field, why) for the first field that asks for what this server does not do."""
        return next(((name, why) for name, asked, why in self._refusals() if asked), None)

    def _refusals(self) -> list[tuple[str, bool, str]]:
        extra = self.model_extra or {}
        return [
            ("stream_options", self.stream_options is not None and not self.stream, "it is an option of streams "
                                                                                    "(stream=true)"),
            ("use_beam_search", bool(extra.get("use_beam_search")), "beam search runs offline, in LLM.beam_search"),
            ("logits_processors", bool(extra.get("logits_processors")), "no request logits processors"),
            ("prompt_embeds", extra.get("prompt_embeds") is not None, "prompts are text or token ids"),
            ("spaces_between_special_tokens", extra.get("spaces_between_special_tokens") is False,
             "special tokens are decoded as the tokenizer joins them"),
            ("logprob_token_ids", extra.get("logprob_token_ids") is not None,
             "logprobs are the chosen token's and the top ones"),
            ("thinking_token_budget", extra.get("thinking_token_budget") is not None, "there is no reasoning parser"),
            ("watermarking", bool(extra.get("watermarking")), "no watermarking"),
            ("repetition_detection", extra.get("repetition_detection") is not None,
             "no repetition detection (repetition_penalty and stop are)"),
            ("return_token_offsets", bool(extra.get("return_token_offsets")), "no token offsets"),
            ("vllm_xargs", bool(extra.get("vllm_xargs")), "no custom logits processors to take them"),
            ("routed_experts_prompt_start", extra.get("routed_experts_prompt_start") is not None,
             "expert routing is not returned"),
            ("mm_payload", extra.get("mm_payload") is not None, "prompts are text or token ids"),
            ("return_mm_kwargs", bool(extra.get("return_mm_kwargs")), "prompts are text or token ids"),
        ]

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint the request asks for (from whichever field gives it); ValueError
        naming the fields if malformed or given twice."""
        given = [name for name in ("structured_outputs", "response_format", *GUIDED)
                 if getattr(self, name) is not None
                 and not (name == "response_format" and self.response_format.type == "text")]
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {given[1]} cannot both constrain the output; give one")
        if not given:
            return None
        name = given[0]
        if name in GUIDED:
            return StructuredOutputsParams(**{GUIDED[name]: getattr(self, name)})
        if name == "response_format":
            return self.response_format.structured()
        unknown = sorted(set(self.structured_outputs) - {f.name for f in fields(StructuredOutputsParams)})
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {', '.join(quote(u) for u in unknown[:5])}; "
                             f"it takes one of {', '.join(KINDS)}")
        return StructuredOutputsParams(**self.structured_outputs)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                           defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range. A sampling field the
        request leaves out takes `defaults`' value (the server's generation config), else vLLM's."""

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        def sampling(name: str) -> Any:
            return pick(getattr(self, name), (defaults or {}).get(name, NEUTRAL_SAMPLING[name]))

        # A lone surrogate cannot be matched against UTF-8 text; refuse it here, by name.
        for s in [self.stop] if isinstance(self.stop, str) else self.stop or []:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"stop must hold valid Unicode strings, got {quote(s)}") from None

        return SamplingParams(
            n=self.n,
            temperature=sampling("temperature"),
            top_p=sampling("top_p"),
            top_k=sampling("top_k"),
            min_p=sampling("min_p"),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            presence_penalty=sampling("presence_penalty"),
            frequency_penalty=sampling("frequency_penalty"),
            repetition_penalty=sampling("repetition_penalty"),
            ignore_eos=pick(self.ignore_eos, False),
            max_tokens=max_tokens,
            min_tokens=pick(self.min_tokens, 0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=pick(self.skip_special_tokens, True),
            include_stop_str_in_output=pick(self.include_stop_str_in_output, False),
            # JSON keys are strings; SamplingParams turns them into token ids (or names the bad one).
            # Biases are clamped to OpenAI's [-100, 100], as vLLM's server does.
            logit_bias=cast(Any, {k: min(100.0, max(-100.0, v)) for k, v in self.logit_bias.items()})
            if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            structured_outputs=self.structured(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's: each chunk's usage (its prompt's and its choice's tokens so far), only with include_usage."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


PromptInput = Str | list[Str] | list[Int] | list[list[Int]]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    max_tokens: Int | None = 16
    echo: Bool | None = False
    logprobs: Int | None = None
    prompt_logprobs: Int | None = None  # vLLM's: each prompt token's logprob and its top alternatives
    best_of: Int | None = None
    suffix: Str | None = None
    add_special_tokens: Bool = True  # vLLM's: the tokenizer's BOS (and the like) before a text prompt

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _max_tokens_default(cls, value: Any) -> Any:
        return 16 if value is None else value  # vLLM's: null is the default, as OpenAI's

    def _refusals(self) -> list[tuple[str, bool, str]]:
        return [("suffix", bool(self.suffix), "no insertion"),
                ("best_of", self.best_of is not None and self.best_of != self.n, "no best-of selection: leave it unset "
                                                                                 "or equal to n"),
                *super()._refusals()]

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (with its logprobs) scored, nothing generated (OpenAI's
        legacy completions; vLLM's echo without generation)."""
        return bool(self.echo) and self.max_tokens == 0


class ContentPart(OpenAIBaseModel):
    type: Str
    text: Str | None = None


class ChatMessage(OpenAIBaseModel):
    role: Str
    content: Str | list[ContentPart] | None = None
    name: Str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    # vLLM's chat-template controls (a request's own template only runs on a server started with
    # --trust-request-chat-template).
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template: Str | None = None
    chat_template_kwargs: dict[Str, Any] | None = None
    add_special_tokens: Bool = False  # vLLM's: the template writes the special tokens itself
    # Template variables, as vLLM passes them: RAG documents, and the reasoning effort (which also
    # sets enable_thinking, unless chat_template_kwargs does); a template without them ignores them.
    documents: list[dict[Str, Str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    def template_variables(self) -> dict[str, Any]:
        """chat_template_kwargs with the request's reasoning effort (its documents are
        apply_chat_template's own argument)."""
        variables: dict[str, Any] = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
            variables.setdefault("enable_thinking", self.reasoning_effort != "none")
        return variables

    def _refusals(self) -> list[tuple[str, bool, str]]:
        extra = self.model_extra or {}
        return [*super()._refusals(),
            ("tools", bool(extra.get("tools")), "tool calling is not supported"),
            ("tool_choice", extra.get("tool_choice") not in (None, "none"), "tool calling is not supported"),
            ("functions", bool(extra.get("functions")), "function calling is not supported"),
            ("function_call", extra.get("function_call") not in (None, "none"), "function calling is not supported"),
            ("audio", extra.get("audio") is not None or "audio" in (extra.get("modalities") or ()),
             "audio output is not supported"),
            ("modalities", any(m != "text" for m in extra.get("modalities") or ()), "only text output is supported"),
            ("echo", bool(extra.get("echo")), "echo is a /v1/completions option"),
            ("prompt_logprobs", extra.get("prompt_logprobs") is not None, "prompt logprobs are a /v1/completions "
                                                                          "option here"),
            ("web_search_options", extra.get("web_search_options") is not None, "web search is not supported"),
            ("return_prompt_text", bool(extra.get("return_prompt_text")), "the rendered prompt is not returned (POST "
                                                                          "/tokenize with messages renders it)"),
            ("media_io_kwargs", bool(extra.get("media_io_kwargs")), "only text content parts are supported"),
            ("mm_processor_kwargs", bool(extra.get("mm_processor_kwargs")), "only text content parts are supported"),
        ]


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's /tokenize: either `prompt` or `messages` (rendered with the chat template)."""

    model: Str | None = None
    prompt: Str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template: Str | None = None
    chat_template_kwargs: dict[Str, Any] | None = None
    return_token_strs: Bool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: Str | None = None
    tokens: list[Int]


# Responses -------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int | None = None  # prompt tokens whose KV the prefix cache held


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # --enable-prompt-tokens-details (vLLM's)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob, as its prompt_logprobs carry it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Per prompt token (None for the first): {token id: its logprob}, the prompt's token and the
    # top `prompt_logprobs` others.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    # vLLM's return_token_ids: the choice's tokens and its prompt's.
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatStreamChoice(BaseModel):
    index: int
    # A plain dict so that absent fields stay absent ({"content": "x"}), as OpenAI sends them.
    delta: dict[str, Any]
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this chunk's


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: on each choice's first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "nanovllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
