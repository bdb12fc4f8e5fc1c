"""The fused CPU layers of `nanovllm._C` (csrc/cpu_fused_ops.cpp) behind torch-tensor signatures.

`can_*(...)` says whether a call can take the fused path: CPU tensors of a kernel dtype (fp32, bf16)
laid out as the kernels read them. The layers fall back to their torch code otherwise.
"""

from __future__ import annotations

import torch

from nanovllm import _C
from nanovllm.attention.cpu_backend import KERNEL_DTYPES


def _kernel_layout(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in KERNEL_DTYPES and x.stride(-1) == 1


def can_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """x `[T, H]`, or `[T, heads, H]` with contiguous heads (q/k views of the qkv output); the
    residual, if any, a contiguous `[T, H]` like x; the weight `[H]` in x's dtype."""
    if not _kernel_layout(x) or weight.dtype != x.dtype or weight.shape != x.shape[-1:] or not weight.is_contiguous():
        return False
    if residual is not None:
        return x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
    return x.dim() == 2 or (x.dim() == 3 and x.stride(1) == x.shape[2])


def can_silu_and_mul(x: torch.Tensor) -> bool:
    return _kernel_layout(x) and x.dim() == 2 and x.shape[1] % 2 == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As RMSNorm.forward: norm(x), or (norm(x + residual), x + residual)."""
    if not can_rms_norm(x, weight, residual):
        raise ValueError(f"rms_norm: unsupported input {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    hidden = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    out = torch.empty(x.shape, dtype=x.dtype)
    residual_out = None if residual is None else torch.empty_like(out)
    if x.shape[0]:
        _C.rms_norm_cpu(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
                        out.data_ptr(), 0 if residual_out is None else residual_out.data_ptr(),
                        x.shape[0] * heads, hidden, heads, x.stride(0), eps, KERNEL_DTYPES[x.dtype],
                        torch.get_num_threads())
    return out if residual_out is None else (out, residual_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x `[T, 2 * I]` (gate | up) -> silu(gate) * up `[T, I]`."""
    if not can_silu_and_mul(x):
        raise ValueError(f"silu_and_mul: unsupported input {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    inner = x.shape[1] // 2
    out = torch.empty((x.shape[0], inner), dtype=x.dtype)
    if x.shape[0]:
        _C.silu_and_mul_cpu(x.data_ptr(), out.data_ptr(), x.shape[0], inner, x.stride(0), KERNEL_DTYPES[x.dtype],
                            torch.get_num_threads())
    return out
