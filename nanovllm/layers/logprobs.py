"""Log-probabilities of sampled tokens and of the top-k alternatives, as vLLM reports them:
computed from the model's raw logits (before penalties, temperature and truncation)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class TokenLogprobs:
    """For each row: the chosen token's logprob and rank, and the top-k ids and logprobs."""

    chosen_logprob: list[float]
    chosen_rank: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def gather_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> TokenLogprobs:
    """logits [R, V] (raw), chosen [R] token ids; one device->host transfer for all of it."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = logprobs.gather(1, chosen.view(-1, 1).long())
    # Rank 1 is the most likely token; ties count in the chosen token's favour.
    rank = (logprobs > chosen_lp).sum(dim=1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=1) if k > 0 else (logprobs[:, :0], chosen.view(-1, 1)[:, :0].long())
    # One transfer: everything as float64 columns (exact for fp32 logprobs and for any token id or
    # rank below 2^53), split back apart on the host.
    packed = torch.cat([chosen_lp.double(), rank.view(-1, 1).double(), top_lp.double(), top_ids.double()], dim=1)
    a = packed.cpu().numpy()
    ints = a[:, [1, *range(2 + k, 2 + 2 * k)]].astype(np.int64)  # rank, then the top ids
    return TokenLogprobs(
        chosen_logprob=a[:, 0].tolist(),
        chosen_rank=ints[:, 0].tolist(),
        top_ids=ints[:, 1:].tolist(),
        top_logprobs=a[:, 2:2 + k].tolist(),
    )
