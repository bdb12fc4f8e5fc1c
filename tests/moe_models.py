"""Tiny random-weight mixture-of-experts models (Qwen3-MoE, Mixtral) for the MoE tests.

transformers initializes a router at std 0.02: routing so close to uniform that the rounding of one
fp32 sum could pick another expert than transformers does. The routers here are scaled up
(ROUTER_SCALE) so that each row's choice is clear, as a trained router's is. A `hog` model pushes
one embedding dimension up for every token and points one expert's router row along it: that
expert is chosen by every row of every sparse layer and most others by none (ragged routing).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nanovllm.builtin_model import TinyModelSpec, create_model_dir

ROUTER_SCALE = 10.0


@dataclass(frozen=True)
class MoeModel:
    spec: TinyModelSpec
    hog: int | None = None  # the expert every row chooses


def qwen3_moe(seed: int, **extra: object) -> TinyModelSpec:
    fields = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False)
    return TinyModelSpec(arch="Qwen3MoeForCausalLM", head_dim=32, seed=seed, extra={**fields, **extra})


MOE_MODELS: dict[str, MoeModel] = {
    # norm_topk_prob false (Qwen3-30B-A3B's own setting is true: see the next one), every layer sparse.
    "qwen3_moe": MoeModel(qwen3_moe(31)),
    # Weights renormalized; 6 layers, decoder_sparse_step 2 (layers 1, 3, 5) less mlp_only_layers [3]:
    # sparse 1 and 5, dense 0, 2, 3, 4 (intermediate_size 128 there, 48 per expert).
    "qwen3_moe_mixed": MoeModel(TinyModelSpec(
        arch="Qwen3MoeForCausalLM", head_dim=32, num_hidden_layers=6, seed=32,
        extra=dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True,
                   decoder_sparse_step=2, mlp_only_layers=[3]))),
    "mixtral": MoeModel(TinyModelSpec(arch="MixtralForCausalLM", head_dim=16, seed=33,
                                      extra=dict(num_local_experts=8, num_experts_per_tok=2))),
    # 16 experts, top 2, expert 5 chosen everywhere.
    "qwen3_moe_ragged": MoeModel(qwen3_moe(34, num_experts=16, norm_topk_prob=True), hog=5),
}


# For the tensor-parallel tests (tests/test_tensor_parallel.py), smaller; Mixtral's experts large
# enough (2 * 256 x 256 weights) that oneDNN packs them on a CPU whose experts take oneDNN.
TP_MOE_MODELS: dict[str, MoeModel] = {
    # 3 layers: sparse, dense (mlp_only_layers), sparse; weights renormalized.
    "qwen3_moe_tp": MoeModel(TinyModelSpec(
        arch="Qwen3MoeForCausalLM", head_dim=32, num_hidden_layers=3, seed=36,
        extra=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                   mlp_only_layers=[1]))),
    "mixtral_wide": MoeModel(TinyModelSpec(arch="MixtralForCausalLM", hidden_size=256, intermediate_size=256,
                                           head_dim=64, seed=35, extra=dict(num_local_experts=8, num_experts_per_tok=2))),
}


def make_moe_model(root: Path, name: str) -> Path:
    """Create the model `name` (a key of MOE_MODELS or TP_MOE_MODELS) under `root / name`."""
    model = {**MOE_MODELS, **TP_MOE_MODELS}[name]
    path = create_model_dir(root / name, spec=model.spec)
    weights_file = path / "model.safetensors"
    weights = load_file(weights_file)
    for key in weights:
        if key.endswith(".gate.weight"):  # a router (dense MLPs' projections are gate_proj)
            weights[key] = weights[key] * ROUTER_SCALE
            if model.hog is not None:
                weights[key][model.hog] = 0.0
                weights[key][model.hog, 0] = 2.0
    if model.hog is not None:
        weights["model.embed_tokens.weight"][:, 0] += 1.0
    save_file({k: v.contiguous() for k, v in weights.items()}, weights_file, metadata={"format": "pt"})
    return path


def router_counts(path: Path, tokens: list[int]) -> list[torch.Tensor]:
    """transformers' routing of `tokens`: per sparse layer, how many rows chose each expert."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    k = hf.config.num_experts_per_tok
    return [torch.bincount(logits.topk(k, dim=-1).indices.flatten(), minlength=logits.shape[-1])
            for logits in out.router_logits]
