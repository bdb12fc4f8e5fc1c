"""What crosses between the engine and the model runner in a step, one way each: the scheduler's
output goes in (`SchedulerOutput`: the core's StepPlan plus the sampling-state changes since the
last step), the runner's output comes back (`RunnerOutput`). See docs/design.md, "The step".

The sampling state lives with the runner (it is read on the device every step); the engine tells
it about admissions, forks and finished sequences only through the plan, as vLLM's scheduler
output carries new and finished requests to its workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from nanovllm.sample.logprobs import LogprobBlock
from nanovllm.sample.state import GrammarEnds
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm._C import StepPlan


@dataclass(frozen=True)
class Admission:
    """A sequence the runner has not seen: its sampling parameters, prompt (what penalties read)
    and compiled grammar. A prompt with n > 1 samples names the ids its other n - 1 samples take
    when its first token fans out (`children`)."""

    seq_id: int
    params: SamplingParams
    prompt_token_ids: list[int]
    grammar: Any = None  # xgrammar.CompiledGrammar (xgrammar is imported only when used)
    grammar_utf8: Any = None  # the vocabulary's UTF-8 tables (sample/utf8.py), if its compiler built them
    children: tuple[int, ...] = ()
    # Beam search: > 0 reports this many top logprobs each step (past SamplingParams' limit of 20),
    # of the raw logits.
    candidates: int = 0


@dataclass
class SchedulerOutput:
    plan: StepPlan
    # Applied by the runner before the step, in this order: fork, drop, admit.
    finished: list[int] = field(default_factory=list)
    admitted: list[Admission] = field(default_factory=list)
    # (parent, child, sample index): forks decided outside the runner (beam search); the runner's
    # own n > 1 fan-out comes back in RunnerOutput.forks instead.
    forked: list[tuple[int, int, int]] = field(default_factory=list)
    # A draft model proposes for this step's sampled rows only while the core drafts (it stops at
    # disable_by_batch_size sequences): its k decode passes would be wasted.
    propose_drafts: bool = True


@dataclass
class PromptLogprobRows:
    """Prompt logprobs computed this step: entry i (a row of a LogprobBlock) is the logprob of
    prompt token `positions[i]` of sequence `seq_ids[i]` given the tokens before it, with its top
    alternatives; a sequence's entries come in position order."""

    refs: list[tuple[LogprobBlock, int]]
    seq_ids: np.ndarray  # int64 [L]
    positions: np.ndarray  # int64 [L]


@dataclass
class RunnerOutput:
    """The tokens of a step, ragged per row: row r (sequence `seq_ids[r]`, the plan's sampled
    sequences in order) gained `tokens[token_offsets[r]:token_offsets[r + 1]]`; without offsets,
    one token each (`tokens[r]`: every row while nothing speculates, and no offsets to build)."""

    seq_ids: np.ndarray  # int64 [R]
    tokens: np.ndarray  # int32 [T]
    token_offsets: np.ndarray | None = None  # int32 [R + 1]; None: T == R, one per row
    # (parent, child, the child's first token): a prompt's first sample fanned out into n > 1.
    forks: list[tuple[int, int, int]] = field(default_factory=list)
    logprobs: LogprobBlock | None = None  # for the sequences in logprob_seq_ids, in that order
    logprob_seq_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    grammar_ends: GrammarEnds = field(default_factory=GrammarEnds)
    prompt_logprobs: PromptLogprobRows | None = None
    # A draft model's proposals for each row's next step: drafts[draft_offsets[r]:draft_offsets[r + 1]].
    drafts: np.ndarray | None = None  # int32
    draft_offsets: np.ndarray | None = None  # int32 [R + 1]

    @classmethod
    def empty(cls) -> RunnerOutput:
        """A step that sampled nothing (prefill chunks only)."""
        return cls(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32))

    def last_tokens(self) -> np.ndarray:
        """Each row's last new token."""
        return self.tokens if self.token_offsets is None else self.tokens[self.token_offsets[1:] - 1]

    def offsets(self) -> np.ndarray:
        """token_offsets, also when every row has one token."""
        if self.token_offsets is not None:
            return self.token_offsets
        return np.arange(len(self.tokens) + 1, dtype=np.int32)

    def keep(self, kept: np.ndarray) -> None:
        """Row r keeps its first kept[r] tokens (the scheduler stopped it there: EOS, a stop id,
        max_tokens); rows with none kept (aborted in flight) keep theirs. Logprob rows past a kept
        token are dropped when the sequence's output is collected."""
        offsets = self.offsets()
        counts = np.diff(offsets)
        cut = (kept > 0) & (kept < counts)
        if not cut.any():
            return
        new_counts = np.where(cut, kept, counts)
        take = np.arange(len(self.tokens)) - np.repeat(offsets[:-1], counts) < np.repeat(new_counts, counts)
        self.tokens = self.tokens[take]
        self.token_offsets = np.concatenate([[0], np.cumsum(new_counts)]).astype(np.int32)
