"""Random mixture-of-experts layers and the per-token float64 reference every MoE kernel test
(CPU, Triton interpreted, CUDA) compares against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Case:
    experts: int
    top_k: int
    rows: int
    hidden: int
    inter: int
    renormalize: bool


CASES = [
    Case(1, 1, 7, 40, 24, False),  # one expert
    Case(8, 2, 0, 64, 32, True),  # no rows
    Case(8, 8, 5, 48, 16, False),  # top-k = experts: every expert takes every row
    Case(64, 8, 300, 70, 33, True),  # many experts, 16 divides neither size
    Case(32, 4, 1, 1030, 50, False),  # a decode row: most experts idle; hidden > one 256-deep slice
    Case(16, 3, 150, 264, 40, True),
    Case(5, 1, 13, 300, 17, True),  # top-1 renormalized: weight 1
    Case(2, 2, 200, 48, 40, True),  # 200 rows per expert: past one 144-row block (CPU), 64-row blocks (Triton)
]


def make_weights(c: Case, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c.rows, c.hidden, generator=g)
    logits = 2 * torch.randn(c.rows, c.experts, generator=g)
    w13 = torch.randn(c.experts, 2 * c.inter, c.hidden, generator=g) / c.hidden ** 0.5
    w2 = torch.randn(c.experts, c.hidden, c.inter, generator=g) / c.inter ** 0.5
    return x.to(dtype), logits, w13.to(dtype), w2.to(dtype)


def per_token_reference(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                        renormalize: bool) -> torch.Tensor:
    """Row by row, expert by expert, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    probs = torch.softmax(logits.double(), dim=-1)
    for t in range(x.shape[0]):
        weights, ids = torch.topk(probs[t], top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids.tolist()):
            gate, up = F.linear(x[t].double(), w13[e].double()).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, w2[e].double())
    return out


def case_id(c: Case) -> str:
    return f"E{c.experts}-k{c.top_k}-T{c.rows}-H{c.hidden}-I{c.inter}"


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the reference's largest magnitude (0 for empty outputs)."""
    if not ref.numel():
        return 0.0
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
