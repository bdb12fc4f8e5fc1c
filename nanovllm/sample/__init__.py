"""Sampling, as one package: the persistent per-sequence state (`SamplingState`), the logits
processors it applies (penalties, logit bias, min_tokens, grammars for structured output), the
sampler and logprobs. Rank 0's model runner owns the state, through its token sampler
(worker/token_sampler.py)."""

from nanovllm.sample.logprobs import LogprobBlock, build_entries, correct_partial, gather_logprobs
from nanovllm.sample.sampler import GREEDY_EPS, Sampler, SamplingBatch, make_sampling_batch
from nanovllm.sample.state import SamplingState

__all__ = [
    "GREEDY_EPS",
    "LogprobBlock",
    "Sampler",
    "SamplingBatch",
    "SamplingState",
    "build_entries",
    "correct_partial",
    "gather_logprobs",
    "make_sampling_batch",
]
