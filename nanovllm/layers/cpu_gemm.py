"""CPU GEMMs on weights reordered once for oneDNN, instead of `F.linear` (MKL) on the dense weight.

At the decode and prefill shapes of the bench models, oneDNN's matmul on a weight reordered at load
time (`mkldnn._reorder_linear_weight`, for a batch of ~64 rows) ran 1.1-2.4x faster than
`F.linear` in fp32 on this machine's AVX2 CPU, from 64 x 768 x 256 up to the LM heads; below
~128K weights, and for single rows, `F.linear` is as fast or faster (benchmarks/RESULTS.md,
"GEMMs"). So a layer is prepacked when its weight has at least PREPACK_MIN_WEIGHTS elements and
oneDNN runs its dtype on this CPU (fp32 always; bf16 needs AVX512-BF16 or AMX); otherwise it keeps
`F.linear`. The results differ from `F.linear`'s only in summation order (~1e-7 relative).
"""

from __future__ import annotations

import torch

from nanovllm.cpu_features import native_bf16

PREPACK_MIN_WEIGHTS = 1 << 17
BATCH_HINT = 64  # the row count oneDNN's reorder optimizes for: a decode batch


def can_prepack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() < PREPACK_MIN_WEIGHTS:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and native_bf16())


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's reordered copy of a `[out, in]` weight (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_HINT)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for the weight `packed` was made from; x `[..., in]`."""
    if x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], y.shape[-1])


def prepack_model(model: torch.nn.Module) -> int:
    """Prepack every layer of `model` that gains from it (the layers' `prepack_for_cpu`); returns
    how many were."""
    return sum(bool(m.prepack_for_cpu()) for m in model.modules() if hasattr(m, "prepack_for_cpu"))
