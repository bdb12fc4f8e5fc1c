"""Log-probabilities of sampled (or prompt) tokens and of the top-k alternatives, as vLLM reports
them: computed from the model's raw logits (before penalties, temperature and truncation; after a
grammar's mask, which vLLM applies before its sampler).

A step computes them for all rows that asked in one batched pass (`LogprobBlock`): on the CPU one
kernel call (csrc/cpu_sampler.cpp), elsewhere `log_softmax` + `topk` and one device-to-host
transfer. The per-token `{token id: Logprob}` dicts users see are
built only when an output is built (`build_entries`), a block's rows at once in one C loop, the
strings of a character's parts then corrected as vLLM corrects them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from nanovllm._core import TokenTable
from nanovllm.outputs import Logprob
from nanovllm.cpu import sampler as cpu_sampler
from nanovllm.staging import to_host


@dataclass
class LogprobBlock:
    """For each row: the chosen token's logprob and rank (1 = most likely), the top-k ids and
    logprobs (most likely first), and how many of the top k the row's request asked for."""

    chosen_logprob: np.ndarray  # float64 [R]
    chosen_rank: np.ndarray  # int64 [R]
    top_ids: np.ndarray  # int64 [R, k]
    top_logprobs: np.ndarray  # float64 [R, k]
    chosen_ids: np.ndarray  # int64 [R]
    wanted: np.ndarray  # int64 [R]
    # The `{token id: Logprob}` of every row, made at the block's first output (build_entries): a
    # block is one step's rows of many requests, and converting it whole is cheaper than row by row.
    _entries: list[dict[int, Logprob]] | None = field(default=None, init=False, repr=False, compare=False)
    _partial: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)

    def entries(self, table: TokenTable) -> list[dict[int, Logprob]]:
        """Each row's top-k alternatives (most likely first) plus the chosen token, whose Logprob
        serves its top-k place too (TokenTable.logprob_entries: one C loop, strings remembered)."""
        if self._entries is None:
            self._entries, self._partial = table.logprob_entries(
                np.ascontiguousarray(self.top_ids, dtype=np.int64), np.ascontiguousarray(self.top_logprobs),
                self.chosen_ids, np.ascontiguousarray(self.chosen_logprob), self.chosen_rank, self.wanted, Logprob)
        return self._entries

    def partial(self, row: int) -> bool:
        """Whether a string of row `row` ends in U+FFFD (known once `entries` ran)."""
        return bool(self._partial) and row in self._partial


def gather_logprobs(logits: torch.Tensor, chosen: torch.Tensor, wanted: np.ndarray) -> LogprobBlock:
    """logits [R, V] (raw), chosen [R] token ids, wanted [R] top-k sizes; one device->host transfer."""
    wanted = np.asarray(wanted, dtype=np.int64)
    k = int(wanted.max()) if len(wanted) else 0
    logits = logits.float()
    if cpu_sampler.runs_on(logits):
        ids = to_host(chosen)[0].astype(np.int64, copy=False).reshape(-1)
        return LogprobBlock(*cpu_sampler.logprobs(logits, ids, k), ids, wanted)
    return unpack_logprobs(to_host(logprob_columns(logits, chosen, k))[0], wanted)


def logprob_columns(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """The torch path's logprobs where the logits are (nothing comes back yet): float64
    [R, 3 + 2k] columns chosen logprob, rank, chosen id, top-k logprobs, top-k ids (exact for fp32
    logprobs and for any token id or rank below 2^53), so that one transfer brings them back, with
    the step's tokens (`to_host`); `unpack_logprobs` splits them on the host."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = chosen.view(-1, 1).long()
    chosen_lp = logprobs.gather(1, chosen)
    # Rank 1 is the most likely token; ties count in the chosen token's favour.
    rank = (logprobs > chosen_lp).sum(dim=1, keepdim=True) + 1
    top_lp, top_ids = logprobs.topk(k, dim=1) if k > 0 else (logprobs[:, :0], chosen[:, :0])
    return torch.cat([chosen_lp.double(), rank.double(), chosen.double(), top_lp.double(), top_ids.double()], dim=1)


def unpack_logprobs(a: np.ndarray, wanted: np.ndarray) -> LogprobBlock:
    k = (a.shape[1] - 3) // 2
    return LogprobBlock(a[:, 0], a[:, 1].astype(np.int64), a[:, 3 + k:].astype(np.int64), a[:, 3:3 + k],
                        a[:, 2].astype(np.int64), np.asarray(wanted, dtype=np.int64))


def build_entries(refs: Sequence[tuple[LogprobBlock, int]], table: TokenTable,
                  context: list[tuple[LogprobBlock, int]] | None = None) -> list[dict[int, Logprob]]:
    """The `{token id: Logprob}` of each (block, row) (LogprobBlock.entries), the rows in order
    of one sequence's tokens when `context` is given: the (at most 4) rows before the first,
    which this updates to the last 4. Strings that end in U+FFFD are then corrected from the
    tokens of the rows before them, as vLLM's (`correct_partial`)."""
    entries = [block.entries(table)[row] for block, row in refs]
    if context is None:
        return entries
    fix = [j for j, (block, row) in enumerate(refs) if block.partial(row)]
    if fix:
        ids = [int(block.chosen_ids[row]) for block, row in (*context, *refs)]
        for j in fix:
            at = len(context) + j
            correct_partial(entries[j], ids[max(0, at - 4):at], table)
    context.extend(refs[-4:])
    del context[:-4]
    return entries


def correct_partial(entry: dict[int, Logprob], context: Sequence[int], table: TokenTable) -> None:
    """vLLM's correction of logprob strings that end in U+FFFD (v1/engine/logprobs.py): a token
    that is part of a character gets the text the character's tokens make with the sequence's
    tokens before it (`context`, the last 4, oldest first), or "" while the character is unfinished
    (TokenTable.corrected_string)."""
    for token, lp in entry.items():
        if lp.decoded_token is not None and lp.decoded_token.endswith("\ufffd"):
            entry[token] = replace(lp, decoded_token=table.corrected_string(token, context))
