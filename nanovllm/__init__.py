"""nanovllm: an LLM inference engine whose per-step hot path runs in a C++ core."""

from nanovllm.llm import LLM
from nanovllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from nanovllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "Logprob",
    "BeamSearchOutput",
    "BeamSearchSequence",
]
