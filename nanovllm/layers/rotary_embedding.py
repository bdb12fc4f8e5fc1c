"""Rotary position embedding (neox / rotate-half style, as in Llama, Qwen2, Qwen3).

cos/sin are computed from the positions on the fly in fp32 (a [T, head_dim/2] outer product is
cheap next to the matmuls) so there is no maximum-length cache to size, and the angles are
bit-identical to transformers' which computes them the same way. On CPU a fused C++ pass
(nanovllm.cpu.fused_ops) replaces the ~10 torch ops; its cos/sin come from libm, which may differ
from torch's vectorized ones in the last bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanovllm.cpu import fused_ops
from nanovllm.model_config import RopeConfig


def _default_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _needed(scaling: dict[str, Any], key: str, rope_type: str) -> float:
    try:
        return float(scaling[key])
    except KeyError:
        raise ValueError(f"{rope_type} rope scaling is missing key {key!r}") from None


def _linear_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Position interpolation: every angle divided by `factor` (transformers' "linear")."""
    return _default_inv_freq(head_dim, theta, scaling) / _needed(scaling, "factor", "linear")


def _yarn_factor(scaling: dict[str, Any]) -> float:
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-V3's form: the ratio of the two lengths
        return _needed(scaling, "max_position_embeddings", "yarn") / _needed(
            scaling, "original_max_position_embeddings", "yarn")
    return float(factor)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters): the angles of dimensions that turn fewer than
    beta_slow times over the original length divided by `factor`, those that turn more than
    beta_fast times kept, a linear ramp between."""
    factor = _yarn_factor(scaling)
    old_len = _needed(scaling, "original_max_position_embeddings", "yarn")
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # the share of the unscaled angle
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(rope: RopeConfig) -> float:
    """What YaRN multiplies cos and sin by (transformers' attention_factor; 1 for the other
    types). Attention applies it squared to its softmax scale instead: q and k each carry it once."""
    if rope.rope_type != "yarn":
        return 1.0
    s = rope.scaling
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = _yarn_factor(s)
    if s.get("mscale") and s.get("mscale_all_dim"):
        return _yarn_mscale(factor, float(s["mscale"])) / _yarn_mscale(factor, float(s["mscale_all_dim"]))
    return _yarn_mscale(factor)


def _llama3_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp between."""
    inv_freq = _default_inv_freq(head_dim, theta, scaling)
    factor = _needed(scaling, "factor", "llama3")
    low = _needed(scaling, "low_freq_factor", "llama3")
    high = _needed(scaling, "high_freq_factor", "llama3")
    old_len = _needed(scaling, "original_max_position_embeddings", "llama3")
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


_INV_FREQ: dict[str, Callable[[int, float, dict[str, Any]], torch.Tensor]] = {
    "default": _default_inv_freq,
    "linear": _linear_inv_freq,
    "llama3": _llama3_inv_freq,
    "yarn": _yarn_inv_freq,
}


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        if rope.rope_type not in _INV_FREQ:
            raise ValueError(
                f"unsupported rope type {rope.rope_type!r} (supported: {sorted(_INV_FREQ)})"
            )
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        if float(rope.scaling.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        self.head_dim = head_dim
        self.rope = rope
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", self._compute_inv_freq(), persistent=False)

    def _compute_inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        inv = _INV_FREQ[self.rope.rope_type](self.head_dim, self.rope.theta, self.rope.scaling)
        return inv.to(device=device, dtype=torch.float32)

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> RotaryEmbedding:
        # model.to(bfloat16) would round inv_freq; recompute it in fp32 on the new device instead.
        super()._apply(fn, recurse)
        self.inv_freq = self._compute_inv_freq(self.inv_freq.device)
        return self

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[T]`; q `[T, Hq, D]`, k `[T, Hkv, D]` -> rotated (q, k), same dtypes. On CPU
        (fp32, bf16) one C++ pass rotates q and k in place and returns them."""
        if fused_ops.try_rotary_(positions, q, k, self.inv_freq):
            return q, k
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(q.dtype)[:, None, :]
        sin = emb.sin().to(q.dtype)[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.rope.theta}, type={self.rope.rope_type}"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
