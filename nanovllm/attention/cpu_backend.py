"""Fast CPU attention backend: one C++ call per layer per step (`nanovllm._cpu`) for the whole
batch, decode rows and prefill chunks alike, reading the paged cache in place, each sequence only
up to what its queries see; the KV write is one C++ scatter. fp32 and bf16 (fp32 accumulation);
other dtypes use the torch reference, which stays the oracle this backend is tested against.

`qkv_attention` goes further back: from the qkv projection's output, the q/k norm and rotary
before the KV write and the attention, all in one call (the same kernels, the same bits).
"""

from __future__ import annotations

import torch

from nanovllm import _cpu
from nanovllm.attention import torch_backend
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.cpu import KERNEL_DTYPES



def _check(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor, got {t.dtype} on {t.device}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def _check_rows(t: torch.Tensor, name: str, cache: torch.Tensor) -> None:
    """`[tokens, kv_heads, head_dim]` rows, each contiguous (token rows may be strided views)."""
    if (t.device.type != "cpu" or t.dtype != cache.dtype or t.dim() != 3 or t.shape[1:] != cache.shape[2:]
            or t.stride(2) != 1 or t.stride(1) != t.shape[2]):
        raise ValueError(f"{name} must be [tokens, {cache.shape[2]}, {cache.shape[3]}] {cache.dtype} CPU rows, "
                         f"got {tuple(t.shape)} {t.dtype} with strides {t.stride()}")


def _zero_padding(out: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """out with its rows past the metadata's tokens (padding, which the kernels do not write) zeroed,
    as the reference leaves them."""
    covered = int(meta.host_lens().cu_seqlens_q[meta.num_seqs])
    if covered < out.shape[0]:
        out[covered:] = 0
    return out


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """As torch_backend.write_kv_cache: rows past `slot_mapping`'s length and slots of -1 are skipped."""
    if k_cache.dtype not in KERNEL_DTYPES:
        torch_backend.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        _check(t, name, k_cache.dtype)
    _check(slot_mapping, "slot_mapping", torch.int32)
    n = slot_mapping.shape[0]
    _check_rows(key, "key", k_cache)
    _check_rows(value, "value", k_cache)
    if key.shape[0] < n or value.shape[0] < n or v_cache.shape != k_cache.shape:
        raise ValueError("key/value have fewer rows than slot_mapping, or the caches differ in shape")
    item = k_cache.element_size()
    _cpu.write_kv_cache_cpu(key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          slot_mapping.data_ptr(), n, k_cache.shape[2] * k_cache.shape[3] * item,
                          key.stride(0) * item, value.stride(0) * item, k_cache.shape[0] * k_cache.shape[1])


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query `[T, H, D]`, caches `[blocks, block_size, Hkv, D]` of the same dtype -> `[T, H, D]`;
    rows past the metadata's tokens (padding) are zero, as in the reference."""
    if query.dtype not in KERNEL_DTYPES:
        return torch_backend.paged_attention(query, k_cache, v_cache, meta, scale)
    if query.device.type == "cpu" and not query.is_contiguous():
        query = query.contiguous()  # a view of the qkv output (rotated in place): the kernel reads [T, H, D]
    for t, name in ((query, "query"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        _check(t, name, query.dtype)
    for t, name in ((meta.block_tables, "block_tables"), (meta.context_lens, "context_lens"),
                    (meta.cu_seqlens_q, "cu_seqlens_q")):
        _check(t, name, torch.int32)
    tokens, heads, dim = query.shape
    num_blocks, block_size, kv_heads, cache_dim = k_cache.shape
    n = meta.num_seqs
    if v_cache.shape != k_cache.shape or cache_dim != dim:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit query {tuple(query.shape)}")
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] < n or meta.cu_seqlens_q.shape[0] < n + 1:
        raise ValueError("block_tables / cu_seqlens_q have fewer rows than there are sequences")
    if n == 0:
        return torch.zeros_like(query)
    out = torch.empty_like(query)
    _cpu.paged_attention_cpu(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), meta.block_tables.data_ptr(),
        meta.context_lens.data_ptr(), meta.cu_seqlens_q.data_ptr(), out.data_ptr(), tokens,
        meta.block_tables.shape[1], n, heads, kv_heads, dim, block_size, num_blocks, scale,
        KERNEL_DTYPES[query.dtype], torch.get_num_threads(),
    )
    return _zero_padding(out, meta)


def qkv_attention(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, num_heads: int,
                  num_kv_heads: int) -> torch.Tensor | None:
    """One layer's attention from its qkv projection's output `[T, (H + 2 Hkv) D]` in one C++ call:
    RMSNorm over each q and k head (`qk_norm` = (q weight, k weight, eps), Qwen3's), rotary by
    `inv_freq`, the K/V write and paged attention -> `[T, H, D]`, as rotary_, write_kv_cache and
    paged_attention compute them. None where the kernels do not take these tensors as they are:
    the caller then runs those steps one by one (which also raise the errors for bad input)."""
    dim = k_cache.shape[-1] if k_cache.dim() == 4 else 0
    tokens = qkv.shape[0]
    n = meta.num_seqs
    if (qkv.dtype not in KERNEL_DTYPES or not qkv.is_cpu or qkv.dim() != 2 or qkv.stride(1) != 1 or n == 0
            or qkv.stride(0) < qkv.shape[1] or not (k_cache.is_cpu and positions.is_cpu and inv_freq.is_cpu)
            or dim % 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * dim or k_cache.dtype != qkv.dtype
            or v_cache.shape != k_cache.shape or v_cache.dtype != qkv.dtype or k_cache.shape[2] != num_kv_heads
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or positions.dtype != torch.int32 or positions.shape != (tokens,) or not positions.is_contiguous()
            or inv_freq.dtype != torch.float32 or inv_freq.shape != (dim // 2,) or not inv_freq.is_contiguous()
            or meta.slot_mapping.shape[0] > tokens):
        return None
    if qk_norm is not None and any(w.dtype != qkv.dtype or w.shape != (dim,) or not w.is_contiguous() or not w.is_cpu
                                   for w in qk_norm[:2]):
        return None
    for t in (meta.slot_mapping, meta.block_tables, meta.context_lens, meta.cu_seqlens_q):
        if t.dtype != torch.int32 or not t.is_contiguous() or t.is_cuda:
            return None
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] < n or meta.cu_seqlens_q.shape[0] < n + 1:
        return None
    num_blocks, block_size = k_cache.shape[:2]
    out = torch.empty(tokens, num_heads, dim, dtype=qkv.dtype)
    scratch = torch.empty(tokens, num_heads + num_kv_heads, dim, dtype=qkv.dtype)
    q_norm, k_norm, eps = (0, 0, 0.0) if qk_norm is None else (qk_norm[0].data_ptr(), qk_norm[1].data_ptr(),
                                                                qk_norm[2])
    _cpu.qkv_attention_cpu(
        qkv.data_ptr(), q_norm, k_norm, positions.data_ptr(), inv_freq.data_ptr(), scratch.data_ptr(),
        meta.slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), meta.block_tables.data_ptr(),
        meta.context_lens.data_ptr(), meta.cu_seqlens_q.data_ptr(), out.data_ptr(), tokens, qkv.stride(0),
        meta.slot_mapping.shape[0], meta.block_tables.shape[1], n, num_heads, num_kv_heads, dim, block_size,
        num_blocks, eps, scale, KERNEL_DTYPES[qkv.dtype], torch.get_num_threads(),
    )
    return _zero_padding(out, meta)
