"""Token sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Order of operations (vLLM's): temperature -> min-p -> top-k -> top-p (its mass measured against
what min-p and top-k kept) -> sample. The rows of a batch are split on the host (no device sync)
into three groups, each done in one batched pass:

* top-k rows: `topk` of the group's largest k gives each row's candidates already sorted; the
  row's own k, then its nucleus (top-p), are cut inside them. No full-vocabulary sort.
* top-p rows without a k: a full descending sort, only for these rows.
* the rest (temperature, maybe min-p): softmax over the whole vocabulary.

Two implementations of these semantics, chosen per call by where the logits are:

* fp32 logits on the CPU: the C++ kernels (csrc/cpu_sampler.cpp, `nanovllm.cpu.sampler`), a row at a time
  in one or two passes: torch's CPU primitives cost a full-vocabulary pass each (argmax alone
  ~150 us for 256 x 512), which made sampling, not the model, the price of a small step. A row
  draws one uniform and walks its kept probabilities, best first, to where their running sum
  passes it (inverse CDF); top-p without k looks at the 64 most likely tokens first and widens
  only while the nucleus is not closed.
* anywhere else (CUDA): torch, in the three groups above. Sampling uses the exponential race:
  argmax(p_i / E_i) with E_i ~ Exp(1) i.i.d. picks token i with probability p_i, and needs no
  cumulative sum or host sync.

A seeded row draws from its own torch.Generator (one uniform per step in the kernels; on the torch
path one per vocabulary entry, read at the row's candidates), so its result depends only on its
seed and how many tokens it sampled before, never on which rows share the batch or how many
candidates they made the group keep. Unseeded rows draw from torch's global generator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from nanovllm.cpu import sampler as cpu_sampler
from nanovllm.staging import to_device

# Temperatures at or below this are treated as greedy (dividing by ~0 would overflow).
GREEDY_EPS = 1e-5


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, on the host: the sampler groups rows without reading the
    device. top_k <= 0 (or >= vocab), top_p >= 1 and min_p <= 0 mean off."""

    temperatures: np.ndarray  # float32 [S]; <= GREEDY_EPS means greedy
    top_k: np.ndarray  # int64 [S]
    top_p: np.ndarray  # float32 [S]
    min_p: np.ndarray  # float32 [S]
    # The seeded rows' generators, by row; the other rows draw from the global RNG.
    generators: Mapping[int, torch.Generator] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return len(self.temperatures)


def make_sampling_batch(
    temperatures: Sequence[float],
    top_k: Sequence[int] | None = None,
    top_p: Sequence[float] | None = None,
    min_p: Sequence[float] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> SamplingBatch:
    """A SamplingBatch from host lists (tests, memory profiling)."""
    n = len(temperatures)
    tk = np.asarray(top_k if top_k is not None else [0] * n, dtype=np.int64)
    tp = np.asarray(top_p if top_p is not None else [1.0] * n, dtype=np.float32)
    mp = np.asarray(min_p if min_p is not None else [0.0] * n, dtype=np.float32)
    if not (len(tk) == len(tp) == len(mp) == n) or (generators is not None and len(generators) != n):
        raise ValueError("all sampling parameter lists must have one entry per row")
    gens = {row: g for row, g in enumerate(generators or ()) if g is not None}
    return SamplingBatch(np.asarray(temperatures, dtype=np.float32), tk, tp, mp, gens)


class Sampler(nn.Module):
    def __init__(self, backend: str | None = None) -> None:
        """`backend`: "cpu" (the C++ kernels), "torch", or None: the kernels wherever the logits
        can take them (fp32 on the CPU), torch otherwise."""
        super().__init__()
        if backend not in (None, "cpu", "torch"):
            raise ValueError(f"unknown sampler backend {backend!r}: 'cpu', 'torch' or None")
        self.backend = backend

    def forward(self, logits: torch.Tensor, batch: SamplingBatch | None) -> torch.Tensor:
        """logits `[S, V]` -> sampled token ids, int64 `[S]`. `batch` None: every row greedy."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        if self.backend == "cpu" or (self.backend is None and cpu_sampler.runs_on(logits)):
            if self.backend == "cpu":
                logits = logits.contiguous()
            # Every row greedy: the kernel's own int64 tensor, read at the rows' stride (a decode
            # step's few calls after the forward each cost tens of us on cold caches).
            return cpu_sampler.argmax(logits) if batch is None else _sample_cpu(logits, batch)
        greedy = logits.argmax(dim=-1)
        if batch is None:
            return greedy
        sampled = batch.temperatures > GREEDY_EPS
        if not sampled.any():
            return greedy
        vocab = logits.shape[1]
        top_k = np.where((batch.top_k > 0) & (batch.top_k < vocab), batch.top_k, 0)
        by_k = sampled & (top_k > 0)
        by_sort = sampled & ~by_k & (batch.top_p < 1.0)
        plain = sampled & ~by_k & ~by_sort
        out = greedy
        for group, kind in ((by_k, "top_k"), (by_sort, "sort"), (plain, "plain")):
            rows = np.flatnonzero(group)
            if len(rows):
                tokens = _sample_rows(logits, rows, kind, batch, top_k)
                out = out.index_copy(0, to_device(rows, logits.device), tokens)
        return out


def _sample_cpu(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if not (batch.temperatures > GREEDY_EPS).any():
        return cpu_sampler.argmax(logits)
    uniform = torch.rand(batch.num_rows, dtype=torch.float64).numpy()
    for row, gen in batch.generators.items():
        uniform[row] = torch.rand(1, generator=gen, dtype=torch.float64).item()
    return torch.from_numpy(cpu_sampler.sample(logits, batch.temperatures, batch.top_k, batch.top_p, batch.min_p,
                                               uniform))


def _sample_rows(logits: torch.Tensor, rows: np.ndarray, kind: str, batch: SamplingBatch,
                 top_k: np.ndarray) -> torch.Tensor:
    dev = logits.device
    x = logits if len(rows) == logits.shape[0] else logits[to_device(rows, dev)]
    x = x / to_device(batch.temperatures[rows], dev)[:, None]
    min_p = batch.min_p[rows]
    if (min_p > 0.0).any():
        x = apply_min_p(x, to_device(min_p, dev))
    top_p = batch.top_p[rows]
    ids = None
    if kind == "top_k":
        k = top_k[rows]
        x, ids = x.topk(int(k.max()), dim=-1)
        x = x.masked_fill(torch.arange(x.shape[1], device=dev)[None, :] >= to_device(k, dev)[:, None], float("-inf"))
    elif kind == "sort":
        x, ids = x.sort(dim=-1, descending=True)
    if ids is not None and (top_p < 1.0).any():
        x = apply_top_p_sorted(x, to_device(top_p, dev))
    probs = torch.softmax(x, dim=-1)
    generators = {}
    if batch.generators:
        seeded = np.flatnonzero(np.isin(rows, np.fromiter(batch.generators, dtype=np.int64)))
        generators = {int(j): batch.generators[int(rows[j])] for j in seeded}
    choice = exponential_race(probs, generators, ids, logits.shape[1])
    return choice if ids is None else ids.gather(1, choice[:, None]).squeeze(1)


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each sampled row draws from, over the whole vocabulary, `[S, V]`:
    temperature, min-p, top-k, top-p, as the sampler applies them (speculative decoding's
    rejection rule needs the probabilities themselves). Rows must not be greedy."""
    dev = logits.device
    x = logits.float() / to_device(batch.temperatures, dev)[:, None]
    if (batch.min_p > 0.0).any():
        x = apply_min_p(x, to_device(batch.min_p, dev))
    vocab = x.shape[1]
    k = np.where((batch.top_k > 0) & (batch.top_k < vocab), batch.top_k, vocab)
    if (k < vocab).any():
        kth = x.topk(int(k.max()), dim=-1).values.gather(1, to_device(k - 1, dev)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    if (batch.top_p < 1.0).any():
        sorted_x, order = x.sort(dim=-1, descending=True)
        x = torch.empty_like(x).scatter_(1, order, apply_top_p_sorted(sorted_x, to_device(batch.top_p, dev)))
    return torch.softmax(x, dim=-1)


def apply_top_p_sorted(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what lies outside each row's nucleus: the smallest prefix of the descending
    row whose probability mass reaches top_p. The most likely token is always kept; rows with
    top_p >= 1 keep everything (cumsum rounding could otherwise drop the tail)."""
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False
    return sorted_logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens whose probability is below min_p times the row's largest: in logit
    space, x < max + log(min_p) (no softmax; min_p 0 masks nothing)."""
    floor = logits.amax(dim=-1, keepdim=True) + torch.log(min_p.to(logits.dtype))[:, None]
    return logits.masked_fill(logits < floor, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: Mapping[int, torch.Generator] | None = None,
                     ids: torch.Tensor | None = None, vocab: int | None = None) -> torch.Tensor:
    """Sample one column per row of (unnormalized) `probs` via argmax(probs / Exp(1) noise).

    Exp(1) noise is -log(U), U uniform in [0, 1): argmax(probs / -log U) = argmin(probs / log U),
    which needs only a uniform draw, one in-place log and one division (several times cheaper
    than `exponential_` on CPU). log U < 0, so zero-probability tokens give 0 and never win
    against a positive probability; U = 0 gives -0, the largest value, likewise never the min.

    `generators`: by row, the seeded rows' own generators.
    `ids` [S, C]: the vocabulary id of each column, when the columns are a row's candidates rather
    than the whole vocabulary (of size `vocab`); a seeded row then draws `vocab` uniforms and takes
    its candidates' ones, so that its draw does not depend on how many candidates the batch kept.
    """
    uniform = torch.rand_like(probs)
    if generators:
        for row, gen in generators.items():
            full = torch.rand(vocab if ids is not None else probs.shape[1], generator=gen, device=probs.device,
                              dtype=probs.dtype)
            uniform[row] = full if ids is None else full[ids[row]]
    return (probs / uniform.log_()).argmin(dim=-1)
