"""POST /v1/completions: one engine request per prompt (each with the request's `n`); choice
`i * n + j` is sample j of prompt i, as OpenAI and vLLM number them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from nanovllm.engine.async_engine import RequestGroup
from nanovllm.entrypoints.openai.errors import OpenAIError
from nanovllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
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

# Per token: its logprob entry, or None for the first prompt token (nothing precedes it).
LogprobEntries = list[dict[int, Logprob] | None]


class CompletionServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        ctx = self.ctx
        ctx.check_model(req.model)
        ctx.check_refused(req)
        ctx.warn_ignored(req)
        prompts = [ctx.truncated(p, req) for p in await self._prompts(req)]
        k = req.logprobs
        # Prompt logprobs serve both an echo with logprobs and vLLM's prompt_logprobs.
        wanted = [w for w in (k if req.echo else None, req.prompt_logprobs) if w is not None]
        # An echo without generation runs one token, which the response leaves out.
        max_tokens = 1 if req.echo_only else req.max_tokens
        params = [ctx.sampling_params(req.to_sampling_params, ctx.max_tokens(p, max_tokens), k,
                                      max(wanted, default=None)) for p in prompts]
        await ctx.tokenize_bad_words(params)
        request_id = response_id("cmpl", raw, req)
        engine_id = f"cmpl-{uuid.uuid4().hex}"
        rids = [f"{engine_id}-{i}" for i in range(len(prompts))]
        group = await until_disconnected(raw, ctx.submit(list(zip(rids, prompts, params)), arrival))
        created = int(arrival)  # as vLLM and OpenAI: when the request came, streamed or not
        if req.stream:
            return event_stream(self._stream(req, request_id, created, group, prompts), group)
        response = await until_disconnected(raw, self._collect(req, request_id, created, group, prompts))
        return JSONResponse(response.model_dump())

    async def _prompts(self, req: CompletionRequest) -> list[Prompt]:
        prompt = req.prompt
        special = req.add_special_tokens
        if isinstance(prompt, str):
            return [Prompt(await self.ctx.encode(prompt, special), prompt)]
        if not prompt:
            raise OpenAIError(400, "prompt must not be an empty list", param="prompt")
        if isinstance(prompt[0], str):
            return [Prompt(await self.ctx.encode(p, special), p) for p in prompt]  # type: ignore[arg-type]
        if isinstance(prompt[0], int):
            return [Prompt(list(prompt), None)]  # type: ignore[arg-type]
        prompts = [Prompt(list(p), None) for p in prompt]  # type: ignore[union-attr]
        for i, p in enumerate(prompts):  # which prompt holds a bad id, before the engine sees them
            try:
                self.ctx.engine.engine.check_prompt(p.token_ids)
            except ValueError as e:
                raise OpenAIError(400, f"prompt[{i}]: {e}", param="prompt") from None
        return prompts

    def _logprobs(self, token_ids: list[int], entries: LogprobEntries, k: int, offset: int,
                  as_id: bool) -> tuple[CompletionLogprobs, int]:
        """OpenAI's legacy logprobs: per token its text (or "token_id:N", `as_id`), logprob, text
        offset and the top `k` alternatives (plus the chosen token, as vLLM reports it)."""
        out = CompletionLogprobs()
        for tid, entry in zip(token_ids, entries):
            chosen = entry.get(tid) if entry is not None else None
            token = self.ctx.token_name(tid, chosen, as_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if entry is None or chosen is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(json_logprob(chosen.logprob))
            out.top_logprobs.append({
                self.ctx.token_name(t, lp, as_id): json_logprob(lp.logprob)
                for t, lp in entry.items() if t == tid or (lp.rank is not None and lp.rank <= k)
            })
        return out, offset

    def _prompt_logprobs(self, req: CompletionRequest, prompt: Prompt,
                         entries: LogprobEntries | None) -> list[dict[int, PromptLogprob] | None] | None:
        """vLLM's prompt_logprobs of a choice: each prompt token's entry cut to the token itself
        and the top `prompt_logprobs`."""
        k = req.prompt_logprobs
        if k is None or entries is None:
            return None
        return [None if entry is None else {
            t: PromptLogprob(logprob=json_logprob(lp.logprob), rank=lp.rank,
                             decoded_token=lp.decoded_token if lp.decoded_token is not None
                             else self.ctx.decode_token(t))
            for t, lp in entry.items() if t == tid or (lp.rank is not None and lp.rank <= k)}
            for tid, entry in zip(prompt.token_ids, entries)]

    async def _echo(self, prompt: Prompt,
                    prompt_logprobs: LogprobEntries | None) -> tuple[str, list[int], LogprobEntries]:
        entries: LogprobEntries = [None] * len(prompt.token_ids)
        if prompt_logprobs is not None:
            entries = list(prompt_logprobs)
        return await self.ctx.prompt_text(prompt), list(prompt.token_ids), entries

    async def _collect(self, req: CompletionRequest, request_id: str, created: int, group: RequestGroup,
                       prompts: list[Prompt]) -> CompletionResponse:
        n = req.n
        index = {rid: i for i, rid in enumerate(group.request_ids)}
        states = [[ChoiceState() for _ in range(n)] for _ in prompts]
        prompt_logprobs: list[LogprobEntries | None] = [None] * len(prompts)
        cached: list[int | None] = [None] * len(prompts)
        try:
            async for out in group:
                i = index[out.request_id]
                cached[i] = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    prompt_logprobs[i] = out.prompt_logprobs
                for c in out.outputs:
                    states[i][c.index].add(c)
        finally:
            group.abort()
        choices = []
        for i, prompt in enumerate(prompts):
            for j, st in enumerate(states[i]):
                text, ids = ("", []) if req.echo_only else (st.text, st.token_ids)
                entries: LogprobEntries = [] if req.echo_only else list(st.logprobs)
                if req.echo:
                    head, head_ids, head_entries = await self._echo(prompt, prompt_logprobs[i])
                    text, ids, entries = head + text, head_ids + ids, head_entries + entries
                logprobs = (self._logprobs(ids, entries, req.logprobs, 0, bool(req.return_tokens_as_token_ids))[0]
                            if req.logprobs is not None else None)
                choices.append(CompletionChoice(index=i * n + j, text=text, logprobs=logprobs,
                                                finish_reason=st.finish_reason, stop_reason=st.stop_reason,
                                                prompt_logprobs=self._prompt_logprobs(req, prompt, prompt_logprobs[i]),
                                                **_token_ids(req, st.token_ids, prompt)))
        generated = 0 if req.echo_only else sum(len(st.token_ids) for row in states for st in row)
        return CompletionResponse(id=request_id, created=created, model=self.ctx.model_name, choices=choices,
                                  usage=self._usage(prompts, generated, cached))

    def _usage(self, prompts: list[Prompt], completion_tokens: int,
               cached: list[int | None] | None = None) -> UsageInfo:
        """Usage of `prompts`; the prefix cache's part summed over those it reported (vLLM reports
        the last prompt's alone)."""
        known = [c for c in cached or () if c is not None]
        return self.ctx.usage(sum(len(p.token_ids) for p in prompts), completion_tokens,
                              sum(known) if known else None)

    async def _stream(self, req: CompletionRequest, request_id: str, created: int, group: RequestGroup,
                      prompts: list[Prompt]) -> AsyncIterator[str]:
        n, k = req.n, req.logprobs
        model = self.ctx.model_name
        index = {rid: i for i, rid in enumerate(group.request_ids)}
        offsets: dict[int, int] = {}  # choice -> text offset of its next token (for logprobs)
        generated: dict[int, int] = {}  # choice -> its tokens so far
        cached: list[int | None] = [None] * len(prompts)
        try:
            async for out in group:
                i = index[out.request_id]
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    choice = i * n + c.index
                    if req.echo_only:
                        text, ids, entries = "", [], []
                    else:
                        generated[choice] = generated.get(choice, 0) + len(c.token_ids)
                        text, ids, entries = c.text, list(c.token_ids), list(c.logprobs or [])
                    new_ids = list(ids)
                    first = choice not in offsets
                    if req.echo and first:  # the first chunk of a choice repeats the prompt
                        head, head_ids, head_entries = await self._echo(prompts[i], out.prompt_logprobs)
                        text, ids, entries = head + text, head_ids + ids, head_entries + entries
                    offsets.setdefault(choice, 0)
                    prompt_logprobs = self._prompt_logprobs(req, prompts[i], out.prompt_logprobs) if first else None
                    if (not text and c.finish_reason is None and not ((k is not None or req.return_token_ids) and ids)
                            and prompt_logprobs is None and not (first and req.return_token_ids)):
                        continue  # a stop string may hold text back; nothing to say yet
                    logprobs = None
                    if k is not None:
                        logprobs, offsets[choice] = self._logprobs(ids, entries, k, offsets[choice],
                                                                   bool(req.return_tokens_as_token_ids))
                    chunk = CompletionResponse(
                        id=request_id, created=created, model=model,
                        choices=[CompletionChoice(index=choice, text=text, logprobs=logprobs,
                                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                  prompt_logprobs=prompt_logprobs,
                                                  **_token_ids(req, new_ids, prompts[i] if first else None))],
                        usage=self._usage(prompts[i:i + 1], generated.get(choice, 0)) if req.continuous_usage else None,
                    )
                    yield sse(chunk)
            if req.include_usage:
                yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                             usage=self._usage(prompts, sum(generated.values()), cached)))
            yield SSE_DONE
        except STREAM_ERRORS as e:
            yield stream_error(e)
            yield SSE_DONE
        finally:
            # Also runs when the client disconnects (the response task is cancelled): the
            # requests leave the engine and free their blocks before its next step.
            group.abort()


def _token_ids(req: CompletionRequest, token_ids: list[int], prompt: Prompt | None) -> dict[str, list[int] | None]:
    """vLLM's return_token_ids: a choice's (or chunk's) generated token ids, and its prompt's where
    given (a stream's first chunk of the choice)."""
    if not req.return_token_ids:
        return {}
    return {"token_ids": [] if req.echo_only else token_ids,
            "prompt_token_ids": None if prompt is None else list(prompt.token_ids)}

