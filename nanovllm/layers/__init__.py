"""Model building blocks: linear layers with weight loaders, norms, rotary, attention."""

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention, attention_layers, bind_kv_cache
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from nanovllm.layers.rotary_embedding import RotaryEmbedding

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "attention_layers",
    "bind_kv_cache",
]
