"""Mixture-of-experts routing and experts in torch ops: the path for devices and dtypes the CPU
kernel and the Triton kernel do not take, and the reference the CUDA tests compare against."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the router logits `[T, E]` in fp32, then each row's top_k: (ids `[T, top_k]`
    int64, weights `[T, top_k]` fp32, renormalized to sum to 1 if `renormalize`)."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * down(silu(gate(x[t])) * up(x[t])) of expert ids[t, j], per row t; w13
    `[E, 2I, H]` (gate rows first), w2 `[E, H, I]`. One loop step per expert some row chose."""
    return looped_experts(x, ids, weights, lambda rows, e: F.linear(rows, w13[e]), lambda rows, e: F.linear(rows, w2[e]))


def looped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   gate_up: Callable[[torch.Tensor, int], torch.Tensor],
                   down: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """`experts` with each expert's projections given as functions of (rows, expert)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        gate, up = gate_up(x[rows], e).chunk(2, dim=-1)
        y = down(F.silu(gate) * up, e)
        out.index_add_(0, rows, y.float() * weights[rows, slots, None])
    return out.to(x.dtype)
