"""Mixture-of-experts decoders: their config.json fields and the sparse MLP block.

Qwen3-MoE: `num_experts` (transformers 5 writes it as `num_local_experts`), `num_experts_per_tok`,
`moe_intermediate_size` (each expert's), `norm_topk_prob` (renormalize the top-k weights, default
false); layer i is sparse unless it is in `mlp_only_layers` or (i + 1) is not a multiple of
`decoder_sparse_step`, and its dense layers take `intermediate_size`. Mixtral: `num_local_experts`,
`num_experts_per_tok`, `intermediate_size` (each expert's); every layer sparse, weights always
renormalized. Both route by softmax over the router logits, then top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nanovllm.layers.fused_moe import MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES, FusedMoE
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.model_config import ModelConfig, whole_number
from nanovllm.models.decoder import ArchFlags, MlpFactory, dense_mlp

if TYPE_CHECKING:
    from nanovllm.distributed.parallel_state import TPGroup


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool
    sparse_layers: frozenset[int]
    expert_names: tuple[str, str, str]  # the checkpoint's (gate, up, down) module names


class SparseMoeBlock(nn.Module):
    """The router (`gate`, a linear layer to one logit per expert) and the experts; module names as
    in the checkpoints (`mlp.gate`, `mlp.experts.E.*`)."""

    def __init__(self, config: ModelConfig, moe: MoeConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, config.hidden_size, moe.intermediate_size,
                                moe.renormalize, moe.expert_names, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


def moe_mlp(moe: MoeConfig) -> MlpFactory:
    """The decoder's MLP factory: a SparseMoeBlock in the sparse layers, the dense MLP elsewhere."""
    def make(config: ModelConfig, flags: ArchFlags, layer_idx: int, tp: TPGroup | None) -> nn.Module:
        if layer_idx in moe.sparse_layers:
            return SparseMoeBlock(config, moe, tp)
        return dense_mlp(config, flags, layer_idx, tp)
    return make


def _field(config: ModelConfig, *keys: str, default: Any = None) -> Any:
    """The first of `keys` config.json sets (not null), else `default`; ValueError naming the
    file and the field when there is neither."""
    for key in keys:
        if config.raw.get(key) is not None:
            return config.raw[key]
    if default is None:
        raise ValueError(f"{config.model_dir / 'config.json'}: missing required key {' or '.join(map(repr, keys))}")
    return default


def _int_field(config: ModelConfig, *keys: str, low: int, default: int | None = None) -> int:
    """An integer field (an integral float too, as model_config's whole_number takes it) >= low."""
    value = _field(config, *keys, default=default)
    whole = whole_number(value)
    if whole is None or whole < low:
        raise ValueError(f"{config.model_dir / 'config.json'}: {keys[0]} must be an integer >= {low}, got {value!r}")
    return whole


def _moe_config(config: ModelConfig, num_experts: int, intermediate_size: int, renormalize: bool,
                sparse_layers: frozenset[int], expert_names: tuple[str, str, str], default_top_k: int) -> MoeConfig:
    where = config.model_dir / "config.json"
    # The config classes' defaults (Qwen3-MoE's 8, Mixtral's 2) where config.json leaves it out.
    top_k = _int_field(config, "num_experts_per_tok", low=1, default=default_top_k if sparse_layers else 1)
    if sparse_layers and top_k > num_experts:
        raise ValueError(f"{where}: num_experts_per_tok ({top_k}) exceeds the number of experts ({num_experts})")
    return MoeConfig(num_experts, top_k, intermediate_size, renormalize, sparse_layers, expert_names)


def qwen3_moe_config(config: ModelConfig) -> MoeConfig:
    where = config.model_dir / "config.json"
    # transformers stores num_experts as num_local_experts (its attribute_map): that one counts first.
    num_experts = _int_field(config, "num_local_experts", "num_experts", low=0)
    step = _int_field(config, "decoder_sparse_step", low=1, default=1)
    dense = config.raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ValueError(f"{where}: mlp_only_layers must be a list of layer indices, got {dense!r}")
    sparse = frozenset(i for i in range(config.num_hidden_layers)
                       if num_experts > 0 and i not in dense and (i + 1) % step == 0)
    inter = _int_field(config, "moe_intermediate_size", low=1) if sparse else 0
    renormalize = bool(config.raw.get("norm_topk_prob", False))
    return _moe_config(config, num_experts, inter, renormalize, sparse, QWEN_EXPERT_NAMES, default_top_k=8)


def mixtral_config(config: ModelConfig) -> MoeConfig:
    num_experts = _int_field(config, "num_local_experts", "num_experts", low=1)
    return _moe_config(config, num_experts, config.intermediate_size, True,
                       frozenset(range(config.num_hidden_layers)), MIXTRAL_EXPERT_NAMES, default_top_k=2)
