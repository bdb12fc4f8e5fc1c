"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm), a mixture of experts in the sparse layers
(models/moe.py), a dense MLP in the others."""

from __future__ import annotations

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.model_config import ModelConfig
from nanovllm.models.decoder import ArchFlags, DecoderForCausalLM
from nanovllm.models.moe import moe_mlp, qwen3_moe_config


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    def __init__(self, config: ModelConfig, attn_backend: str = "torch", tp: TPGroup | None = None) -> None:
        bias = config.attention_bias
        super().__init__(config, ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=True), attn_backend, tp,
                         moe_mlp(qwen3_moe_config(config)))
