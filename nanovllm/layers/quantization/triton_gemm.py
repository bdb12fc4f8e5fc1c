"""The CUDA GEMM on quantized weights: a Triton kernel that reads int8 or int4 weights, dequantizes
a tile at a time in registers ((q - z) * s, the group's scale and zero point gathered per column)
and multiplies it with the activations' tile on the tensor cores (`tl.dot` in the activations'
dtype, fp32 accumulation). tests/test_quant_triton.py runs it under Triton's interpreter on the
CPU; scripts/gpu_check.sh runs the GPU tests on a GPU.

Weight layout (`TritonWeight`): int8 values `[out, in]`, or int4 values two to a byte along the input
dimension (low nibble the even column), stored as q + 8; fp32 scales and zero points `[out, groups]`
(the zero points with the same + 8 for int4; all 0 or 8 when symmetric).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from nanovllm.layers.quantization.weights import QuantizedWeight


@dataclasses.dataclass(frozen=True)
class TritonWeight:
    q: torch.Tensor  # int8 [out, in] or uint8 [out, ceil(in / 2)] (int4)
    scales: torch.Tensor  # float32 [out, groups]
    zeros: torch.Tensor  # float32 [out, groups], the offset included
    out_features: int
    in_features: int
    bits: int
    group_size: int
    perm: torch.Tensor | None

    @classmethod
    def from_weight(cls, w: QuantizedWeight, device: torch.device | str) -> TritonWeight:
        offset = 8 if w.bits == 4 else 0
        q = w.qweight
        if w.bits == 4:
            nib = (q.to(torch.int16) + 8).to(torch.uint8)
            if nib.shape[1] % 2:
                nib = torch.nn.functional.pad(nib, (0, 1))
            q = nib[:, 0::2] | (nib[:, 1::2] << 4)
        zeros = torch.zeros_like(w.scales) if w.zeros is None else w.zeros.float()
        return cls(q.contiguous().to(device), w.scales.to(device), (zeros + offset).contiguous().to(device),
                   w.out_features, w.in_features, w.bits, w.group_size,
                   None if w.perm is None else w.perm.to(device))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.zeros))


@triton.jit
def _dequant_gemm(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, M, N, K, stride_x, stride_q, stride_y, GROUPS,
                  GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = n_ok[:, None] & k_ok[None, :]
        if BITS == 4:
            byte = tl.load(q_ptr + rn[:, None] * stride_q + (rk[None, :] // 2), mask=w_ok, other=0).to(tl.int32)
            q = (byte >> ((rk[None, :] % 2) * 4)) & 15
        else:
            q = tl.load(q_ptr + rn[:, None] * stride_q + rk[None, :], mask=w_ok, other=0).to(tl.int32)
        g = rn[:, None] * GROUPS + rk[None, :] // GROUP_SIZE
        s = tl.load(s_ptr + g, mask=w_ok, other=0.0)
        z = tl.load(z_ptr + g, mask=w_ok, other=0.0)
        w = (q.to(tl.float32) - z) * s  # [BLOCK_N, BLOCK_K]
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), out_dtype=tl.float32, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def precision(dtype: torch.dtype) -> str:
    """fp32 activations multiply in full fp32 ("ieee"), not TF32: the model's dtype is what runs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def linear(x: torch.Tensor, w: TritonWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, dequantize(W), bias)`, x `[..., in]` on the weight's device."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {w.in_features}")
    rows = x.reshape(-1, w.in_features)
    if w.perm is not None:
        rows = rows.index_select(1, w.perm)
    rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty((m, w.out_features), dtype=x.dtype, device=x.device)
    if m:
        block_m = 16 if m <= 16 else 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(w.out_features, 64))
        _dequant_gemm[grid](rows, w.q, w.scales, w.zeros, bias if bias is not None else y, y, m, w.out_features,
                            w.in_features, rows.stride(0), w.q.stride(0), y.stride(0), w.scales.shape[1],
                            GROUP_SIZE=w.group_size, BITS=w.bits, HAS_BIAS=bias is not None, BLOCK_M=block_m,
                            BLOCK_N=64, BLOCK_K=32, PRECISION=precision(x.dtype))
    return y.reshape(*x.shape[:-1], w.out_features)
