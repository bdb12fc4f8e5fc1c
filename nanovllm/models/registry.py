"""Model classes keyed by the Hugging Face `architectures` name in config.json."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.model_config import ModelConfig
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.mixtral import MixtralForCausalLM
from nanovllm.models.moe import mixtral_config, qwen3_moe_config
from nanovllm.models.qwen2 import Qwen2ForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM

ModelFactory = Callable[[ModelConfig, str, TPGroup | None], DecoderForCausalLM]

MODEL_REGISTRY: dict[str, ModelFactory] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # Llama's layers without biases (its window: model_config)
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


# Architectures with config.json fields of their own: the parser their model's construction calls.
ARCH_CONFIGS: dict[str, Callable[[ModelConfig], object]] = {
    "Qwen3MoeForCausalLM": qwen3_moe_config,
    "MixtralForCausalLM": mixtral_config,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)  # = model_config.SUPPORTED_ARCHITECTURES


def get_model_class(architecture: str) -> ModelFactory:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return MODEL_REGISTRY[architecture]


def build_model(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attn_backend: str = "torch",
    tp: TPGroup | None = None,
) -> DecoderForCausalLM:
    """Instantiate the architecture with uninitialized weights directly in `dtype` on `device`
    (this rank's shards under tensor parallelism `tp`).

    Creating parameters in place avoids a full-precision CPU copy of a large model.
    """
    factory = get_model_class(config.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = factory(config, attn_backend, tp)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()
