"""Fast CPU attention backend: decode via the C++ kernel in `nanovllm._C` (reads the paged cache
in place, each sequence only up to its own context), prefill via torch's fused
scaled-dot-product attention per sequence. fp32 only; other dtypes use the torch reference.

The torch backend stays the reference this one is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm import _C
from nanovllm.attention import torch_backend
from nanovllm.attention.metadata import AttentionMetadata

write_kv_cache = torch_backend.write_kv_cache


def _check(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor, got {t.dtype} on {t.device}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [n, H, D] fp32, caches [blocks, block_size, Hkv, D] -> [n, H, D]."""
    for t, name in ((query, "query"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        _check(t, name, torch.float32)
    for t, name in ((block_tables, "block_tables"), (context_lens, "context_lens")):
        _check(t, name, torch.int32)
    n, heads, dim = query.shape
    num_blocks, block_size, kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_dim != dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit query {tuple(query.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] < n or context_lens.shape[0] < n:
        raise ValueError("block_tables / context_lens have fewer rows than query")
    out = torch.empty_like(query)
    _C.paged_decode_attention_cpu(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), block_tables.shape[1], n, heads, kv_heads, dim, block_size, num_blocks, scale,
        torch.get_num_threads(),
    )
    return out


def _prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
             context_len: int, scale: float) -> torch.Tensor:
    q_len = query.shape[0]
    block_size = k_cache.shape[1]
    n_blocks = -(-context_len // block_size)
    blocks = block_table[:n_blocks].long()
    k = k_cache[blocks].flatten(0, 1)[:context_len]  # [L, Hkv, D]
    v = v_cache[blocks].flatten(0, 1)[:context_len]
    q = query.transpose(0, 1)  # [H, q, D]
    k, v = k.transpose(0, 1), v.transpose(0, 1)
    prefix = context_len - q_len
    if prefix == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query i sits at absolute position prefix + i and sees keys 0 .. prefix + i.
        allowed = torch.ones(q_len, context_len, dtype=torch.bool).tril(diagonal=prefix)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if query.dtype != torch.float32:
        return torch_backend.paged_attention(query, k_cache, v_cache, meta, scale)
    out = torch.empty_like(query)
    host = meta.host_lens()
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = decode_attention(query[:nd].contiguous(), k_cache, v_cache, meta.block_tables,
                                    meta.context_lens, scale)
    for i in range(nd, meta.num_seqs):
        start, end = int(host.cu_seqlens_q[i]), int(host.cu_seqlens_q[i + 1])
        out[start:end] = _prefill(query[start:end], k_cache, v_cache, meta.block_tables[i],
                                  int(host.context_lens[i]), scale)
    if out.shape[0] > (int(host.cu_seqlens_q[-1]) if meta.num_seqs else 0):
        out[int(host.cu_seqlens_q[-1]) if meta.num_seqs else 0:] = 0  # padding rows, as the reference
    return out
