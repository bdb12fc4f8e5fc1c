"""A minimal hand-built block allocator that turns "run these tokens" into attention metadata.

It stands in for the C++ scheduler in model tests: block ids come from a shuffled pool so block
tables are non-contiguous, and sequences can be fed in chunks (chunked prefill) or one token at
a time (decode).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from nanovllm.attention.metadata import AttentionMetadata, make_attention_metadata


@dataclass
class _SeqState:
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache


@dataclass
class Batch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    last_token_rows: list[int]  # row of each chunk's last token (where its next token is sampled)


class TinyPager:
    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.seqs: dict[int, _SeqState] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> Batch:
        """`chunks`: (seq_id, new token ids) in batch order. Decodes (1 new token onto a cached
        prefix) must come first; they form the metadata's decode part."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_q = [0]
        ctx_lens: list[int] = []
        tables: list[list[int]] = []
        num_decode = 0
        for i, (seq_id, tokens) in enumerate(chunks):
            st = self.seqs.setdefault(seq_id, _SeqState())
            is_decode = len(tokens) == 1 and st.num_cached > 0
            if is_decode:
                if num_decode != i:
                    raise ValueError("decodes must come before prefill chunks")
                num_decode += 1
            for tok in tokens:
                pos = st.num_cached
                if pos // self.block_size >= len(st.blocks):
                    st.blocks.append(self.free.pop())
                ids.append(tok)
                positions.append(pos)
                slots.append(
                    st.blocks[pos // self.block_size] * self.block_size + pos % self.block_size
                )
                st.num_cached += 1
            cu_q.append(len(ids))
            ctx_lens.append(st.num_cached)
            tables.append(list(st.blocks))
        meta = make_attention_metadata(
            slot_mapping=slots,
            cu_seqlens_q=cu_q,
            context_lens=ctx_lens,
            block_tables=tables,
            num_decode_tokens=num_decode,
            block_size=self.block_size,
        )
        return Batch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            meta=meta,
            last_token_rows=[end - 1 for end in cu_q[1:]],
        )
