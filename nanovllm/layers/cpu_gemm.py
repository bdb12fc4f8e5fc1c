"""CPU GEMMs on weights reordered once for oneDNN, instead of `F.linear` (MKL) on the dense weight.

At the decode and prefill shapes of the bench models, oneDNN's matmul on a weight reordered at load
time (`mkldnn._reorder_linear_weight`, for a batch of ~64 rows) ran 1.1-2.7x faster than
`F.linear` in fp32 on this machine's AVX2 CPU, from 64 x 768 x 256 up to the LM heads; below
~128K weights, and for single rows, `F.linear` is as fast or faster (benchmarks/RESULTS.md). So an
fp32 layer is prepacked when its weight has at least PREPACK_MIN_WEIGHTS elements.

bf16 layers: where the CPU computes bf16 (AVX512-BF16 or AMX) the bf16 weight is prepacked (same
threshold). Where it does not, torch emulates bf16 GEMMs 5-10x slower than fp32 ones (64 x 256 x
1536: 4.5 ms against 0.6 ms), and oneDNN refuses bf16 there: every bf16 layer then keeps its
weight as a prepacked fp32 copy (twice the weight memory) and multiplies the activations widened
to fp32, rounding the result to bf16. A bf16 GEMM accumulates in fp32 anyway, so the results are
the same up to summation order. The results differ from `F.linear`'s only in summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.cpu_features import native_bf16

PREPACK_MIN_WEIGHTS = 1 << 17
BATCH_HINT = 64  # the row count oneDNN's reorder optimizes for: a decode batch


def emulated_bf16(weight: torch.Tensor) -> bool:
    """A bf16 weight on a CPU that does not compute bf16: packed as fp32 (see above)."""
    return weight.dtype == torch.bfloat16 and not native_bf16()


def can_prepack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if emulated_bf16(weight):
        return True
    return weight.dtype in (torch.float32, torch.bfloat16) and weight.numel() >= PREPACK_MIN_WEIGHTS


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's reordered copy of a `[out, in]` weight (an opaque mkldnn tensor), fp32 for a bf16
    weight the CPU cannot multiply natively."""
    w = weight.detach().float() if emulated_bf16(weight) else weight.detach()
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), BATCH_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for the weight `packed` was made from; x `[..., in]`."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if packed.dtype != x.dtype:  # an fp32 copy of a bf16 weight
        y = torch.ops.mkldnn._linear_pointwise(rows.to(packed.dtype).contiguous(), packed,
                                               None if bias is None else bias.to(packed.dtype), "none", [], "")
        y = y.to(x.dtype)
    else:
        y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def prepack_layer(layer: nn.Module, keep_dense: bool = False) -> bool:
    """Give a layer with `weight` and `packed` attributes (a linear layer, the LM head) oneDNN's
    reordered weight when it gains from it; its dense weight is released (an empty tensor) unless
    `keep_dense` (a tied LM head: the embedding still looks rows up in it)."""
    if layer.packed is not None or not can_prepack(layer.weight):
        return False
    layer.packed = prepack(layer.weight)
    if not keep_dense:
        layer.weight.data = layer.weight.data.new_empty(0)
    return True


def matmul(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, on `packed` when the layer has it."""
    return F.linear(x, weight, bias) if packed is None else linear(x, packed, bias)


def prepack_model(model: torch.nn.Module) -> int:
    """Prepack every layer of `model` that gains from it (the layers' `prepack_for_cpu`); returns
    how many were."""
    return sum(bool(m.prepack_for_cpu()) for m in model.modules() if hasattr(m, "prepack_for_cpu"))
