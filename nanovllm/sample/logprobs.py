"""Log-probabilities of sampled (or prompt) tokens and of the top-k alternatives, as vLLM reports
them: computed from the model's raw logits (before penalties, temperature and truncation).

A step computes them for all rows that asked in one batched pass (`LogprobBlock`): on the CPU one
kernel call (csrc/cpu_sampler.cpp), elsewhere `log_softmax` + `topk` and one device-to-host
transfer. The per-token `{token id: Logprob}` dicts users see are
built only when an output is built (`build_entries`), with every token string of that output
decoded in one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
    # The block as Python lists with every token's string, made at its first output (build_entries):
    # a block is one step's rows of many requests, each of which reads its own row.
    _rows: _HostRows | None = field(default=None, init=False, repr=False, compare=False)

    def host_rows(self, table: TokenTable) -> _HostRows:
        if self._rows is None:
            self._rows = _HostRows(self, table)
        return self._rows


class _HostRows:
    """A LogprobBlock as Python lists, made once: the row-major top-k ids, logprobs and strings,
    and the chosen tokens' ids, logprobs, ranks and strings."""

    __slots__ = ("chosen_ids", "chosen_lps", "chosen_ranks", "chosen_strs", "k", "top_ids", "top_lps", "top_strs",
                 "wanted")

    def __init__(self, block: LogprobBlock, table: TokenTable) -> None:
        self.k = block.top_ids.shape[1]
        # Every string of the block in one call: the top ids row by row, then the chosen ids.
        strings = table.decode_tokens(np.concatenate([block.top_ids.reshape(-1), block.chosen_ids]).astype(np.int32))
        n = block.top_ids.size
        self.top_ids, self.top_lps, self.top_strs = block.top_ids.tolist(), block.top_logprobs.tolist(), strings[:n]
        self.wanted = block.wanted.tolist()
        self.chosen_ids, self.chosen_lps = block.chosen_ids.tolist(), block.chosen_logprob.tolist()
        self.chosen_ranks, self.chosen_strs = block.chosen_rank.tolist(), strings[n:]


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


def build_entries(refs: Sequence[tuple[LogprobBlock, int]], table: TokenTable) -> list[dict[int, Logprob]]:
    """The `{token id: Logprob}` of each (block, row): the row's top-k alternatives plus the chosen
    token itself. Each block is converted to Python (strings included) once, at the first output
    that reads it; an entry then costs its Logprob objects and a dict (the chosen token's object
    serves for its top-k place too)."""
    entries = []
    for block, row in refs:
        h = block._rows or block.host_rows(table)
        chosen = h.chosen_ids[row]
        mine = Logprob(h.chosen_lps[row], h.chosen_ranks[row], h.chosen_strs[row])
        ids, lps, strs, base = h.top_ids[row], h.top_lps[row], h.top_strs, row * h.k
        # Most likely first, the chosen token in its top-k place or else last.
        entry = {}
        for j in range(h.wanted[row]):
            tid = ids[j]
            entry[tid] = mine if tid == chosen else Logprob(lps[j], j + 1, strs[base + j])
        entry[chosen] = mine
        entries.append(entry)
    return entries
