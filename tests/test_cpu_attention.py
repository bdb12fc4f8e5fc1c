"""The fast CPU backend (C++ decode kernel, fused SDPA prefill) against the torch reference, on
random caches with shuffled block tables, GQA and ragged context lengths."""

from __future__ import annotations

import pytest
import torch

from nanovllm.attention import cpu_backend, torch_backend
from nanovllm.attention.metadata import make_attention_metadata


def random_case(seed: int, q_lens: list[int], ctx_lens: list[int], heads: int, kv_heads: int, dim: int,
                block_size: int):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, start = [], 0
    for b in blocks_needed:
        tables.append(perm[start:start + b])
        start += b
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    query = torch.randn(sum(q_lens), heads, dim, generator=g)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    slots = [tables[i][p // block_size] * block_size + p % block_size
             for i, (q, c) in enumerate(zip(q_lens, ctx_lens)) for p in range(c - q, c)]
    meta = make_attention_metadata(slot_mapping=slots, cu_seqlens_q=cu, context_lens=ctx_lens, block_tables=tables,
                                   num_decode_tokens=sum(1 for q in q_lens if q == 1), block_size=block_size)
    return query, k_cache, v_cache, meta


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"),
                         [(4, 4, 32, 16), (8, 2, 64, 16), (16, 2, 128, 4), (6, 3, 20, 256), (4, 1, 7, 1)])
def test_decode_matches_reference(heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    ctx = [1, block_size, block_size + 1, 3 * block_size, 37, 2]
    query, k, v, meta = random_case(1, [1] * len(ctx), ctx, heads, kv_heads, dim, block_size)
    ours = cpu_backend.paged_attention(query, k, v, meta, 0.3)
    ref = torch_backend.paged_attention(query, k, v, meta, 0.3)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_mixed_decode_and_prefill_chunks_match_reference() -> None:
    q_lens = [1, 1, 5, 9, 1]
    ctx = [17, 3, 5, 30, 1]  # a fresh prompt, a chunk after a cached prefix, ...
    # Decodes first, as the core lays out a batch.
    order = sorted(range(len(q_lens)), key=lambda i: q_lens[i] != 1)
    q_lens = [q_lens[i] for i in order]
    ctx = [ctx[i] for i in order]
    query, k, v, meta = random_case(2, q_lens, ctx, 8, 2, 16, 4)
    ours = cpu_backend.paged_attention(query, k, v, meta, 0.25)
    ref = torch_backend.paged_attention(query, k, v, meta, 0.25)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_decode_rejects_bad_tensors_before_running() -> None:
    query, k, v, meta = random_case(3, [1, 1], [4, 9], 4, 2, 8, 4)
    with pytest.raises(ValueError, match="query"):
        cpu_backend.decode_attention(query.double(), k, v, meta.block_tables, meta.context_lens, 1.0)
    with pytest.raises(ValueError, match="k_cache"):
        cpu_backend.decode_attention(query, k.transpose(1, 2), v, meta.block_tables, meta.context_lens, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        cpu_backend.decode_attention(query, k, v, meta.block_tables.long(), meta.context_lens, 1.0)
    bad_tables = meta.block_tables.clone()
    bad_tables[1, 0] = k.shape[0]
    with pytest.raises(IndexError, match="not a block"):
        cpu_backend.decode_attention(query, k, v, bad_tables, meta.context_lens, 1.0)
