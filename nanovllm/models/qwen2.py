"""Qwen2 / Qwen2.5: q, k, v projections always carry a bias; o_proj and the MLP never do."""

from __future__ import annotations

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.model_config import ModelConfig
from nanovllm.models.decoder import ArchFlags, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    def __init__(self, config: ModelConfig, attn_backend: str = "torch", tp: TPGroup | None = None) -> None:
        super().__init__(config, ArchFlags(qkv_bias=True), attn_backend, tp)
