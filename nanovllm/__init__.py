"""nanovllm: an LLM inference engine whose per-step hot path runs in a C++ core."""

from nanovllm.engine.llm_engine import PromptType, TextPrompt, TokensPrompt
from nanovllm.llm import LLM
from nanovllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from nanovllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "PromptType",
    "TextPrompt",
    "TokensPrompt",
    "SamplingParams",
    "RequestOutputKind",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "Logprob",
    "BeamSearchOutput",
    "BeamSearchSequence",
]
