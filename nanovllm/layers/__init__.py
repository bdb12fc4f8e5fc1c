"""Model building blocks: linear layers with weight loaders, norms, rotary, attention, sampler."""

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
from nanovllm.layers.sampler import Sampler, SamplingBatch, make_sampling_batch

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
    "Sampler",
    "SamplingBatch",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "attention_layers",
    "bind_kv_cache",
    "make_sampling_batch",
]
