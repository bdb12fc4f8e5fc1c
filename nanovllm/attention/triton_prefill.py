"""Paged prefill attention in Triton, for GPUs without flash-attn (and for fp32, which it lacks).

Each prefill sequence's chunk of q_len new tokens sits at absolute positions
`context_len - q_len ... context_len - 1`; its keys are the whole context (cached prefix plus the
chunk, whose K/V the cache write has just stored), read straight from the paged cache through the
block table, causally masked. One program handles BLOCK_M queries of one head of one sequence
and walks the keys up to its last query in BLOCK_N tiles with an online softmax (exp2 domain, fp32
accumulators), like flash-attention; GQA maps query head h to KV head h // group.

Importing this module imports triton: `cuda_backend` does so only when a prefill needs it, so
CPU-only installs never touch triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


# first_seq (the step's number of decodes) changes every step: specializing on its value (== 1,
# divisible by 16) would recompile the kernel in the middle of serving. The GQA group is a plain
# argument too (one integer division per program), so a group size costs no compile of its own.
# BT/CU_Q/CTX are views of the plan buffer whose sections are only 8-byte aligned, while the
# memory-profiling forward passes fresh tensors: one variant, compiled once, serves both.
@triton.jit(do_not_specialize=["first_seq", "group"], do_not_specialize_on_alignment=["BT", "CU_Q", "CTX"])
def _paged_prefill_kernel(
    Q, K, V, O, BT, CU_Q, CTX,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, first_seq, block_size, group,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = first_seq + tl.program_id(0)
    head = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start = tl.load(CU_Q + seq)
    q_len = tl.load(CU_Q + seq + 1) - q_start
    if mblk * BLOCK_M >= q_len:  # the grid is sized for the longest chunk of the batch
        return
    ctx = tl.load(CTX + seq)
    prefix = ctx - q_len

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = prefix + offs_m  # absolute positions of this block's queries
    kv_head = head // group
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    bt_row = BT + seq.to(tl.int64) * stride_bt
    # Keys past this block's last query are masked for every row: stop there.
    hi = tl.minimum(ctx, prefix + (mblk + 1) * BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        block = tl.load(bt_row + offs_n // block_size, mask=n_ok, other=0).to(tl.int64)
        slot = (offs_n % block_size).to(tl.int64)
        k = tl.load(k_base + block[None, :] * stride_kb + slot[None, :] * stride_ks + offs_d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        # The first tile holds key 0, which every row may see, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + block[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])


def _config(dtype: torch.dtype, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), sized so the tiles fit in shared memory."""
    if dtype == torch.float32:
        # fp32 runs the exact ("ieee") FMA path: tests and fp32 models only, so keep tiles small.
        return (32, 32, 4, 2) if block_d <= 64 else (16, 32, 4, 1)
    if block_d <= 64:
        return 64, 64, 4, 3
    if block_d <= 128:
        return 64, 64, 4, 2
    return 64, 32, 8, 2


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    first_seq: int,
    num_seqs: int,
    max_seqlen_q: int,
    scale: float,
) -> None:
    """Writes `out` rows of sequences `first_seq .. first_seq + num_seqs - 1` (their
    `cu_seqlens_q` ranges). query/out `[T, H, D]`, caches `[blocks, block_size, Hkv, D]`, each with
    a contiguous last dimension; the metadata tensors int32 on the same device (not checked here:
    `cuda_backend` passes the step's metadata as is)."""
    if num_seqs <= 0 or max_seqlen_q <= 0:
        return
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dim >= 16
    block_m, block_n, num_warps, num_stages = _config(query.dtype, block_d)
    grid = (num_seqs, num_heads, triton.cdiv(max_seqlen_q, block_m))
    _paged_prefill_kernel[grid](
        query, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens,
        float(scale) * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), first_seq, k_cache.shape[1], num_heads // num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n,
        # fp32 must stay exact (the tests compare against an fp32 reference at 1e-5); tf32 would
        # round q and k to 10 mantissa bits. For fp16/bf16 the precision argument has no effect.
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
