"""Mixtral: Llama's attention without biases, a mixture of experts in every layer (models/moe.py),
stored in the checkpoint as `block_sparse_moe` with experts' `w1` (gate), `w3` (up), `w2` (down)."""

from __future__ import annotations

from typing import ClassVar

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.model_config import ModelConfig
from nanovllm.models.decoder import ArchFlags, DecoderForCausalLM
from nanovllm.models.moe import mixtral_config, moe_mlp


class MixtralForCausalLM(DecoderForCausalLM):
    checkpoint_module_names: ClassVar[dict[str, str]] = {"mlp": "block_sparse_moe"}

    def __init__(self, config: ModelConfig, attn_backend: str = "torch", tp: TPGroup | None = None) -> None:
        super().__init__(config, ArchFlags(), attn_backend, tp, moe_mlp(mixtral_config(config)))
