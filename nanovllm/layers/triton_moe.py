"""The mixture-of-experts layer on CUDA: a Triton grouped GEMM over the rows sorted by expert.

Each row t of x and each of its top_k experts make one assignment, t * top_k + j. The assignments
are sorted by expert, and each expert's run is padded to a multiple of BLOCK_M with a sentinel
(`align`), so a block of BLOCK_M sorted rows belongs to one expert. One program computes a
BLOCK_M x BLOCK_N tile of one block: it gathers its rows of the input (row t of x for the gate/up
GEMM, the assignment's own row for the down GEMM), multiplies them by that expert's weight, scales
them by the routing weight if asked and scatters them to the assignments' rows of the output.
Blocks past the used ones (the grid is sized for the worst case, so that the launch, and a CUDA
graph around it, does not depend on the routing) return at once. Everything here stays on the
device: no host synchronization, so a decode step can be captured in a CUDA graph.

Importing this module imports triton: `fused_moe` does so only when a CUDA forward needs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_assignments", "row_div"])
def _grouped_gemm_kernel(
    A, B, C, SORTED, BLOCK_EXPERT, WEIGHTS,
    N, K, num_assignments, row_div,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    MUL_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BLOCK_EXPERT + pid_m)
    if expert < 0:  # past the used blocks
        return
    rows = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = rows < num_assignments  # the padding of an expert's last block
    a_rows = (rows // row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    b_base = B + expert.to(tl.int64) * stride_be
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(A + a_rows[:, None] * stride_am + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_WEIGHTS:
        acc = acc * tl.load(WEIGHTS + rows, mask=m_ok, other=0.0)[:, None]
    tl.store(C + rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class Alignment:
    """The assignments sorted by expert, each expert's run padded to a multiple of block_m."""
    sorted: torch.Tensor  # [blocks * block_m] int32: assignment ids, num_assignments where padding
    block_expert: torch.Tensor  # [blocks] int32: each block's expert, -1 past the used blocks
    block_m: int


def align(ids: torch.Tensor, experts: int, block_m: int) -> Alignment:
    """ids `[T, top_k]` -> the grouped, padded order of the T * top_k assignments, sized for the
    worst case (every expert's run one row past a block boundary)."""
    flat = ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.zeros(experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    by_expert, order = torch.sort(flat, stable=True)
    rank = torch.arange(n, device=ids.device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    blocks = triton.cdiv(n + experts * (block_m - 1), block_m)
    sorted_rows = torch.full((blocks * block_m,), n, dtype=torch.int32, device=ids.device)
    sorted_rows[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < experts, block_expert, -1).to(torch.int32)
    return Alignment(sorted_rows, block_expert, block_m)


def _gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, al: Alignment, row_div: int,
          weights: torch.Tensor | None) -> None:
    """out[s] = a[s // row_div] @ w[expert of s]^T (* weights[s]) for every assignment s."""
    n, k = w.shape[1], w.shape[2]
    fp32 = a.dtype == torch.float32
    block_n, block_k = 64, 32 if fp32 else 64
    grid = (al.block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, al.sorted, al.block_expert, out if weights is None else weights,
        n, k, out.shape[0], row_div,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        MUL_WEIGHTS=weights is not None, BLOCK_M=al.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        # fp32 stays exact (tf32 would round the operands to 10 mantissa bits).
        PRECISION="ieee" if fp32 else "tf32",
        num_warps=4, num_stages=2 if fp32 else 3,
    )


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor) -> torch.Tensor:
    """As moe_torch.experts: x `[T, H]`, ids / weights `[T, top_k]` (any integer / float dtype),
    w13 `[E, 2I, H]`, w2 `[E, H, I]`, all on one CUDA device, rows of x contiguous."""
    rows, top_k = ids.shape
    experts, two_inter, hidden = w13.shape
    if rows == 0:
        return torch.empty_like(x)
    # A block's rows share an expert: 16 when an expert sees a few rows (decode), 64 for prefills.
    block_m = 64 if rows * top_k >= 64 * experts else 16
    al = align(ids, experts, block_m)
    h = torch.empty(rows * top_k, two_inter, dtype=x.dtype, device=x.device)
    _gemm(x, w13, h, al, top_k, None)
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()
    y = torch.empty(rows * top_k, hidden, dtype=x.dtype, device=x.device)
    _gemm(act, w2, y, al, 1, weights.reshape(-1).float().contiguous())
    return y.view(rows, top_k, hidden).sum(dim=1)
