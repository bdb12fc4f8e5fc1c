"""Random quantized weights and checkpoints for the quantization tests."""

from __future__ import annotations

import torch

from nanovllm.layers.quantization.weights import QuantizedWeight, signed_range


def random_quantized(n: int, k: int, bits: int, group_size: int, symmetric: bool, seed: int,
                     act_order: bool = False) -> QuantizedWeight:
    """Values over the whole range, scales of either sign's magnitude spread over two decades, zero
    points anywhere in range (int4 up to 8: GPTQ's zero + 1)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = signed_range(bits)
    groups = -(-k // group_size)
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int32).to(torch.int8)
    scales = (torch.rand(n, groups, generator=g) * 2 - 1.0).sign() * 10 ** (-1 - torch.rand(n, groups, generator=g) * 2)
    zeros = None
    if not symmetric:
        zeros = torch.randint(lo, hi + (2 if bits == 4 else 1), (n, groups), generator=g, dtype=torch.int32)
        zeros = zeros.to(torch.int8)
    perm = torch.randperm(k, generator=g) if act_order else None
    return QuantizedWeight(q, scales.float(), zeros, bits, group_size, perm)
