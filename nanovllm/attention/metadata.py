"""Per-step attention metadata: where each new token's K/V goes and what each token attends to.

The batch is flattened with no padding. Sequence i owns query rows
`cu_seqlens_q[i]:cu_seqlens_q[i+1]`; its full context (cached prefix + the new tokens) has
`context_lens[i]` tokens, reachable through `block_tables[i]`. The new tokens are the last
`q_len` positions of that context. Decodes (query length 1) come first, then prefill chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.staging import to_device


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int32 [num_tokens]: block_id*block_size+offset; -1 = skip
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs+1] prefix sums of query (new token) lengths
    cu_seqlens_k: torch.Tensor  # int32 [num_seqs+1] prefix sums of full context lengths
    context_lens: torch.Tensor  # int32 [num_seqs] full context length of each sequence
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], -1 padded
    max_seqlen_q: int
    max_seqlen_k: int
    num_prefill_tokens: int
    # The first num_decode_tokens tokens (== the first num_decode_tokens sequences) are decodes.
    num_decode_tokens: int
    block_size: int
    # Optional host copies. Backends that must know per-sequence lengths as Python ints (the torch
    # reference loops over prefill sequences) read these instead of calling .tolist() on device
    # tensors, which would synchronize with the GPU. None = derive from the tensors.
    host: HostSeqLens | None = None

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_decode_seqs(self) -> int:
        return self.num_decode_tokens

    def host_lens(self) -> HostSeqLens:
        """Host copies of the per-sequence lengths (computed once, synchronizing, if not given)."""
        if self.host is None:
            self.host = HostSeqLens(
                cu_seqlens_q=self.cu_seqlens_q.tolist(), context_lens=self.context_lens.tolist()
            )
        return self.host


@dataclass
class HostSeqLens:
    """Host copies of `cu_seqlens_q` and `context_lens`: lists, or numpy arrays such as the
    StepPlan's own views (valid for the step), so building this costs nothing per sequence."""

    cu_seqlens_q: Sequence[int] | np.ndarray
    context_lens: Sequence[int] | np.ndarray


def make_attention_metadata(
    *,
    slot_mapping: Sequence[int] | np.ndarray,
    cu_seqlens_q: Sequence[int] | np.ndarray,
    context_lens: Sequence[int] | np.ndarray,
    block_tables: np.ndarray | Sequence[Sequence[int]],
    num_decode_tokens: int,
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build metadata from host arrays (tests, CPU runs); derives the prefix sums and scalars.

    `block_tables` rows may have different lengths when given as lists; they are padded with -1.
    """
    cu_q = np.asarray(cu_seqlens_q, dtype=np.int32)
    ctx = np.asarray(context_lens, dtype=np.int32)
    if cu_q.shape[0] != ctx.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_q has {cu_q.shape[0]} entries, expected num_seqs + 1 = {ctx.shape[0] + 1}"
        )
    q_lens = np.diff(cu_q)
    if np.any(q_lens > ctx):
        raise ValueError("a sequence has more new tokens than its context length")
    if num_decode_tokens > 0 and np.any(q_lens[:num_decode_tokens] != 1):
        raise ValueError("the first num_decode_tokens sequences must have query length 1")
    cu_k = np.zeros(ctx.shape[0] + 1, dtype=np.int32)
    np.cumsum(ctx, out=cu_k[1:])
    bt = _pad_block_tables(block_tables, ctx.shape[0])
    num_tokens = int(cu_q[-1])

    def t(a: np.ndarray) -> torch.Tensor:
        return to_device(np.ascontiguousarray(a, dtype=np.int32), torch.device(device))

    return AttentionMetadata(
        slot_mapping=t(np.asarray(slot_mapping, dtype=np.int32)),
        cu_seqlens_q=t(cu_q),
        cu_seqlens_k=t(cu_k),
        context_lens=t(ctx),
        block_tables=t(bt),
        max_seqlen_q=int(q_lens.max()) if q_lens.size else 0,
        max_seqlen_k=int(ctx.max()) if ctx.size else 0,
        num_prefill_tokens=num_tokens - num_decode_tokens,
        num_decode_tokens=num_decode_tokens,
        block_size=block_size,
        host=HostSeqLens(cu_seqlens_q=cu_q.tolist(), context_lens=ctx.tolist()),
    )


def _pad_block_tables(tables: np.ndarray | Sequence[Sequence[int]], num_seqs: int) -> np.ndarray:
    if isinstance(tables, np.ndarray):
        if tables.ndim != 2 or tables.shape[0] != num_seqs:
            raise ValueError(f"block_tables must be [num_seqs={num_seqs}, max_blocks]")
        return tables.astype(np.int32, copy=False)
    if len(tables) != num_seqs:
        raise ValueError(f"block_tables has {len(tables)} rows, expected {num_seqs}")
    width = max((len(row) for row in tables), default=0)
    out = np.full((num_seqs, max(width, 1)), -1, dtype=np.int32)
    for i, row in enumerate(tables):
        out[i, : len(row)] = row
    return out
