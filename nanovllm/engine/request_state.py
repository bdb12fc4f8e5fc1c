"""The engine's Python-side record of each request and of each of its completions (one core
sequence per completion), and how a RequestOutput is built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanovllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from nanovllm.sampling_params import SamplingParams


@dataclass
class Completion:
    index: int
    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # How much of the above the last streamed output already carried.
    sent_tokens: int = 0
    sent_text: int = 0
    sent_finish: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self, delta: bool) -> CompletionOutput:
        if not delta:
            return CompletionOutput(self.index, self.text, list(self.token_ids), self.cumulative_logprob,
                                    self.logprobs, self.finish_reason, self.stop_reason)
        out = CompletionOutput(
            self.index, self.text[self.sent_text:], self.token_ids[self.sent_tokens:], self.cumulative_logprob,
            self.logprobs[self.sent_tokens:] if self.logprobs is not None else None,
            self.finish_reason, self.stop_reason,
        )
        self.sent_tokens, self.sent_text, self.sent_finish = len(self.token_ids), len(self.text), self.finished
        return out

    def has_news(self) -> bool:
        return len(self.token_ids) > self.sent_tokens or len(self.text) > self.sent_text or (
            self.finished and not self.sent_finish)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    stream: bool
    completions: list[Completion] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    # Set once the first sample has fanned out into n completions (n > 1).
    fanned_out: bool = True

    @property
    def finished(self) -> bool:
        return self.fanned_out and all(c.finished for c in self.completions)

    @property
    def prompt_logprobs_pending(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def output(self) -> RequestOutput:
        """A streamed request gets what is new since its last output; others get everything."""
        if self.stream:
            completions = [c.output(delta=True) for c in self.completions if c.has_news()]
        else:
            completions = [c.output(delta=False) for c in self.completions]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, self.finished,
                             self.metrics, self.prompt_logprobs)
