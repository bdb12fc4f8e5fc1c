"""The fast CPU backend (one C++ call for decode rows and prefill chunks, fp32 and bf16) against the
torch reference, on random caches with shuffled block tables, GQA and ragged context lengths."""

from __future__ import annotations

import pytest
import torch

from nanovllm.attention import cpu_backend, torch_backend
from nanovllm.attention.metadata import make_attention_metadata

# bf16 inputs, fp32 accumulation on both sides: the outputs differ by the final rounding to bf16
# (2^-8 relative) plus summation order.
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}


def random_case(seed: int, q_lens: list[int], ctx_lens: list[int], heads: int, kv_heads: int, dim: int,
                block_size: int, dtype: torch.dtype = torch.float32):  # noqa: ANN202
    """Sequences in the given order (decodes must come first); every context's K/V already cached."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, start = [], 0
    for b in blocks_needed:
        tables.append(perm[start:start + b])
        start += b
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    query = torch.randn(sum(q_lens), heads, dim, generator=g).to(dtype)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    slots = [tables[i][p // block_size] * block_size + p % block_size
             for i, (q, c) in enumerate(zip(q_lens, ctx_lens)) for p in range(c - q, c)]
    meta = make_attention_metadata(slot_mapping=slots, cu_seqlens_q=cu, context_lens=ctx_lens, block_tables=tables,
                                   num_decode_tokens=sum(1 for q in q_lens if q == 1), block_size=block_size)
    return query, k_cache, v_cache, meta


def assert_matches_reference(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> None:  # noqa: ANN001
    ours = cpu_backend.paged_attention(query, k, v, meta, scale)
    ref = torch_backend.paged_attention(query, k, v, meta, scale)
    assert ours.dtype == query.dtype
    torch.testing.assert_close(ours, ref, **TOL[query.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"),
                         # The AVX2 value tiles take a head's 1, 2, 3 or 4 vectors with 64, 48, 32 or 24 columns at
                         # a time, then eight at a time; the AVX-512 ones (head_dim a multiple of 16, on AVX512-BF16
                         # CPUs) 1 or 2 vectors with 128, 3 or 4 with 64, then sixteen at a time, and score two
                         # vectors at once: groups 1 to 5, head_dims that leave columns over.
                         [(4, 4, 32, 16), (8, 4, 48, 16), (12, 4, 40, 8), (8, 2, 64, 16), (16, 2, 128, 4),
                          (6, 3, 20, 256), (4, 1, 7, 1), (10, 2, 80, 8), (4, 2, 128, 16), (3, 3, 144, 16)])
def test_decode_matches_reference(heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype) -> None:
    ctx = [1, block_size, block_size + 1, 3 * block_size, 37, 2]
    query, k, v, meta = random_case(1, [1] * len(ctx), ctx, heads, kv_heads, dim, block_size, dtype)
    assert_matches_reference(query, k, v, meta, 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 4, 32), (6, 3, 64), (4, 1, 16), (4, 4, 20)])
def test_few_decode_rows_split_their_heads_over_threads(heads: int, kv_heads: int, dim: int, threads: int,
                                                        dtype: torch.dtype) -> None:
    """Fewer decode rows than threads: each row's KV heads are cut into consecutive ranges, one task
    each (uneven when the threads do not divide them; never more ranges than heads), on the tiles'
    path and the portable one; the same output whatever the thread count."""
    rows = [1] if threads == 2 else [1, 1]  # one row on two threads; two rows on three or five
    query, k, v, meta = random_case(7, rows, [300, 41][:len(rows)], heads, kv_heads, dim, 16, dtype)
    ref = torch_backend.paged_attention(query, k, v, meta, dim**-0.5)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_backend.paged_attention(query, k, v, meta, dim**-0.5)
        torch.set_num_threads(threads)
        split = cpu_backend.paged_attention(query, k, v, meta, dim**-0.5)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(split, ref, **TOL[dtype])
    assert torch.equal(split, one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# head_dim and block_size multiples of 8 take the AVX2 score tiles (on a CPU with AVX2; bf16 with
# head_dim a multiple of 32 the AVX512-BF16 scores where the CPU has them), the others the portable
# loops.
@pytest.mark.parametrize(("dim", "block_size"), [(64, 16), (64, 256), (20, 16), (64, 12)],
                         ids=["tiles_bs16", "tiles_bs256", "portable_dim20", "portable_bs12"])
def test_mixed_decode_and_prefill_chunks_match_reference(dim: int, block_size: int, dtype: torch.dtype) -> None:
    # Decodes first, as the core lays out a batch; then a fresh prompt, chunks after a cached prefix
    # (a prefix hit or an earlier chunk: the kernel cannot tell them apart), one longer than a
    # task's tile of query rows and crossing blocks, and a one-token chunk after a long prefix.
    q_lens = [1, 1, 1, 5, 9, 70, 300, 2]
    ctx = [17, 3, 290, 5, 30, 100, 333, 260]
    query, k, v, meta = random_case(2, q_lens, ctx, 8, 2, dim, block_size, dtype)
    assert_matches_reference(query, k, v, meta, 0.125)


def test_padding_rows_are_zero_and_no_sequences_is_fine() -> None:
    query, k, v, meta = random_case(4, [1, 3], [4, 9], 4, 2, 8, 4)
    padded = torch.cat([query, torch.randn(2, 4, 8)])
    out = cpu_backend.paged_attention(padded, k, v, meta, 1.0)
    torch.testing.assert_close(out[:4], torch_backend.paged_attention(query, k, v, meta, 1.0), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[4:], torch.zeros(2, 4, 8))
    empty = make_attention_metadata(slot_mapping=[], cu_seqlens_q=[0], context_lens=[], block_tables=[],
                                    num_decode_tokens=0, block_size=4)
    assert cpu_backend.paged_attention(query[:0], k, v, empty, 1.0).shape == (0, 4, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(6, 4, 2, 8, generator=g).to(dtype) for _ in range(2))
    caches = [k_cache, v_cache, k_cache.clone(), v_cache.clone()]
    qkv = torch.randn(5, 3 * 16, generator=g).to(dtype)  # key and value as strided views, as the model passes them
    key, value = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([3, -1, 17, 0], dtype=torch.int32)  # one skipped, the fifth row is padding
    cpu_backend.write_kv_cache(key, value, caches[0], caches[1], slots)
    torch_backend.write_kv_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_rejects_bad_tensors_before_running() -> None:
    query, k, v, meta = random_case(3, [1, 1], [4, 9], 4, 2, 8, 4)
    with pytest.raises(ValueError, match="k_cache"):
        cpu_backend.paged_attention(query, k.transpose(1, 2), v, meta, 1.0)
    with pytest.raises(ValueError, match="k_cache"):
        cpu_backend.paged_attention(query, k.bfloat16(), v, meta, 1.0)  # caches not in the query's dtype
    meta.block_tables = meta.block_tables.long()
    with pytest.raises(ValueError, match="block_tables"):
        cpu_backend.paged_attention(query, k, v, meta, 1.0)
    meta.block_tables = meta.block_tables.int()
    meta.block_tables[1, 0] = k.shape[0]
    with pytest.raises(IndexError, match="not a block"):
        cpu_backend.paged_attention(query, k, v, meta, 1.0)
    with pytest.raises(IndexError, match="not a slot"):
        cpu_backend.write_kv_cache(query[:, :2], query[:, :2], k, v, torch.tensor([0, 4 * k.shape[0]], dtype=torch.int32))


def test_other_dtypes_use_the_reference() -> None:
    query, k, v, meta = random_case(6, [1, 4], [5, 4], 4, 2, 8, 4, torch.float16)
    assert torch.equal(cpu_backend.paged_attention(query, k, v, meta, 0.5),
                       torch_backend.paged_attention(query, k, v, meta, 0.5))
