"""The persistent per-sequence sampling state (vLLM calls the same idea its InputBatch).

A sequence's row is written once when it is admitted (`add`), copied when it forks (`fork`),
updated by one vectorized call per step (`record`: output counts for penalties, tokens emitted)
and dropped when it ends (`remove`). A step gathers its batch's parameters with one fancy index
per column, so its cost grows with the batch, never with the sequences' lengths:

* repetition / presence / frequency penalties read a dense `[2, vocab]` row per penalized sequence:
  the prompt's token presence (computed once at admission) and the output tokens' counts (one
  scatter-add per step for all penalized rows);
* logit bias is a dense `[vocab]` row per biased sequence, added in one indexed add;
* min_tokens masks each sequence's stop tokens (its stop ids, plus EOS unless ignore_eos) while
  it has produced fewer tokens than asked, from a padded `[rows, stops]` id table;
* bad words mask, in a sequence that has them, each token that would complete one of its words'
  token sequences after its last output tokens (`BadWords`, host lists: a few rows at most);
* structured output keeps, in a sequence with a grammar, only the tokens its grammar allows next
  (`GrammarRows`: one bitmask fill and one masking call per step for all constrained rows), and
  advances its grammar with each sampled token.

Preemption needs nothing here: a recomputed sequence keeps its generated tokens, so its counts
stay right. Rows of sequences that never ask for penalties or bias cost nothing but a few columns.

`users` counts the live sequences that sample (temperature > 0), want logprobs, or need their
logits processed; a step whose whole state has none of them gathers no columns at all. After a
model forward the caches are cold and each small numpy or torch call costs tens of microseconds,
so a greedy step that skips them is measurably faster (benchmarks/step_overhead.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanovllm.cpu import sampler as cpu_sampler
from nanovllm.row_columns import RowColumns
from nanovllm.sample.rows import DenseRows
from nanovllm.sample.sampler import GREEDY_EPS, SamplingBatch
from nanovllm.sampling_params import SamplingParams
from nanovllm.staging import to_device

if TYPE_CHECKING:
    import xgrammar as xgr

    from nanovllm.sample.structured import GrammarRows
    from nanovllm.sample.utf8 import Utf8Tokens

COLUMNS = {
    "temperature": (np.float32, 1.0),
    "top_k": (np.int64, 0),            # 0: off
    "top_p": (np.float32, 1.0),
    "min_p": (np.float32, 0.0),
    "seeded": (bool, False),           # has its own generator
    "logprobs": (np.int64, -1),        # top-k logprobs to report; -1: none
    "presence": (np.float32, 0.0),
    "frequency": (np.float32, 0.0),
    "repetition": (np.float32, 1.0),
    "min_tokens": (np.int64, 0),
    "num_output": (np.int64, 0),       # tokens sampled so far (counted while any row has processors)
    "penalty_slot": (np.int64, -1),    # DenseRows slot of [prompt presence, output counts]
    "bias_slot": (np.int64, -1),       # DenseRows slot of the logit bias
    "stop_row": (np.int64, -1),        # row of `_stop_ids` masked until min_tokens
    "constrained": (bool, False),      # has a grammar (a matcher in `grammars`)
    "bad_words": (bool, False),        # has bad words (a BadWords in `bad_words`)
    "counted": (bool, False),          # in the `users` counts
}


class SamplingState:
    def __init__(self, device: torch.device, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.rows = RowColumns(COLUMNS)
        self.generators: dict[int, torch.Generator] = {}
        self._penalties = DenseRows((2, vocab_size), device)
        self._bias = DenseRows((vocab_size,), device)
        # Built with the first constrained sequence: xgrammar is imported only when structured
        # output is used (it is an optional dependency where the engine runs without it).
        self.grammars: GrammarRows | None = None
        self.bad_words: dict[int, BadWords] = {}
        # Stop ids masked while min_tokens is not reached, -1 padded; rows recycled through a free list.
        self._stop_ids = np.full((0, 1), -1, dtype=np.int64)
        self._free_stop_rows: list[int] = []
        self.users = FeatureUsers()

    # Lifecycle ----------------------------------------------------------------------------------

    def add(self, sid: int, params: SamplingParams, prompt_token_ids: list[int],
            grammar: xgr.CompiledGrammar | None = None, logprobs: int | None = None,
            grammar_utf8: Utf8Tokens | None = None) -> None:
        """Admit a sequence: its parameters, its seeded generator, the rows its filters read and
        its grammar (`params.structured_outputs` compiled; `grammar_utf8`: its vocabulary's UTF-8
        tables where the compiler built them already). `logprobs` overrides the params'."""
        r = self.rows
        r.reset(sid)
        r.temperature[sid] = params.temperature
        r.top_k[sid] = params.top_k if 0 < params.top_k < self.vocab_size else 0
        r.top_p[sid] = params.top_p
        r.min_p[sid] = params.min_p
        if logprobs is None:
            logprobs = params.logprobs
        r.logprobs[sid] = -1 if logprobs is None else logprobs
        r.min_tokens[sid] = params.min_tokens
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self.generators[sid] = gen
            r.seeded[sid] = True
        if params.has_penalties:
            r.presence[sid] = params.presence_penalty
            r.frequency[sid] = params.frequency_penalty
            r.repetition[sid] = params.repetition_penalty
            slot = r.penalty_slot[sid] = self._penalties.acquire()
            ids = to_device(prompt_token_ids, self.device, np.int64)
            self._penalties.data[slot, 0, ids] = 1.0
        if params.logit_bias or params.allowed_token_ids:
            # One row of additions: -inf outside allowed_token_ids, then the logit bias.
            slot = r.bias_slot[sid] = self._bias.acquire()
            row = self._bias.data[slot]
            if params.allowed_token_ids:
                row.fill_(float("-inf"))
                row[to_device(params.allowed_token_ids, self.device, np.int64)] = 0.0
            if params.logit_bias:
                tokens = to_device(list(params.logit_bias), self.device, np.int64)
                values = to_device(list(params.logit_bias.values()), self.device, np.float32)
                row.index_put_((tokens,), values, accumulate=True)
        if params.min_tokens > 0:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if stops:
                r.stop_row[sid] = self._take_stop_row(sorted(stops))
        if params.bad_words_token_ids:
            self.bad_words[sid] = BadWords([tuple(ids) for ids in params.bad_words_token_ids])
            r.bad_words[sid] = True
        if grammar is not None:
            if self.grammars is None:
                from nanovllm.sample.structured import GrammarRows

                self.grammars = GrammarRows(self.vocab_size, self.device)
            if grammar_utf8 is not None:
                self.grammars.use_utf8(grammar_utf8)
            self.grammars.add(sid, grammar)
            r.constrained[sid] = True
        self._count(sid, 1)

    def fork(self, parent: int, child: int, index: int = 1) -> None:
        """`child`, the request's sample number `index`, continues from `parent` (n > 1): same
        parameters, its own copies of the penalty and bias rows and of the grammar's state, and,
        when seeded, its own generator derived from (seed, index): a generator shared with its
        siblings would hand out draws in whatever order the scheduler runs them (preemption),
        so the tokens would depend on the batch."""
        r = self.rows
        r.copy_row(parent, child)
        r.counted[child] = False  # until the whole row is taken (remove() after a failure)
        if parent in self.generators:
            gen = torch.Generator(device=self.device)
            gen.manual_seed((self.generators[parent].initial_seed() + index * 0x9E3779B97F4A7C15) % 2**64)
            self.generators[child] = gen
        if r.penalty_slot[parent] >= 0:
            r.penalty_slot[child] = self._penalties.copy(int(r.penalty_slot[parent]))
        if r.bias_slot[parent] >= 0:
            r.bias_slot[child] = self._bias.copy(int(r.bias_slot[parent]))
        if r.stop_row[parent] >= 0:
            ids = self._stop_ids[r.stop_row[parent]]
            r.stop_row[child] = self._take_stop_row(ids[ids >= 0].tolist())
        if r.constrained[parent]:
            assert self.grammars is not None
            self.grammars.fork(parent, child)
        if r.bad_words[parent]:
            self.bad_words[child] = self.bad_words[parent].copy()
        self._count(child, 1)

    def remove(self, sid: int) -> None:
        r = self.rows
        if r.counted[sid]:
            self._count(sid, -1)
        self.generators.pop(sid, None)
        self.bad_words.pop(sid, None)
        if r.constrained[sid]:
            assert self.grammars is not None
            self.grammars.remove(sid)
        if r.penalty_slot[sid] >= 0:
            self._penalties.release(int(r.penalty_slot[sid]))
        if r.bias_slot[sid] >= 0:
            self._bias.release(int(r.bias_slot[sid]))
        if r.stop_row[sid] >= 0:
            self._free_stop_rows.append(int(r.stop_row[sid]))
        r.reset(sid)

    def _count(self, sid: int, delta: int) -> None:
        r = self.rows
        r.counted[sid] = delta > 0
        u = self.users
        u.sampled += delta * bool(r.temperature[sid] > GREEDY_EPS)
        u.logprobs += delta * bool(r.logprobs[sid] >= 0)
        u.processed += delta * bool(r.penalty_slot[sid] >= 0 or r.bias_slot[sid] >= 0 or r.stop_row[sid] >= 0
                                    or r.constrained[sid] or r.bad_words[sid])

    def _take_stop_row(self, ids: list[int]) -> int:
        if len(ids) > self._stop_ids.shape[1]:
            pad = np.full((self._stop_ids.shape[0], len(ids) - self._stop_ids.shape[1]), -1, dtype=np.int64)
            self._stop_ids = np.concatenate([self._stop_ids, pad], axis=1)
        if not self._free_stop_rows:
            size = self._stop_ids.shape[0]
            extra = max(8, size)
            self._stop_ids = np.concatenate([self._stop_ids, np.full((extra, self._stop_ids.shape[1]), -1, np.int64)])
            self._free_stop_rows.extend(range(size + extra - 1, size - 1, -1))
        row = self._free_stop_rows.pop()
        self._stop_ids[row] = -1
        self._stop_ids[row, : len(ids)] = ids
        return row

    # The step -----------------------------------------------------------------------------------

    def batch(self, sids: np.ndarray) -> SamplingBatch | None:
        """The sampler's parameters for rows `sids` (a sequence may repeat: n samples of a prompt);
        None when no live sequence samples (every row is greedy)."""
        if not self.users.sampled:
            return None
        r = self.rows
        generators = {}
        if self.generators:
            seeded = np.flatnonzero(r.seeded[sids])
            generators = {int(row): self.generators[int(sids[row])] for row in seeded}
        return SamplingBatch(r.temperature[sids], r.top_k[sids], r.top_p[sids], r.min_p[sids], generators)

    def mask_grammars(self, logits: torch.Tensor, sids: np.ndarray) -> bool:
        """The grammars' masks of rows `sids` that have one, in place, before any other processing:
        as vLLM's, a constrained request's logprobs are those of the masked distribution (a forced
        token has logprob 0). Whether any row had one."""
        grammars = self.grammars
        if grammars is None or not grammars.matchers:
            return False
        rows = np.flatnonzero(self.rows.constrained[sids])
        if not len(rows):
            return False
        grammars.mask(logits, rows, sids[rows])
        return True

    def process(self, logits: torch.Tensor, sids: np.ndarray, keep_input: bool = True) -> torch.Tensor:
        """Logit bias (allowed_token_ids too), then penalties (vLLM's order: a repetition penalty
        scales the biased logit), min_tokens masking and bad words for the rows that ask. With
        `keep_input` the input stays untouched (the raw logits logprobs are computed from): it is
        returned as is when no row asks, else a processed copy; without it, it is processed in
        place (no copy of [rows, vocab] floats when no row wants logprobs)."""
        if not self.users.processed:
            return logits
        r = self.rows
        pen_slots = r.penalty_slot[sids]
        bias_slots = r.bias_slot[sids]
        stop_rows = r.stop_row[sids]
        masked = (stop_rows >= 0) & (r.num_output[sids] < r.min_tokens[sids])
        pen_rows = np.flatnonzero(pen_slots >= 0)
        bias_rows = np.flatnonzero(bias_slots >= 0)
        mask_rows = np.flatnonzero(masked)
        banned = self._banned(sids) if self.bad_words else None
        if not (len(pen_rows) or len(bias_rows) or len(mask_rows) or banned):
            return logits
        if keep_input:
            logits = logits.clone()
        dev = logits.device
        if len(bias_rows):
            rows = to_device(bias_rows, dev)
            logits[rows] += self._bias.data[to_device(bias_slots[bias_rows], dev)]
        if len(pen_rows):
            s = sids[pen_rows]
            if cpu_sampler.runs_on(logits):
                cpu_sampler.apply_penalties(logits, pen_rows, self._penalties.data, pen_slots[pen_rows],
                                            r.repetition[s], r.frequency[s], r.presence[s])
            else:
                rows = to_device(pen_rows, dev)
                slots = to_device(pen_slots[pen_rows], dev)
                apply_penalties(logits, rows, self._penalties.data[slots], r.repetition[s], r.frequency[s],
                                r.presence[s])
        if len(mask_rows):
            ids = self._stop_ids[stop_rows[mask_rows]]
            valid = ids >= 0
            rows = np.broadcast_to(mask_rows[:, None], ids.shape)[valid]
            logits[to_device(rows, dev), to_device(ids[valid], dev)] = float("-inf")
        if banned:
            rows, ids = banned
            logits[to_device(rows, dev), to_device(ids, dev)] = float("-inf")
        return logits

    def _banned(self, sids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, token ids) that bad words forbid at rows `sids`; None where none."""
        rows: list[int] = []
        ids: list[int] = []
        for row in np.flatnonzero(self.rows.bad_words[sids]).tolist():
            banned = self.bad_words[int(sids[row])].banned()
            rows += [row] * len(banned)
            ids += banned
        return (np.array(rows, dtype=np.int64), np.array(ids, dtype=np.int64)) if rows else None

    def record(self, sids: np.ndarray, tokens: torch.Tensor | None, host_tokens: np.ndarray) -> GrammarEnds:
        """The tokens just sampled for rows `sids` (each sequence at most once), on the device and on
        the host; the device's None where nothing is processed (the greedy head's steps, which give
        them on the host only). Returns the sequences whose grammar ended or rejected its token."""
        ends = GrammarEnds()
        if not self.users.processed:  # nothing reads the counts below
            return ends
        r = self.rows
        grammars = self.grammars
        if grammars is not None and grammars.matchers:
            rows = np.flatnonzero(r.constrained[sids])
            if len(rows):
                ends = GrammarEnds(*grammars.accept(sids[rows], host_tokens[rows]))
                # A stop token min_tokens masked was drawn from a row with nothing left: the grammar
                # allowed only its end (which it then accepts), so the row had no token to give.
                held = rows[(r.stop_row[sids[rows]] >= 0) & (r.num_output[sids[rows]] < r.min_tokens[sids[rows]])]
                for row in held.tolist():
                    sid = int(sids[row])
                    if sid in ends.terminated and int(host_tokens[row]) in self._stop_ids[r.stop_row[sid]]:
                        ends.terminated.remove(sid)
                        ends.rejected.append(sid)
        r.num_output[sids] += 1
        if self.bad_words:
            for row in np.flatnonzero(r.bad_words[sids]).tolist():
                self.bad_words[int(sids[row])].append(int(host_tokens[row]))
        slots = r.penalty_slot[sids]
        rows = np.flatnonzero(slots >= 0)
        if len(rows):
            dev = self._penalties.data.device
            idx = to_device(rows, dev)
            assert tokens is not None, "penalties are processing: the tokens come from the sampler, on the device"
            self._penalties.data.index_put_(
                (to_device(slots[rows], dev), torch.ones_like(idx), tokens[idx].to(dev)),
                torch.ones(len(rows), device=dev), accumulate=True)
        return ends


@dataclass
class BadWords:
    """A sequence's bad words as token sequences, and its last output tokens (as many as the
    longest sequence's prefix): a word's last token is banned where the output ends with the rest
    of it (vLLM's rule; the prompt does not count)."""

    words: list[tuple[int, ...]]
    recent: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._keep = max(map(len, self.words)) - 1

    def banned(self) -> list[int]:
        recent = self.recent
        return [w[-1] for w in self.words if len(w) - 1 <= len(recent)
                and (len(w) == 1 or tuple(recent[len(recent) - len(w) + 1:]) == w[:-1])]

    def append(self, token: int) -> None:
        if self._keep:
            self.recent.append(token)
            del self.recent[:-self._keep]

    def copy(self) -> BadWords:
        return BadWords(self.words, list(self.recent))


@dataclass
class FeatureUsers:
    """Live sequences that sample (temperature > 0), want logprobs, or have logits processors
    (penalties, logit bias, min_tokens, a grammar)."""

    sampled: int = 0
    logprobs: int = 0
    processed: int = 0


@dataclass
class GrammarEnds:
    """What a step's tokens did to the grammars: sequences whose grammar terminated (a finished
    output: the sequence stops), and sequences whose token the grammar rejected (it had no token
    left to allow, e.g. min_tokens masked the only one, EOS: the sequence cannot go on)."""

    terminated: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, seen: torch.Tensor, repetition: np.ndarray,
                    frequency: np.ndarray, presence: np.ndarray) -> None:
    """In place on logits[rows]. `seen` is [rows, 2, vocab]: prompt presence, output counts.
    Repetition divides positive (multiplies negative) logits of every token seen in the prompt or
    the output; frequency subtracts count * penalty and presence subtracts the penalty once for each
    token in the output (vLLM's / OpenAI's definitions). A term no row uses is skipped."""
    dev = logits.device
    sub = logits[rows]
    counts = seen[:, 1]
    in_output = counts > 0
    if (repetition != 1.0).any():
        rep = to_device(repetition, dev)[:, None]
        sub = torch.where(in_output | (seen[:, 0] > 0), torch.where(sub > 0, sub / rep, sub * rep), sub)
    if (frequency != 0.0).any():
        sub -= to_device(frequency, dev)[:, None] * counts
    if (presence != 0.0).any():
        sub -= to_device(presence, dev)[:, None] * in_output
    logits[rows] = sub
