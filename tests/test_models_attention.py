"""The torch reference attention backend against dense causal attention computed directly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_pager import TinyPager

from nanovllm.attention import get_attention_backend, make_attention_metadata
from nanovllm.attention.torch_backend import paged_attention, write_kv_cache
from nanovllm.layers.attention import Attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 32


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q `[q_len, H, D]` are the last q_len positions of k/v `[L, Hkv, D]`; causal; fp64."""
    q_len, ctx = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    qd = q.double().transpose(0, 1)  # [H, q, D]
    kd = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    vd = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
    out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=allowed, scale=scale)
    return out.transpose(0, 1)


def test_paged_attention_matches_dense_mixed_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    # (cached prefix length, new tokens): two decodes, then prefill chunks with and without prefix.
    shapes = {0: (9, 1), 1: (2, 1), 2: (0, 7), 3: (6, 5), 4: (0, 1)}
    full = {
        sid: (
            torch.randn(p + n, KV_HEADS, HEAD_DIM, generator=gen),
            torch.randn(p + n, KV_HEADS, HEAD_DIM, generator=gen),
        )
        for sid, (p, n) in shapes.items()
    }
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    pager = TinyPager(NUM_BLOCKS, BLOCK_SIZE, seed=1)
    # Step 1: write the cached prefixes.
    prefix = [(sid, [0] * p) for sid, (p, _) in shapes.items() if p > 0]
    b = pager.step(prefix)
    write_kv_cache(
        torch.cat([full[s][0][:p] for s, (p, _) in shapes.items() if p > 0]),
        torch.cat([full[s][1][:p] for s, (p, _) in shapes.items() if p > 0]),
        k_cache,
        v_cache,
        b.meta.slot_mapping,
    )
    # Step 2: the new tokens, decodes first (sequence 4 is a 1-token prefill, not a decode).
    order = [0, 1, 2, 3, 4]
    b = pager.step([(sid, [0] * shapes[sid][1]) for sid in order])
    assert b.meta.num_decode_tokens == 2
    q = {sid: torch.randn(shapes[sid][1], HEADS, HEAD_DIM, generator=gen) for sid in order}
    new_k = torch.cat([full[s][0][shapes[s][0] :] for s in order])
    new_v = torch.cat([full[s][1][shapes[s][0] :] for s in order])
    write_kv_cache(new_k, new_v, k_cache, v_cache, b.meta.slot_mapping)
    scale = HEAD_DIM**-0.5
    out = paged_attention(torch.cat([q[s] for s in order]), k_cache, v_cache, b.meta, scale)
    expected = torch.cat([dense_reference(q[s], *full[s], scale) for s in order]).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_write_kv_cache_skips_negative_slots() -> None:
    k_cache = torch.zeros(4, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, KV_HEADS, HEAD_DIM)
    value = 2 * torch.ones(3, KV_HEADS, HEAD_DIM)
    write_kv_cache(key, value, k_cache, v_cache, torch.tensor([5, -1, 12], dtype=torch.int32))
    flat_k = k_cache.view(-1, KV_HEADS, HEAD_DIM)
    written = flat_k.abs().sum(dim=(1, 2)).nonzero().flatten().tolist()
    assert written == [5, 12]
    assert torch.all(v_cache.view(-1, KV_HEADS, HEAD_DIM)[12] == 2)


def test_padding_rows_beyond_metadata_are_zero() -> None:
    k_cache = torch.randn(4, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    v_cache = torch.randn_like(k_cache)
    meta = make_attention_metadata(
        slot_mapping=[3, -1],
        cu_seqlens_q=[0, 1],
        context_lens=[4],
        block_tables=[[0]],
        num_decode_tokens=1,
        block_size=BLOCK_SIZE,
    )
    out = paged_attention(torch.randn(2, HEADS, HEAD_DIM), k_cache, v_cache, meta, 1.0)
    assert torch.all(out[1] == 0) and out[0].abs().sum() > 0


def test_attention_layer_requires_bound_cache_and_known_backend() -> None:
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, 1.0, layer_idx=0)
    meta = make_attention_metadata(
        slot_mapping=[0],
        cu_seqlens_q=[0, 1],
        context_lens=[1],
        block_tables=[[0]],
        num_decode_tokens=0,
        block_size=BLOCK_SIZE,
    )
    x = torch.zeros(1, HEADS, HEAD_DIM)
    kv = torch.zeros(1, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="no KV cache bound"):
        layer(x, kv, kv, meta)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash")


def test_metadata_validation() -> None:
    with pytest.raises(ValueError, match="query length 1"):
        make_attention_metadata(
            slot_mapping=[0, 1],
            cu_seqlens_q=[0, 2],
            context_lens=[2],
            block_tables=[[0]],
            num_decode_tokens=1,
            block_size=BLOCK_SIZE,
        )
    meta = make_attention_metadata(
        slot_mapping=[4, 0, 1],
        cu_seqlens_q=[0, 1, 3],
        context_lens=[5, 2],
        block_tables=[[2, 1], [0]],
        num_decode_tokens=1,
        block_size=BLOCK_SIZE,
    )
    assert meta.cu_seqlens_k.tolist() == [0, 5, 7]
    assert meta.block_tables.tolist() == [[2, 1], [0, -1]]
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.num_prefill_tokens) == (2, 5, 2)
    assert meta.block_tables.dtype == torch.int32
