"""CPU GEMMs on weights packed once after loading, instead of `F.linear` (MKL) on the dense weight.

Two packed forms; `prepack` picks one per CPU:

- `gemm_cpu` (csrc/cpu_gemm.cpp), where the CPU's widest vectors are AVX2 + FMA (no AVX-512): a
  6 x 16 register-tiled fp32 GEMM on a weight packed in 16-column panels. On this project's AVX2
  machine it ran the bench models' shapes at 130-175 GF/s of the two cores' ~185 (oneDNN's
  prepacked matmul: 85-140, MKL's `F.linear`: 45-130; benchmarks/cpu_linear.py,
  benchmarks/RESULTS.md), so every fp32 and bf16 linear layer takes it there. A bf16 weight stays
  bf16 in the panels (half the memory and bandwidth of an fp32 copy), widened in registers; the
  activations are widened to fp32 and the product rounded to bf16, as a bf16 GEMM with fp32
  accumulation gives.
- oneDNN (`mkldnn._reorder_linear_weight` for a batch of ~64 rows, then `_linear_pointwise`) on
  other CPUs: on AVX-512 its kernels use the full vector width, which ours do not. fp32 layers are
  prepacked there when the weight has at least PREPACK_MIN_WEIGHTS elements (below that `F.linear`
  was as fast); bf16 layers are prepacked as bf16 where the CPU computes bf16 (AVX512-BF16, AMX),
  and as fp32 copies where it does not (torch's emulated bf16 GEMMs ran 5-10x slower than fp32).

Either way the results differ from `F.linear`'s only in summation order.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm import _cpu
from nanovllm.cpu import KERNEL_DTYPES, huge_pages
from nanovllm.cpu.features import GemmKernel, gemm_kernel, native_bf16

PREPACK_MIN_WEIGHTS = 1 << 17
BATCH_HINT = 64  # the row count oneDNN's reorder optimizes for: a decode batch


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """`gemm_cpu`'s copy of an `[out_features, in_features]` weight: fp32, or bf16 from a bf16 one."""
    data: torch.Tensor  # flat, _cpu.gemm_packed_elements(out_features, in_features) elements
    out_features: int
    in_features: int


Packed = torch.Tensor | PackedWeight  # a layer's `packed`: oneDNN's opaque tensor or ours


def emulated_bf16(weight: torch.Tensor) -> bool:
    """A bf16 weight on a CPU that does not compute bf16: oneDNN gets an fp32 copy (see above)."""
    return weight.dtype == torch.bfloat16 and not native_bf16()


def can_prepack(weight: torch.Tensor, kernel: GemmKernel | None = None) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in KERNEL_DTYPES:
        return False
    if (kernel or gemm_kernel()) == "avx2":
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    return emulated_bf16(weight) or weight.numel() >= PREPACK_MIN_WEIGHTS


def prepack(weight: torch.Tensor, kernel: GemmKernel | None = None) -> Packed:
    """The packed copy of an `[out, in]` weight for `kernel` (default: this CPU's, features.gemm_kernel)."""
    w = weight.detach()
    if (kernel or gemm_kernel()) == "avx2":
        if not _cpu.has_avx2_fma():
            raise ValueError("the avx2 GEMM needs a CPU with AVX2 and FMA")
        n, k = w.shape
        data = huge_pages.empty(_cpu.gemm_packed_elements(n, k), w.dtype)  # streamed every step
        stride = _row_stride(w)
        if stride is None:
            w = w.contiguous()
            stride = k
        _cpu.gemm_pack_cpu(w.data_ptr(), KERNEL_DTYPES[w.dtype], n, k, stride, data.data_ptr())
        return PackedWeight(data, n, k)
    if emulated_bf16(weight):
        w = w.float()
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), BATCH_HINT)


def _row_stride(t: torch.Tensor) -> int | None:
    """The row stride gemm_cpu / gemm_pack_cpu read a 2-D tensor with in place, or None when its
    rows are not contiguous or overlap (then a contiguous copy is needed). A single row's stride is
    arbitrary (expand gives 0): the row length stands in for it."""
    rows, k = t.shape
    if t.stride(1) != 1 or (rows > 1 and t.stride(0) < k):
        return None
    return t.stride(0) if rows > 1 else k


def fp32_rows(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """2-D rows as fp32 the C++ GEMMs read in place, and their stride: the rows themselves when they
    are fp32 with contiguous, non-overlapping rows, else a contiguous fp32 copy."""
    stride = _row_stride(rows) if rows.dtype == torch.float32 else None
    if stride is None:
        return rows.float().contiguous(), rows.shape[1]
    return rows, stride


def _gemm(rows: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """gemm_cpu on 2-D rows; the product is fp32, returned in the rows' dtype."""
    if rows.shape[1] != packed.in_features:
        raise ValueError(f"input has {rows.shape[1]} features, the weight {packed.in_features}")
    if bias is not None and bias.shape != (packed.out_features,):
        raise ValueError(f"bias of shape {tuple(bias.shape)} for {packed.out_features} outputs")
    m, k = rows.shape
    x, stride = fp32_rows(rows)
    b = None if bias is None else bias.float().contiguous()
    y = torch.empty((m, packed.out_features), dtype=torch.float32)
    if m:
        _cpu.gemm_cpu(x.data_ptr(), packed.data.data_ptr(), 0 if b is None else b.data_ptr(), y.data_ptr(), m,
                    packed.out_features, k, stride, packed.out_features,
                    KERNEL_DTYPES[packed.data.dtype], torch.get_num_threads())
    return y if rows.dtype == torch.float32 else y.to(rows.dtype)


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for the weight `packed` was made from; x `[..., in]`."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if isinstance(packed, PackedWeight):
        y = _gemm(rows, packed, bias)
    elif packed.dtype != x.dtype:  # oneDNN on an fp32 copy of a bf16 weight
        y = torch.ops.mkldnn._linear_pointwise(rows.to(packed.dtype).contiguous(), packed,
                                               None if bias is None else bias.to(packed.dtype), "none", [], "")
        y = y.to(x.dtype)
    else:
        y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def prepack_layer(layer: nn.Module, keep_dense: bool = False) -> bool:
    """Give a layer with `weight` and `packed` attributes (a linear layer, the LM head) a packed
    copy of its weight when it gains from it; its dense weight is released (an empty tensor) unless
    `keep_dense` (a tied LM head: the embedding still looks rows up in it)."""
    if layer.packed is not None or not can_prepack(layer.weight):
        return False
    layer.packed = prepack(layer.weight)
    if not keep_dense:
        layer.weight.data = layer.weight.data.new_empty(0)
    return True


def matmul(x: torch.Tensor, weight: torch.Tensor, packed: Packed | None,
           bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, on `packed` when the layer has it."""
    return F.linear(x, weight, bias) if packed is None else linear(x, packed, bias)


def prepack_model(model: torch.nn.Module) -> int:
    """Prepack every layer of `model` that gains from it (the layers' `prepack_for_cpu`); returns
    how many were."""
    return sum(bool(m.prepack_for_cpu()) for m in model.modules() if hasattr(m, "prepack_for_cpu"))
