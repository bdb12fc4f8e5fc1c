"""GET /v1/models, POST /tokenize and POST /detokenize (vLLM's shapes). These never touch the
engine thread; the tokenizer runs in the server's text workers."""

from __future__ import annotations

from nanovllm.entrypoints.openai.errors import OpenAIError
from nanovllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from nanovllm.entrypoints.openai.serving_base import ServingContext


class TokenizeServing:
    def __init__(self, ctx: ServingContext, vocab_size: int) -> None:
        self.ctx = ctx
        self.vocab_size = vocab_size

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=self.ctx.model_path, max_model_len=self.ctx.max_model_len)
                               for name in self.ctx.model_names])

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        ctx = self.ctx
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.prompt is not None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = await ctx.encode(req.prompt, add_special_tokens=add_special)
        else:
            assert req.messages is not None
            tokens = (await ctx.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message,
                                            req.chat_template, req.chat_template_kwargs,
                                            bool(req.add_special_tokens))).token_ids
        strs = None
        if req.return_token_strs:
            strs = await ctx.workers.run(lambda: [str(t) for t in ctx.tokenizer.convert_ids_to_tokens(tokens)])
        return TokenizeResponse(count=len(tokens), max_model_len=ctx.max_model_len, tokens=tokens, token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.ctx.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                              param="tokens")
        return DetokenizeResponse(prompt=await self.ctx.decode(req.tokens))
