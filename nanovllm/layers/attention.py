"""The attention layer: write this step's K/V into the paged cache, then attend over the context."""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.attention.backend import AttentionBackend, get_attention_backend
from nanovllm.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged attention for one layer.

    `k_cache` / `v_cache` (`[num_blocks, block_size, num_kv_heads, head_dim]`) are plain tensor
    attributes, not parameters or buffers: the runner allocates one KV tensor for all layers and
    assigns views of it (see `bind_kv_cache`), and they must not appear in the state dict.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        layer_idx: int,
        backend: str = "torch",
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.backend_name = backend
        self.backend: AttentionBackend = get_attention_backend(backend)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def set_backend(self, name: str) -> None:
        self.backend_name = name
        self.backend = get_attention_backend(name)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q `[T, num_heads, head_dim]`, k/v `[T, num_kv_heads, head_dim]` -> `[T, num_heads, head_dim]`."""
        if self.k_cache.numel() == 0:
            raise RuntimeError(
                f"attention layer {self.layer_idx} has no KV cache bound; call bind_kv_cache first"
            )
        self.backend.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.backend.paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)

    def forward_qkv(
        self, qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The layer's attention from the qkv projection's output `[T, (H + 2 Hkv) D]`, with the q/k
        norm (`qk_norm` = (q weight, k weight, eps)) and rotary (`inv_freq`) before it, where the
        backend does all of it in one call (`qkv_attention`: the CPU backend) -> `[T, H, D]`; None
        otherwise (the caller runs the steps and `forward`)."""
        fused = getattr(self.backend, "qkv_attention", None)
        if fused is None or self.k_cache.numel() == 0:
            return None
        out: torch.Tensor | None = fused(qkv, positions, inv_freq, qk_norm, self.k_cache, self.v_cache, meta,
                                         self.scale, self.num_heads, self.num_kv_heads)
        return out

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"backend={self.backend_name}"
        )


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention layers ordered by layer index."""
    layers = sorted(
        (m for m in model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx
    )
    if [m.layer_idx for m in layers] != list(range(len(layers))):
        raise ValueError("attention layer indices are not 0..num_layers-1")
    return layers


def bind_kv_cache(model: nn.Module, kv_cache: torch.Tensor) -> None:
    """Point every attention layer at its slice of `kv_cache`.

    `kv_cache` is `[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]` and must be
    contiguous: layer i gets `k_cache = kv_cache[0, i]`, `v_cache = kv_cache[1, i]` (views, so
    writes land in `kv_cache`).
    """
    layers = attention_layers(model)
    if kv_cache.dim() != 6 or kv_cache.shape[0] != 2 or kv_cache.shape[1] != len(layers):
        raise ValueError(
            f"kv_cache must be [2, num_layers={len(layers)}, num_blocks, block_size, kv_heads, "
            f"head_dim], got {list(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    for layer in layers:
        expected = (layer.num_kv_heads, layer.head_dim)
        if tuple(kv_cache.shape[4:]) != expected:
            raise ValueError(
                f"kv_cache heads/head_dim {tuple(kv_cache.shape[4:])} != layer's {expected}"
            )
        layer.k_cache = kv_cache[0, layer.layer_idx]
        layer.v_cache = kv_cache[1, layer.layer_idx]
