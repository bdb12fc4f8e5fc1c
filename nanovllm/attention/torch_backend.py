"""Reference paged-attention backend in plain torch (runs on CPU and GPU).

This is the oracle the CUDA kernels are tested against, so it favours exactness over speed:
scores, softmax and the weighted sum are computed in fp32 whatever the cache dtype.

Cache layout (per layer): k_cache / v_cache `[num_blocks, block_size, num_kv_heads, head_dim]`.
Token slot `s` lives at block `s // block_size`, offset `s % block_size`.
"""

from __future__ import annotations

import torch

from nanovllm.attention.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter `key`/`value` `[num_tokens, num_kv_heads, head_dim]` into the caches by slot.

    Slots of -1 (e.g. padding tokens) are skipped. Tokens beyond `slot_mapping`'s length are
    ignored too, so callers may pass padded key/value tensors.
    """
    n = slot_mapping.shape[0]
    key, value = key[:n], value[:n]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    # Flattened views share storage with the caches, so index_copy_ writes the caches in place.
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[valid].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[valid].to(v_cache.dtype))


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of each new token over its sequence's cached context, causal within the sequence.

    `query` `[num_tokens, num_heads, head_dim]`; the new tokens' K/V must already be in the cache
    (call `write_kv_cache` first). Returns `[num_tokens, num_heads, head_dim]` in query's dtype;
    rows not covered by the metadata (padding) are zero.
    """
    out = torch.zeros_like(query)
    host = meta.host_lens()
    nd = meta.num_decode_tokens
    if nd > 0:
        max_ctx = int(max(host.context_lens[:nd]))
        out[:nd] = _decode_attention(
            query[:nd],
            k_cache,
            v_cache,
            meta.block_tables[:nd],
            meta.context_lens[:nd],
            max_ctx,
            scale,
        )
    for i in range(nd, meta.num_seqs):
        start, end = int(host.cu_seqlens_q[i]), int(host.cu_seqlens_q[i + 1])
        if end > start:
            out[start:end] = _prefill_attention(
                query[start:end],
                k_cache,
                v_cache,
                meta.block_tables[i],
                int(host.context_lens[i]),
                scale,
            )
    return out


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`[..., n_blocks]` block ids -> `[..., n_blocks * block_size, kv_heads, head_dim]`, cut to num_tokens.

    Padding entries (-1) are clamped to block 0; callers mask those positions out.
    """
    blocks = cache[block_ids.clamp(min=0).long()]  # [..., n_blocks, block_size, H, D]
    flat = blocks.flatten(-4, -3)
    return flat[..., :num_tokens, :, :]


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_ctx: int,
    scale: float,
) -> torch.Tensor:
    """All decode sequences at once: gather blocks padded to the longest context, mask the rest."""
    n, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    n_blocks = -(-max_ctx // block_size)
    tables = block_tables[:, :n_blocks]
    k = _gather_context(k_cache, tables, max_ctx).float()  # [n, L, Hkv, D]
    v = _gather_context(v_cache, tables, max_ctx).float()
    q = query.float().view(n, num_kv_heads, group, head_dim)
    scores = torch.einsum("nhgd,nlhd->nhgl", q, k) * scale
    pos = torch.arange(max_ctx, device=query.device)
    pad = pos[None, :] >= context_lens[:, None].to(pos.dtype)  # [n, L]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("nhgl,nlhd->nhgd", probs, v)
    return out.reshape(n, num_heads, head_dim).to(query.dtype)


def _prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """One sequence's chunk: q_len new tokens at absolute positions context_len-q_len..context_len-1."""
    q_len, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    n_blocks = -(-context_len // block_size)
    k = _gather_context(k_cache, block_table[:n_blocks], context_len).float()  # [L, Hkv, D]
    v = _gather_context(v_cache, block_table[:n_blocks], context_len).float()
    q = query.float().view(q_len, num_kv_heads, group, head_dim)
    scores = torch.einsum("qhgd,lhd->hgql", q, k) * scale
    q_pos = torch.arange(context_len - q_len, context_len, device=query.device)
    k_pos = torch.arange(context_len, device=query.device)
    future = k_pos[None, :] > q_pos[:, None]  # [q_len, L]
    scores.masked_fill_(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgql,lhd->qhgd", probs, v)
    return out.reshape(q_len, num_heads, head_dim).to(query.dtype)
