"""What rank 0 sends the workers each step: a fixed header of int32 fields, then a payload in the
layout of the StepPlan buffer (docs/design.md, "The step"), only the parts the step uses written.

Both channels (shm_ring on one node, broadcast_channel across nodes) carry these messages, so a
worker reads a step the same way whichever channel delivered it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from nanovllm._C import PlanMirror, StepPlan


class Kind(IntEnum):
    STEP = 1  # run the forward of the plan in the payload (block copies first)
    LOGITS = 2  # logits of the last step's hidden rows listed in the payload, gathered on rank 0
    STOP = 3  # leave the worker loop


_STEP = int(Kind.STEP)
KINDS = {int(k): k for k in Kind}  # a dict lookup: calling the enum costs a microsecond


# Header fields (int32 indices). NUM_TOKENS..MAX_SEQLEN_K are in StepPlan.copy_used's order.
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


class StepWriter:
    """Writes STEP messages into one header and one buffer in the plan's layout (a ring slot, or
    the broadcast channel's buffer), which must start with every block-table entry -1, as a plan
    does. One native call per step (StepPlan.copy_used, at addresses taken once here) writes the
    counts and the used part of every section; of the block tables only the entries this
    destination does not hold yet (its PlanMirror knows which), so every row reads exactly like
    the plan's and a decode step costs per sequence, not per context block."""

    __slots__ = ("_header", "_counts", "_payload", "_size", "_mirror")

    def __init__(self, header: np.ndarray, payload: np.ndarray, layout: PlanLayout) -> None:
        if header.dtype != np.int32 or payload.dtype != np.int32 or not payload.flags.c_contiguous \
                or len(header) < HEADER_INTS or len(payload) < layout.size:
            raise ValueError("a step message needs a contiguous int32 header and plan-layout buffer")
        self._header = header  # keeps the memory behind the addresses alive
        self._counts = header[NUM_TOKENS:].ctypes.data
        self._payload = payload.ctypes.data
        self._size = len(payload)
        self._mirror = PlanMirror(layout.max_seqs)

    def write(self, plan: StepPlan) -> None:
        self._header[KIND] = _STEP
        plan.copy_used(self._counts, self._payload, self._size, self._mirror)


class ReceivedPlan:
    """A step as a worker received it: duck-types the StepPlan attributes that PlanTensors and the
    runner read, over a plan-layout buffer the channel owns."""

    __slots__ = ("buffer", "offsets", "max_blocks_per_seq", "num_tokens", "num_seqs", "num_samples", "num_copies",
                 "num_decode_tokens", "max_seqlen_q", "max_seqlen_k")

    def __init__(self, layout: PlanLayout, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.offsets = layout.offsets
        self.max_blocks_per_seq = layout.max_blocks_per_seq
        self.num_tokens = self.num_seqs = self.num_samples = self.num_copies = 0
        self.num_decode_tokens = self.max_seqlen_q = self.max_seqlen_k = 0

    def load(self, header: Sequence[int]) -> ReceivedPlan:
        """The counts of the header (a list or tuple: ints, not numpy scalars)."""
        (self.num_tokens, self.num_seqs, self.num_samples, self.num_copies, self.num_decode_tokens,
         self.max_seqlen_q, self.max_seqlen_k) = header[NUM_TOKENS:MAX_SEQLEN_K + 1]
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
