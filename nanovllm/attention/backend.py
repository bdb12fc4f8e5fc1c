"""Choosing an attention backend by name.

A backend is any module (or object) with `write_kv_cache` and `paged_attention` functions of the
signatures in `torch_backend`. "torch" is the reference; "cpu" is the fast CPU path; "cuda" is provided by
`nanovllm.attention.cuda_backend` where the custom kernels are built.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from nanovllm.attention.metadata import AttentionMetadata

_BACKEND_MODULES: dict[str, str] = {
    "torch": "nanovllm.attention.torch_backend",
    "cpu": "nanovllm.attention.cpu_backend",
    "cuda": "nanovllm.attention.cuda_backend",
}


class AttentionBackend(Protocol):
    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def paged_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend module for `name`; ValueError for unknown names, ImportError if not built."""
    if name not in _BACKEND_MODULES:
        raise ValueError(
            f"unknown attention backend {name!r} (available: {sorted(_BACKEND_MODULES)})"
        )
    try:
        module = importlib.import_module(_BACKEND_MODULES[name])
    except ImportError as e:
        raise ImportError(f"attention backend {name!r} is not available: {e}") from e
    return module  # type: ignore[return-value]  # a module satisfies the protocol structurally
