"""Decoder-only model families (Qwen3, Qwen2, Llama, Qwen3-MoE, Mixtral), their registry and the checkpoint loader."""

from nanovllm.models.decoder import ArchFlags, DecoderForCausalLM
from nanovllm.models.loader import (
    find_weight_files,
    load_model,
    load_weights,
    validate_weight_files,
)
from nanovllm.models.registry import (
    MODEL_REGISTRY,
    build_model,
    get_model_class,
    supported_architectures,
)

__all__ = [
    "MODEL_REGISTRY",
    "ArchFlags",
    "DecoderForCausalLM",
    "build_model",
    "find_weight_files",
    "get_model_class",
    "load_model",
    "load_weights",
    "supported_architectures",
    "validate_weight_files",
]
