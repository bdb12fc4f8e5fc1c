"""Per-request logit adjustments, applied on the device in one batched pass per kind:
repetition / presence / frequency penalties, logit bias, and min_tokens (stop tokens masked
until a sequence has generated enough). Rows that ask for none of these are never touched."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PenaltyRows:
    """The rows of a step's logits that carry penalties, with what the penalties read."""

    rows: list[int]
    prompt_tokens: list[Sequence[int]]
    output_tokens: list[Sequence[int]]
    presence: list[float]
    frequency: list[float]
    repetition: list[float]


def _padded(seqs: list[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as one [rows, longest] tensor plus a validity mask (padding points at 0)."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.zeros((len(seqs), max(width, 1)), dtype=torch.int64)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.int64)
        mask[i, : len(s)] = True
    return ids.to(device), mask.to(device)


def apply_penalties(logits: torch.Tensor, p: PenaltyRows) -> None:
    """In place. Repetition divides positive (multiplies negative) logits of every token seen in
    the prompt or output; frequency subtracts count * penalty and presence subtracts the penalty
    once for each token seen in the output (vLLM's / OpenAI's definitions)."""
    if not p.rows:
        return
    dev = logits.device
    vocab = logits.shape[1]
    rows = torch.as_tensor(p.rows, dtype=torch.int64, device=dev)
    sub = logits[rows]
    out_ids, out_mask = _padded(p.output_tokens, dev)
    counts = torch.zeros((len(p.rows), vocab), dtype=sub.dtype, device=dev)
    counts.scatter_add_(1, out_ids, out_mask.to(sub.dtype))
    prompt_ids, prompt_mask = _padded(p.prompt_tokens, dev)
    # Counting (not scattering booleans) keeps padding, which points at token 0, harmless.
    in_prompt = torch.zeros_like(counts).scatter_add_(1, prompt_ids, prompt_mask.to(sub.dtype))
    seen = (counts > 0) | (in_prompt > 0)
    rep = torch.as_tensor(p.repetition, dtype=sub.dtype, device=dev)[:, None]
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    freq = torch.as_tensor(p.frequency, dtype=sub.dtype, device=dev)[:, None]
    pres = torch.as_tensor(p.presence, dtype=sub.dtype, device=dev)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    logits[rows] = sub


def apply_logit_bias(logits: torch.Tensor, rows: list[int], biases: list[dict[int, float]]) -> None:
    """In place: adds each row's {token id: bias}."""
    if not rows:
        return
    r, t, b = [], [], []
    for row, bias in zip(rows, biases):
        for token, value in bias.items():
            r.append(row)
            t.append(token)
            b.append(value)
    dev = logits.device
    idx = (torch.as_tensor(r, device=dev), torch.as_tensor(t, device=dev))
    logits.index_put_(idx, torch.as_tensor(b, dtype=logits.dtype, device=dev), accumulate=True)


def mask_tokens(logits: torch.Tensor, rows: list[int], tokens: list[Sequence[int]]) -> None:
    """In place: makes the given tokens of each row impossible (min_tokens hides stop tokens)."""
    r = [row for row, toks in zip(rows, tokens) for _ in toks]
    if not r:
        return
    t = [tok for toks in tokens for tok in toks]
    dev = logits.device
    logits[torch.as_tensor(r, device=dev), torch.as_tensor(t, device=dev)] = float("-inf")
