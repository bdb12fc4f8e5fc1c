"""The `cuda` attention backend: our kernels for the cache write and decodes, flash-attn or Triton
for prefill chunks. Same contract as `torch_backend` (the reference it is tested against).

Per step the batch is `num_decode_tokens` decodes (one token per sequence, first) followed by
prefill chunks. Decodes go to the paged decode kernel (kernels/paged_decode.cuh). Prefill chunks
go to, in order of preference:
1. flash-attn's `flash_attn_varlen_func` with the block table, where flash-attn is installed, the
   dtype is fp16/bf16 and the block size is a multiple of 256 (flash-attn's paged-KV requirement);
2. the Triton paged prefill kernel (nanovllm/attention/triton_prefill.py), imported on first use;
3. the torch reference, with a warning (a GPU with neither flash-attn nor Triton still runs).

Importing this module requires the compiled `nanovllm._kernels` (ImportError otherwise, which
`get_attention_backend("cuda")` reports); it never imports flash-attn or Triton by itself.

Nothing here synchronizes with the GPU: only host ints of the metadata are read (counts and
maxima), so the decode path can be captured in a CUDA graph.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from nanovllm import _kernels  # noqa: F401  (fails the import where the kernels are not built)
from nanovllm.attention import cuda_ops
from nanovllm.attention.metadata import AttentionMetadata, HostSeqLens

logger = logging.getLogger(__name__)

write_kv_cache = cuda_ops.write_kv_cache

# Resolved on first use: "flash" / "triton" -> the prefill function, or None where unavailable.
_prefill_impls: dict[str, Any] = {}
FLASH_ATTN_BLOCK_MULTIPLE = 256


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of each new token over its sequence's cached context (see torch_backend)."""
    out = torch.empty_like(query)
    nd = meta.num_decode_tokens
    npf = meta.num_prefill_tokens
    if nd:
        cuda_ops.decode_attention(query, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                  num_seqs=nd, max_context_len=meta.max_seqlen_k, out=out)
    if npf:
        prefill_attention(query, k_cache, v_cache, meta, scale, out)
    covered = nd + npf
    if query.shape[0] > covered:  # padding rows: zero, like the reference
        out[covered:].zero_()
    return out


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, out: torch.Tensor) -> None:
    """Rows `num_decode_tokens : num_decode_tokens + num_prefill_tokens` of `out`."""
    if not query.is_cuda:  # the kernels' CPU emulation in the tests
        _reference_prefill(query, k_cache, v_cache, meta, scale, out)
        return
    if _use_flash_attn(query, k_cache):
        _flash_prefill(query, k_cache, v_cache, meta, scale, out)
        return
    triton_prefill = _triton()
    if triton_prefill is not None:
        nd = meta.num_decode_tokens
        triton_prefill(query, k_cache, v_cache, out, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                       first_seq=nd, num_seqs=meta.num_seqs - nd, max_seqlen_q=meta.max_seqlen_q, scale=scale)
        return
    _reference_prefill(query, k_cache, v_cache, meta, scale, out)


def prefill_implementation(dtype: torch.dtype, block_size: int) -> str:
    """Which prefill path a step with this dtype and block size takes here: flash_attn, triton or torch."""
    flash_ok = dtype in (torch.float16, torch.bfloat16) and block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0
    if flash_ok and _flash() is not None:
        return "flash_attn"
    return "triton" if _triton() is not None else "torch"


# --- flash-attn -----------------------------------------------------------------------------------


def _flash() -> Any:
    if "flash" not in _prefill_impls:
        try:
            from flash_attn import flash_attn_varlen_func
        except Exception:  # ImportError, or a flash-attn built for another torch/CUDA
            flash_attn_varlen_func = None
        _prefill_impls["flash"] = flash_attn_varlen_func
    return _prefill_impls["flash"]


def _use_flash_attn(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (query.dtype in (torch.float16, torch.bfloat16) and k_cache.shape[1] % FLASH_ATTN_BLOCK_MULTIPLE == 0
            and _flash() is not None)


def _flash_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, out: torch.Tensor) -> None:
    nd, npf = meta.num_decode_tokens, meta.num_prefill_tokens
    # flash-attn wants prefix sums that start at 0 for the sequences it sees: shift on the device.
    cu_q = meta.cu_seqlens_q[nd:] - nd
    cu_k = meta.cu_seqlens_k[nd:] - meta.cu_seqlens_k[nd:nd + 1]
    # Causal with seqlen_q < seqlen_k aligns the queries to the end of the keys (flash-attn >= 2.1),
    # i.e. query i of a chunk sits at position context_len - q_len + i: our semantics.
    o = _flash()(query[nd:nd + npf], k_cache, v_cache, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                 max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale,
                 causal=True, block_table=meta.block_tables[nd:])
    out[nd:nd + npf].copy_(o)


# --- Triton ---------------------------------------------------------------------------------------


def _triton() -> Any:
    if "triton" not in _prefill_impls:
        try:
            from nanovllm.attention.triton_prefill import prefill_attention as fn
        except Exception as e:  # no triton, or one that cannot compile for this GPU
            logger.warning("Triton is unavailable (%s): prefill attention falls back to the slow torch "
                           "reference; install flash-attn or triton for speed", e)
            fn = None
        _prefill_impls["triton"] = fn
    return _prefill_impls["triton"]


# --- torch reference ------------------------------------------------------------------------------


def _reference_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, out: torch.Tensor) -> None:
    from nanovllm.attention import torch_backend

    nd, npf = meta.num_decode_tokens, meta.num_prefill_tokens
    host = meta.host_lens()  # the runner passes host copies; otherwise this synchronizes once
    cu_q = [int(x) - nd for x in host.cu_seqlens_q[nd:]]
    ctx = [int(x) for x in host.context_lens[nd:]]
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[nd:nd + npf], cu_seqlens_q=meta.cu_seqlens_q[nd:] - nd,
        cu_seqlens_k=meta.cu_seqlens_k[nd:] - meta.cu_seqlens_k[nd:nd + 1], context_lens=meta.context_lens[nd:],
        block_tables=meta.block_tables[nd:], max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
        num_prefill_tokens=npf, num_decode_tokens=0, block_size=meta.block_size,
        host=HostSeqLens(cu_seqlens_q=cu_q, context_lens=ctx),
    )
    out[nd:nd + npf] = torch_backend.paged_attention(query[nd:nd + npf], k_cache, v_cache, sub, scale)
