"""Qwen3: per-head RMSNorm on q and k; attention biases only if `attention_bias` (off in releases)."""

from __future__ import annotations

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.model_config import ModelConfig
from nanovllm.models.decoder import ArchFlags, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    def __init__(self, config: ModelConfig, attn_backend: str = "torch", tp: TPGroup | None = None) -> None:
        bias = config.attention_bias
        super().__init__(config, ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=True), attn_backend, tp)
