"""Attention backends (`torch` reference, `cuda` kernels) and the per-step metadata they read."""

from nanovllm.attention.backend import AttentionBackend, get_attention_backend
from nanovllm.attention.metadata import (
    AttentionMetadata,
    HostSeqLens,
    make_attention_metadata,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "HostSeqLens",
    "get_attention_backend",
    "make_attention_metadata",
]
