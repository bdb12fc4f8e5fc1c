"""Llama (2, 3, 3.1+ with llama3 rope scaling): `attention_bias` covers q/k/v/o, `mlp_bias` the MLP.
Mistral's checkpoints (MistralForCausalLM) are the same layers without biases."""

from __future__ import annotations

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.model_config import ModelConfig
from nanovllm.models.decoder import ArchFlags, DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, config: ModelConfig, attn_backend: str = "torch", tp: TPGroup | None = None) -> None:
        bias = config.attention_bias
        flags = ArchFlags(qkv_bias=bias, o_bias=bias, mlp_bias=config.mlp_bias)
        super().__init__(config, flags, attn_backend, tp)
