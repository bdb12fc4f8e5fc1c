"""Token sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Order of operations (as in Hugging Face's warpers): temperature -> top-k -> top-p -> min-p ->
sample. Sampling uses the exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) i.i.d. picks
token i with probability p_i, and needs no cumulative sum or host sync. A seeded row draws its E
from its own torch.Generator, so its result depends only on its seed (and how many tokens it has
sampled before), never on which other rows share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

# Temperatures at or below this are treated as greedy (dividing by ~0 would overflow).
GREEDY_EPS = 1e-5


@dataclass
class SamplingBatch:
    """Per-row sampling parameters on the logits' device, plus host-side flags.

    The flags let the sampler skip whole stages (e.g. the vocab sort when no row uses top-k or
    top-p) without reading device tensors back, which would synchronize with the GPU.
    """

    temperatures: torch.Tensor  # float32 [S]; <= GREEDY_EPS means greedy
    top_k: torch.Tensor  # int64 [S]; <= 0 means off
    top_p: torch.Tensor  # float32 [S]; >= 1 means off
    min_p: torch.Tensor  # float32 [S]; <= 0 means off
    generators: Sequence[torch.Generator | None] | None = None  # per row; None = global RNG
    all_greedy: bool = False
    any_top_k: bool = True
    any_top_p: bool = True
    any_min_p: bool = True

    @property
    def num_rows(self) -> int:
        return self.temperatures.shape[0]


def make_sampling_batch(
    temperatures: Sequence[float],
    top_k: Sequence[int] | None = None,
    top_p: Sequence[float] | None = None,
    min_p: Sequence[float] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    device: torch.device | str = "cpu",
) -> SamplingBatch:
    """Build a SamplingBatch from host lists, computing the flags on the host."""
    n = len(temperatures)
    tk = list(top_k) if top_k is not None else [0] * n
    tp = list(top_p) if top_p is not None else [1.0] * n
    mp = list(min_p) if min_p is not None else [0.0] * n
    if not (len(tk) == len(tp) == len(mp) == n) or (
        generators is not None and len(generators) != n
    ):
        raise ValueError("all sampling parameter lists must have one entry per row")
    sampled = [t > GREEDY_EPS for t in temperatures]
    return SamplingBatch(
        temperatures=torch.tensor(list(temperatures), dtype=torch.float32, device=device),
        top_k=torch.tensor(tk, dtype=torch.int64, device=device),
        top_p=torch.tensor(tp, dtype=torch.float32, device=device),
        min_p=torch.tensor(mp, dtype=torch.float32, device=device),
        generators=list(generators) if generators is not None else None,
        all_greedy=not any(sampled),
        any_top_k=any(s and k > 0 for s, k in zip(sampled, tk)),
        any_top_p=any(s and p < 1.0 for s, p in zip(sampled, tp)),
        any_min_p=any(s and m > 0.0 for s, m in zip(sampled, mp)),
    )


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits `[S, V]` -> sampled token ids, int64 `[S]`."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy
        is_greedy = batch.temperatures <= GREEDY_EPS
        temps = torch.where(is_greedy, torch.ones_like(batch.temperatures), batch.temperatures)
        logits = logits / temps[:, None]
        if batch.any_top_k or batch.any_top_p:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        if batch.any_min_p:
            probs = apply_min_p(probs, batch.min_p)
        sampled = exponential_race(probs, batch.generators)
        return torch.where(is_greedy, greedy, sampled)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus.

    Works in sorted order: one descending sort serves both filters. The nucleus is the smallest
    prefix whose probability mass reaches top_p; the most likely token is always kept.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    # Rows with top_p >= 1 keep everything (cumsum rounding could otherwise drop the tail).
    drop_p = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop_p[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop_p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens whose probability is below min_p times the row's largest probability."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return probs.masked_fill(probs < threshold, 0.0)


def exponential_race(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None] | None = None
) -> torch.Tensor:
    """Sample one index per row from (unnormalized) `probs` via argmax(probs / Exp(1) noise).

    Exp(1) noise is -log(U), U uniform in [0, 1): argmax(probs / -log U) = argmin(probs / log U),
    which needs only a uniform draw, one in-place log and one division (several times cheaper
    than `exponential_` on CPU). log U < 0, so zero-probability tokens give 0 and never win
    against a positive probability; U = 0 gives -0, the largest value, likewise never the min.
    """
    uniform = torch.rand_like(probs)
    if generators is not None:
        for row, gen in enumerate(generators):
            if gen is not None:
                uniform[row] = torch.rand(probs.shape[1], generator=gen, device=probs.device, dtype=probs.dtype)
    return (probs / uniform.log_()).argmin(dim=-1)
