"""CPU GEMMs on weights packed once after loading, instead of `F.linear` (MKL) on the dense weight.

Two packed forms; `prepack` picks one per weight (`layer_kernel`):

- ours (kernel "avx2", csrc/cpu_gemm.cpp) wherever the CPU has AVX2 + FMA: a BLIS-style
  register-tiled GEMM on a weight packed in 16-column panels, the rows of x packed per cache block.
  fp32 weights: AVX-512 tiles (12 x 32) on weights packed in panel pairs where the CPU has AVX-512,
  else AVX2 ones (6 x 16). bf16 weights: AVX512-BF16 dot products on weights packed in k pairs
  (12 x 32 tiles) where the CPU has them, else the bf16 weight widened in registers (half the
  memory and bandwidth of an fp32 copy). Where the process has AMX tiles, the pair-packed bf16
  weights are multiplied on them instead (csrc/cpu_gemm_amx.cpp), for depths that 32 divides.
  On the AVX2 machine it ran the bench models' shapes at 130-175 GF/s of the two cores' ~185
  (oneDNN's prepacked matmul: 85-140). On an AVX-512 Zen 4 (benchmarks/RESULTS.md, "Our GEMM on
  AVX-512 CPUs"): fp32 decode at one row 1.5-1.7x oneDNN's tokens/s, at 32 rows and in prefill
  within the machine's noise of it.
- oneDNN (`mkldnn._reorder_linear_weight` for a batch of ~64 rows, then `_linear_pointwise`) for
  bf16 weights of PREPACK_MIN_WEIGHTS and more where the CPU computes bf16 natively with vector
  units only (AVX512-BF16 without AMX tiles), but the LM head's (`head_kernel`: it sees decode
  rows only): on Zen 4 our pair tiles ran the bench model's layers 1.7-2.3x faster at one row,
  even at 32-64 rows, but 10-30% slower from 256 rows up (a prefill); and for every layer on CPUs
  without AVX2. Where the process has AMX tiles the bf16 layers take ours on them: on the Intel
  Xeon with AMX the Qwen3-shaped model decoded 1.5x faster at one sequence and 1.13x at 32 than on
  oneDNN's (AMX too), mostly because the layers then run as one C++ call (cpu_stack; their GEMMs
  took about as long), while its batch prefill took 1.3x as long (benchmarks/RESULTS.md).

Either way the results differ from `F.linear`'s only in summation order (and, on pair-packed bf16
weights, fp32 activations are rounded to bf16 first, and vdpbf16ps treats denormal inputs and
results as zero).
"""

from __future__ import annotations

import dataclasses

import numpy as np
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
    """Our copy of an `[out_features, in_features]` weight: for `gemm_cpu` fp32, or bf16 from a bf16
    one; with `pairs`, laid out for the AVX-512 pair tiles: fp32 in panel pairs (`gemm_cpu`'s
    pairs), bf16 in k pairs for `gemm_bf16_cpu` (AVX512-BF16 dot products)."""
    data: torch.Tensor  # flat, _cpu.gemm_packed_elements(out_features, in_features) elements
    out_features: int
    in_features: int
    pairs: bool = False


def can_pair(weight: torch.Tensor) -> bool:
    """Whether a weight takes the AVX-512 pair tiles here. fp32: on any AVX-512 CPU (two panels a
    tile, each broadcast of x feeding two FMAs). bf16: with AVX512-BF16 and an even depth (twice
    the multiply-adds of an FMA per instruction, on the bf16 values themselves: a bf16 GEMM with
    fp32 accumulation)."""
    if weight.dtype == torch.float32:
        return _cpu.has_avx512f()
    return weight.dtype == torch.bfloat16 and weight.shape[-1] % 2 == 0 and _cpu.has_avx512_bf16()


Packed = torch.Tensor | PackedWeight  # a layer's `packed`: oneDNN's opaque tensor or ours


def emulated_bf16(weight: torch.Tensor) -> bool:
    """A bf16 weight on a CPU that does not compute bf16: oneDNN gets an fp32 copy (see above)."""
    return weight.dtype == torch.bfloat16 and not native_bf16()


def layer_kernel(weight: torch.Tensor) -> GemmKernel:
    """The packing a weight takes on this CPU (see the module's docstring)."""
    if (weight.dtype == torch.bfloat16 and native_bf16() and weight.numel() >= PREPACK_MIN_WEIGHTS
            and torch.backends.mkldnn.is_available() and not _cpu.has_amx_bf16()):
        return "onednn"
    return gemm_kernel()


def head_kernel() -> GemmKernel:
    """The LM head's packing: ours wherever it runs, whatever `layer_kernel` gives a linear layer of
    its dtype. The head sees only the rows being sampled (a decode batch, the last token of each
    prefilled prompt), and on the AVX512-BF16 Zen 4 our pair tiles read its bf16 weight at 30-33
    GB/s up to 8 rows, 1.2-1.55x oneDNN's speed, and were even with it at 32 (benchmarks/RESULTS.md,
    "The LM head on our GEMM")."""
    return gemm_kernel()


def can_prepack(weight: torch.Tensor, kernel: GemmKernel | None = None) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in KERNEL_DTYPES:
        return False
    if (kernel or layer_kernel(weight)) == "avx2":
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    return emulated_bf16(weight) or weight.numel() >= PREPACK_MIN_WEIGHTS


def prepack(weight: torch.Tensor, kernel: GemmKernel | None = None) -> Packed:
    """The packed copy of an `[out, in]` weight for `kernel` (default: `layer_kernel`'s)."""
    w = weight.detach()
    if (kernel or layer_kernel(weight)) == "avx2":
        if not _cpu.has_avx2_fma():
            raise ValueError("the avx2 GEMM needs a CPU with AVX2 and FMA")
        n, k = w.shape
        data = huge_pages.empty(_cpu.gemm_packed_elements(n, k), w.dtype)  # streamed every step
        stride = _row_stride(w)
        if stride is None:
            w = w.contiguous()
            stride = k
        pairs = can_pair(w)
        _cpu.gemm_pack_cpu(w.data_ptr(), KERNEL_DTYPES[w.dtype], n, k, stride, data.data_ptr(), pairs)
        return PackedWeight(data, n, k, pairs)
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


def bf16_rows(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """2-D rows as bf16 gemm_bf16_cpu reads in place, and their stride (as fp32_rows)."""
    stride = _row_stride(rows) if rows.dtype == torch.bfloat16 else None
    if stride is None:
        return rows.to(torch.bfloat16).contiguous(), rows.shape[1]
    return rows, stride


def fp32_rows(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """2-D rows as fp32 the C++ GEMMs read in place, and their stride: the rows themselves when they
    are fp32 with contiguous, non-overlapping rows, else a contiguous fp32 copy."""
    stride = _row_stride(rows) if rows.dtype == torch.float32 else None
    if stride is None:
        return rows.float().contiguous(), rows.shape[1]
    return rows, stride


def _gemm(rows: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Our GEMM on 2-D rows (gemm_cpu, or gemm_bf16_cpu for a pair-packed bf16 weight); the product
    is fp32, returned in the rows' dtype."""
    if rows.shape[1] != packed.in_features:
        raise ValueError(f"input has {rows.shape[1]} features, the weight {packed.in_features}")
    if bias is not None and bias.shape != (packed.out_features,):
        raise ValueError(f"bias of shape {tuple(bias.shape)} for {packed.out_features} outputs")
    m, k = rows.shape
    b = None if bias is None else bias.float().contiguous()
    y = torch.empty((m, packed.out_features), dtype=torch.float32)
    if m and packed.pairs and packed.data.dtype == torch.bfloat16:
        x, stride = bf16_rows(rows)
        _cpu.gemm_bf16_cpu(x.data_ptr(), packed.data.data_ptr(), 0 if b is None else b.data_ptr(), y.data_ptr(), m,
                           packed.out_features, k, stride, packed.out_features, torch.get_num_threads())
    elif m:
        x, stride = fp32_rows(rows)
        _cpu.gemm_cpu(x.data_ptr(), packed.data.data_ptr(), 0 if b is None else b.data_ptr(), y.data_ptr(), m,
                      packed.out_features, k, stride, packed.out_features,
                      KERNEL_DTYPES[packed.data.dtype], torch.get_num_threads(), packed.pairs)
    return y if rows.dtype == torch.float32 else y.to(rows.dtype)


def logits(rows: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """An LM head's fp32 logits `[m, out_features]` of 2-D fp32 or bf16 rows: `_gemm(rows, packed, None)`
    then `.float()` (bf16 rows give logits rounded to bf16, as F.linear's), the same bits but a NaN's
    (a NaN stays a NaN), in one call (gemm_logits_cpu) without the conversions' passes and tensors."""
    _check_head_rows(rows, packed)
    if not takes_head_rows(rows):
        return _gemm(rows, packed, None).float()
    rows, stride = _head_rows(rows)
    m, n = rows.shape[0], packed.out_features
    y = torch.empty((m, n), dtype=torch.float32)
    _cpu.gemm_logits_cpu(rows.data_ptr(), KERNEL_DTYPES[rows.dtype], packed.data.data_ptr(),
                         KERNEL_DTYPES[packed.data.dtype], packed.pairs, y.data_ptr(), m, n, packed.in_features,
                         stride, n, torch.get_num_threads())
    return y


def greedy(rows: torch.Tensor, packed: PackedWeight) -> np.ndarray:
    """The greedy token of each row, a host int32 array `[m]`: `cpu_sampler.argmax(logits(rows, packed))`
    (the first largest logit, NaNs passed over), in one call (gemm_greedy_cpu) that on AMX tiles never
    writes the logits. Rows as `takes_head_rows` says. A numpy array, as the sampler hands tokens on:
    a torch tensor for them, its copy to numpy and the int32 conversion, each on the caches a step's
    weights had flushed, cost a batch-1 int4 step 1-2% (Intel Xeon with AMX)."""
    _check_head_rows(rows, packed)
    if not takes_head_rows(rows):
        raise ValueError(f"greedy takes fp32 or bf16 rows on the CPU, not {rows.dtype} on {rows.device}")
    rows, stride = _head_rows(rows)
    return _cpu.gemm_greedy_cpu(rows.data_ptr(), KERNEL_DTYPES[rows.dtype], packed.data.data_ptr(),
                                KERNEL_DTYPES[packed.data.dtype], packed.pairs, rows.shape[0], packed.out_features,
                                packed.in_features, stride, torch.get_num_threads())


def takes_head_rows(rows: torch.Tensor) -> bool:
    """Whether `logits` and `greedy` take 2-D rows in one C++ call: fp32 or bf16 on the CPU."""
    return rows.dtype in KERNEL_DTYPES and rows.is_cpu


def _check_head_rows(rows: torch.Tensor, packed: PackedWeight) -> None:
    if rows.dim() != 2 or rows.shape[1] != packed.in_features:
        raise ValueError(f"rows of shape {tuple(rows.shape)} for a weight of {packed.in_features} inputs")


def _head_rows(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The rows as the head's C++ calls read them, and their stride (a contiguous copy where needed)."""
    stride = _row_stride(rows)
    if stride is None:
        return rows.contiguous(), rows.shape[1]
    return rows, stride


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


def stack_linear(packed: Packed | None, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> tuple[_cpu.DecoderLinear, torch.Tensor | None] | None:
    """`packed` as the C++ decoder stack of `dtype` activations multiplies by it (csrc/cpu_decoder.h:
    the kernel `linear` here calls), with the fp32 bias it points at (the caller keeps it alive);
    None for oneDNN's packing, which only torch can call, no packing, or a bf16 weight on
    gemm_bf16 under fp32 activations (which `linear` rounds to bf16 first: the stack does not)."""
    if not isinstance(packed, PackedWeight):
        return None
    if packed.pairs and packed.data.dtype == torch.bfloat16 and dtype != torch.bfloat16:
        return None
    b = None if bias is None else bias.float().contiguous()
    b_ptr = 0 if b is None else b.data_ptr()
    n, k = packed.out_features, packed.in_features
    if packed.pairs and packed.data.dtype == torch.bfloat16:
        return _cpu.DecoderLinear.dense_bf16(packed.data.data_ptr(), n, k, b_ptr), b
    return _cpu.DecoderLinear.dense(packed.data.data_ptr(), KERNEL_DTYPES[packed.data.dtype], n, k, packed.pairs,
                                    b_ptr), b


def prepack_layer(layer: nn.Module, keep_dense: bool = False, kernel: GemmKernel | None = None) -> bool:
    """Give a layer with `weight` and `packed` attributes (a linear layer, the LM head) a packed
    copy of its weight for `kernel` (default: `layer_kernel`'s) when it gains from it; its dense
    weight is released (an empty tensor) unless `keep_dense` (a tied LM head: the embedding still
    looks rows up in it)."""
    if layer.packed is not None or not can_prepack(layer.weight, kernel):
        return False
    layer.packed = prepack(layer.weight, kernel)
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
