"""What a request returns, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field

# Per generated (or prompt) token: token id -> its Logprob.
SampleLogprobs = list[dict[int, "Logprob"]]
PromptLogprobs = list[dict[int, "Logprob"] | None]


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int | None = None  # prompt tokens whose KV the prefix cache held (vLLM's)


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt and generated tokens, as vLLM returns them
    logprobs: SampleLogprobs
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
