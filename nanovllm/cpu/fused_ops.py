"""The fused CPU layers of `nanovllm._cpu` (csrc/cpu_fused_ops.cpp) behind torch-tensor signatures.

`can_*(...)` says whether a call can take the fused path: CPU tensors of a kernel dtype (fp32, bf16)
laid out as the kernels read them. The layers call `try_*`, which runs the kernel where it can and
returns None otherwise (they then fall back to their torch code): one check a call, since a decode
step at batch 1 makes ~60 of these calls and their Python is most of their time.
"""

from __future__ import annotations

import torch

from nanovllm import _cpu
from nanovllm.cpu import KERNEL_DTYPES


def _kernel_layout(x: torch.Tensor) -> bool:
    return x.is_cpu and x.dtype in KERNEL_DTYPES and x.stride(-1) == 1


def can_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """x `[T, H]`, or `[T, heads, H]` with contiguous heads (q/k views of the qkv output); the
    residual, if any, a contiguous `[T, H]` like x; the weight `[H]` in x's dtype."""
    if not _kernel_layout(x) or weight.dtype != x.dtype or weight.shape != x.shape[-1:] or not weight.is_contiguous():
        return False
    if residual is not None:
        return x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
    return x.dim() == 2 or (x.dim() == 3 and x.stride(1) == x.shape[2])


def can_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
    """q `[T, Hq, D]`, k `[T, Hk, D]` of one kernel dtype with contiguous heads (views of the qkv
    output qualify), int32 positions `[T]`."""
    if not (_kernel_layout(q) and k.dtype == q.dtype and _kernel_layout(k)):
        return False
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return False
    if q.stride(1) != q.shape[2] or k.stride(1) != k.shape[2]:
        return False
    return positions.dtype == torch.int32 and positions.is_cpu and positions.is_contiguous() \
        and positions.shape == q.shape[:1]


def can_silu_and_mul(x: torch.Tensor) -> bool:
    return _kernel_layout(x) and x.dim() == 2 and x.shape[1] % 2 == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As RMSNorm.forward: norm(x), or (norm(x + residual), x + residual)."""
    out = try_rms_norm(x, weight, eps, residual)
    if out is None:
        raise ValueError(f"rms_norm: unsupported input {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    return out


def try_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """rms_norm where can_rms_norm, else None."""
    if not can_rms_norm(x, weight, residual):
        return None
    hidden = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = None if residual is None else torch.empty_like(out)
    if x.shape[0]:
        _cpu.rms_norm_cpu(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
                        out.data_ptr(), 0 if residual_out is None else residual_out.data_ptr(),
                        x.shape[0] * heads, hidden, heads, x.stride(0), eps, KERNEL_DTYPES[x.dtype],
                        torch.get_num_threads())
    return out if residual_out is None else (out, residual_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x `[T, 2 * I]` (gate | up) -> silu(gate) * up `[T, I]`."""
    out = try_silu_and_mul(x)
    if out is None:
        raise ValueError(f"silu_and_mul: unsupported input {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    return out


def try_silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu_and_mul where can_silu_and_mul, else None."""
    if not can_silu_and_mul(x):
        return None
    inner = x.shape[1] // 2
    out = torch.empty(x.shape[0], inner, dtype=x.dtype)
    if x.shape[0]:
        _cpu.silu_and_mul_cpu(x.data_ptr(), out.data_ptr(), x.shape[0], inner, x.stride(0), KERNEL_DTYPES[x.dtype],
                            torch.get_num_threads())
    return out


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Rotate q and k in place (as RotaryEmbedding.forward computes them); inv_freq fp32 `[D / 2]`."""
    if not try_rotary_(positions, q, k, inv_freq):
        raise ValueError(f"rotary_: unsupported input q {tuple(q.shape)} {q.dtype} strides {q.stride()}, "
                         f"k {tuple(k.shape)}, positions {positions.dtype}")


def try_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor) -> bool:
    """rotary_ where can_rotary and inv_freq fits: whether it ran."""
    if not can_rotary(positions, q, k) or inv_freq.dtype != torch.float32 or not inv_freq.is_contiguous() \
            or inv_freq.shape != (q.shape[2] // 2,):
        return False
    if q.shape[0]:
        _cpu.rotary_cpu(q.data_ptr(), k.data_ptr(), positions.data_ptr(), inv_freq.data_ptr(), q.shape[0], q.shape[1],
                      k.shape[1], q.shape[2], q.stride(0), k.stride(0), KERNEL_DTYPES[q.dtype],
                      torch.get_num_threads())
    return True
