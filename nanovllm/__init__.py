"""nanovllm: an LLM inference engine whose per-step hot path runs in a C++ core."""

from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
