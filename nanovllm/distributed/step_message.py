"""What rank 0 sends the workers each step: a fixed header of int32 fields, then a payload in the
layout of the StepPlan buffer (docs/design.md, "The step"), only the parts the step uses written.

Both channels (shm_ring on one node, broadcast_channel across nodes) carry these messages, so a
worker reads a step the same way whichever channel delivered it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from nanovllm._C import StepPlan


class Kind(IntEnum):
    STEP = 1  # run the forward of the plan in the payload (block copies first)
    LOGITS = 2  # logits of the last step's hidden rows listed in the payload, gathered on rank 0
    STOP = 3  # leave the worker loop


# Header fields (int32 indices).
SEQ, KIND, NUM_TOKENS, NUM_SEQS, NUM_SAMPLES, NUM_COPIES, NUM_DECODE_TOKENS, MAX_SEQLEN_Q, MAX_SEQLEN_K, \
    NUM_ROWS = range(10)
HEADER_INTS = 16


@dataclass(frozen=True)
class PlanLayout:
    """The StepPlan buffer's geometry, the same on every rank (same engine options)."""

    offsets: dict[str, int]
    size: int
    max_tokens: int
    max_seqs: int
    max_blocks_per_seq: int
    block_size: int

    @classmethod
    def of(cls, plan: StepPlan, block_size: int) -> PlanLayout:
        off = dict(plan.offsets)
        max_seqs = off["sample_indices"] - off["context_lens"]
        return cls(off, int(plan.buffer.shape[0]), off["positions"] - off["input_ids"], max_seqs,
                   plan.max_blocks_per_seq, block_size)

    def used_size(self, num_seqs: int) -> int:
        return self.offsets["block_tables"] + num_seqs * self.max_blocks_per_seq


class SectionCopier:
    """Copies the used part of each section from one plan-layout buffer to another: six numpy
    assignments per step (the three token sections, and the two cu_seqlens sections, are adjacent
    and equally long, so each group is one strided 2-D copy).

    Block tables: only the columns any step so far has used (the step's longest context decides),
    not max_model_len's worth. Columns this destination has ever received are rewritten every step,
    so every row reads exactly like the plan's (-1 past its blocks) wherever a reader looks."""

    __slots__ = ("_tok", "_cu", "_ctx", "_smp", "_cpy", "_tab", "_bs", "_width")

    def __init__(self, layout: PlanLayout, src: np.ndarray, dst: np.ndarray) -> None:
        o, mt, ms = layout.offsets, layout.max_tokens, layout.max_seqs

        def pair(start: int, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
            return (src[start:start + rows * cols].reshape(rows, cols), dst[start:start + rows * cols].reshape(rows, cols))

        self._tok = pair(o["input_ids"], 3, mt)
        self._cu = pair(o["cu_seqlens_q"], 2, ms + 1)
        self._ctx = pair(o["context_lens"], 1, ms)
        self._smp = pair(o["sample_indices"], 1, ms)
        self._cpy = pair(o["block_copies"], 1, 2 * ms)
        self._tab = pair(o["block_tables"], ms, layout.max_blocks_per_seq)
        self._bs = layout.block_size
        self._width = 0

    def copy(self, num_tokens: int, num_seqs: int, num_samples: int, num_copies: int, max_seqlen_k: int) -> None:
        for (s, d), n in ((self._tok, num_tokens), (self._cu, num_seqs + 1), (self._ctx, num_seqs),
                          (self._smp, num_samples), (self._cpy, 2 * num_copies)):
            d[:, :n] = s[:, :n]
        s, d = self._tab
        self._width = w = min(s.shape[1], max(self._width, -(-max_seqlen_k // self._bs)))
        d[:num_seqs, :w] = s[:num_seqs, :w]


def fill_step_header(header: np.ndarray, plan: StepPlan) -> None:
    header[KIND] = Kind.STEP
    header[NUM_TOKENS] = plan.num_tokens
    header[NUM_SEQS] = plan.num_seqs
    header[NUM_SAMPLES] = plan.num_samples
    header[NUM_COPIES] = plan.num_copies
    header[NUM_DECODE_TOKENS] = plan.num_decode_tokens
    header[MAX_SEQLEN_Q] = plan.max_seqlen_q
    header[MAX_SEQLEN_K] = plan.max_seqlen_k


class ReceivedPlan:
    """A step as a worker received it: duck-types the StepPlan attributes that PlanTensors and the
    runner read, over a plan-layout buffer the channel owns."""

    def __init__(self, layout: PlanLayout, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.offsets = layout.offsets
        self.max_blocks_per_seq = layout.max_blocks_per_seq
        self.num_tokens = self.num_seqs = self.num_samples = self.num_copies = 0
        self.num_decode_tokens = self.max_seqlen_q = self.max_seqlen_k = 0

    def load(self, header: np.ndarray) -> ReceivedPlan:
        (self.num_tokens, self.num_seqs, self.num_samples, self.num_copies, self.num_decode_tokens,
         self.max_seqlen_q, self.max_seqlen_k) = header[NUM_TOKENS:MAX_SEQLEN_K + 1].tolist()
        return self

    @property
    def cu_seqlens_q(self) -> np.ndarray:
        o = self.offsets["cu_seqlens_q"]
        return self.buffer[o:o + self.num_seqs + 1]

    @property
    def context_lens(self) -> np.ndarray:
        o = self.offsets["context_lens"]
        return self.buffer[o:o + self.num_seqs]


@dataclass
class Message:
    kind: Kind
    plan: ReceivedPlan | None = None  # STEP
    rows: np.ndarray | None = None  # LOGITS: int32 row indices into the last step's hidden states
    slot: int = 0  # which buffer the channel delivered it in (a worker keeps one PlanTensors per slot)
