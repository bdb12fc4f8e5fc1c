"""POST /v1/chat/completions: the conversation goes through the tokenizer's chat template (as
`LLM.chat` does) and becomes one engine request with the request's `n`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanovllm.engine.async_engine import RequestGroup
from nanovllm.entrypoints.openai.errors import OpenAIError
from nanovllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from nanovllm.entrypoints.openai.serving_base import (
    SSE_DONE,
    STREAM_ERRORS,
    ChoiceState,
    Prompt,
    ServingContext,
    event_stream,
    json_logprob,
    response_id,
    sse,
    stream_error,
    until_disconnected,
)
from nanovllm.outputs import Logprob


class ChatServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        ctx = self.ctx
        ctx.check_model(req.model)
        ctx.check_refused(req)
        ctx.warn_ignored(req)
        if req.top_logprobs and not req.logprobs:  # 0, the default, asks for nothing (as vLLM)
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        k = (req.top_logprobs or 0) if req.logprobs else None
        prompt = ctx.truncated(await ctx.render_chat(req.messages, req.add_generation_prompt,
                                                     req.continue_final_message, req.chat_template,
                                                     req.template_variables(), req.add_special_tokens,
                                                     req.documents), req)
        budget = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = ctx.sampling_params(req.to_sampling_params, ctx.max_tokens(prompt, getattr(req, budget), budget), k)
        await ctx.tokenize_bad_words([params])
        request_id = response_id("chatcmpl", raw, req)
        group = await until_disconnected(raw, ctx.submit([(f"chatcmpl-{uuid.uuid4().hex}", prompt, params)], arrival))
        created = int(arrival)  # as vLLM and OpenAI: when the request came, streamed or not
        if req.stream:
            return event_stream(self._stream(req, request_id, created, group, prompt), group)
        response = await until_disconnected(raw, self._collect(req, request_id, created, group, prompt))
        return JSONResponse(response.model_dump())

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                  as_id: bool) -> ChatChoiceLogprobs:
        """Per token its text (or "token_id:N", `as_id`: its bytes stay the text's, the
        alternatives' are their names', as vLLM's), logprob and the top `k` alternatives."""
        content = []
        for tid, entry in zip(token_ids, entries):
            chosen = entry[tid]
            text = self.ctx.token_name(tid, chosen, False)
            top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
                         key=lambda item: item[1].rank or 0)
            content.append(TokenLogprob(
                token=self.ctx.token_name(tid, chosen, as_id), logprob=json_logprob(chosen.logprob),
                bytes=list(text.encode("utf-8")),
                top_logprobs=[TopLogprob(token=(name := self.ctx.token_name(t, lp, as_id)),
                                         logprob=json_logprob(lp.logprob), bytes=list(name.encode("utf-8")))
                              for t, lp in top],
            ))
        return ChatChoiceLogprobs(content=content)

    async def _collect(self, req: ChatCompletionRequest, request_id: str, created: int, group: RequestGroup,
                       prompt: Prompt) -> ChatCompletionResponse:
        states = [ChoiceState() for _ in range(req.n)]
        cached = None
        try:
            async for out in group:
                cached = out.num_cached_tokens
                for c in out.outputs:
                    states[c.index].add(c)
        finally:
            group.abort()
        k = (req.top_logprobs or 0) if req.logprobs else None
        as_id = bool(req.return_tokens_as_token_ids)
        choices = [
            ChatChoice(index=j, message=ChatResponseMessage(role=_role(req), content=st.text),
                       logprobs=self._logprobs(st.token_ids, st.logprobs, k, as_id) if k is not None else None,
                       finish_reason=st.finish_reason, stop_reason=st.stop_reason,
                       token_ids=st.token_ids if req.return_token_ids else None)
            for j, st in enumerate(states)
        ]
        return ChatCompletionResponse(id=request_id, created=created, model=self.ctx.model_name, choices=choices,
                                      usage=self.ctx.usage(len(prompt.token_ids),
                                                           sum(len(st.token_ids) for st in states), cached),
                                      prompt_token_ids=list(prompt.token_ids) if req.return_token_ids else None)

    async def _stream(self, req: ChatCompletionRequest, request_id: str, created: int, group: RequestGroup,
                      prompt: Prompt) -> AsyncIterator[str]:
        k = (req.top_logprobs or 0) if req.logprobs else None
        as_id, with_ids = bool(req.return_tokens_as_token_ids), bool(req.return_token_ids)
        model = self.ctx.model_name
        generated = [0] * req.n  # each choice's tokens so far
        cached = None
        n_prompt = len(prompt.token_ids)

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None,
                  prompt_token_ids: list[int] | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices,
                                           usage=usage, prompt_token_ids=prompt_token_ids))

        try:
            # As OpenAI: each choice opens with the role and empty content (and, for
            # return_token_ids, the prompt's token ids, as vLLM's first chunk of each choice).
            for j in range(req.n):
                yield chunk([ChatStreamChoice(index=j, delta={"role": _role(req), "content": ""})],
                            self.ctx.usage(n_prompt, 0) if req.continuous_usage else None,
                            list(prompt.token_ids) if with_ids else None)
            async for out in group:
                cached = out.num_cached_tokens
                for c in out.outputs:
                    generated[c.index] += len(c.token_ids)
                    if not c.text and c.finish_reason is None and not ((k is not None or with_ids) and c.token_ids):
                        continue  # a stop string may hold text back; nothing to say yet
                    logprobs = self._logprobs(c.token_ids, c.logprobs or [], k, as_id) if k is not None else None
                    yield chunk([ChatStreamChoice(index=c.index, delta={"content": c.text} if c.text else {},
                                                  logprobs=logprobs, finish_reason=c.finish_reason,
                                                  stop_reason=c.stop_reason,
                                                  token_ids=list(c.token_ids) if with_ids else None)],
                                self.ctx.usage(n_prompt, generated[c.index]) if req.continuous_usage else None)
            if req.include_usage:
                yield chunk([], self.ctx.usage(n_prompt, sum(generated), cached))
            yield SSE_DONE
        except STREAM_ERRORS as e:
            yield stream_error(e)
            yield SSE_DONE
        finally:
            group.abort()  # also on client disconnect: free the blocks before the next step


def _role(req: ChatCompletionRequest) -> str:
    """The reply's role, as vLLM's: the assistant's, or, without a generation prompt (the reply
    continues the conversation's last message), that message's."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role

