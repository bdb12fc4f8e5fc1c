"""AutoAWQ's GEMM packing, from its definition: per linear module (the weight stored `[in, out]`)

- `qweight` int32 `[in, out / 8]`: unsigned 4-bit values, 8 output columns to a word in the
  interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (value i of word j is column 8j + order[i]);
- `qzeros` int32 `[groups, out / 8]`: unsigned 4-bit zero points, packed the same way;
- `scales` `[groups, out]` (float16).

w[i, o] = (q[i, o] - z[i // group, o]) * s[i // group, o].
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nanovllm.layers.quantization.packing import unpack_int32
from nanovllm.layers.quantization.weights import QuantizedWeight, unpacked

TENSOR_NAMES = ("qweight", "qzeros", "scales")
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def unpack(t: Mapping[str, torch.Tensor], bits: int, group_size: int, out_features: int, in_features: int,
           where: str) -> QuantizedWeight:
    n, k = out_features, in_features
    groups = -(-k // group_size)
    if n % 8:
        raise ValueError(f"{where}: AWQ packs 8 output columns to a word; the layer has {n}")
    expected = {"qweight": (k, n // 8), "qzeros": (groups, n // 8), "scales": (groups, n)}
    for name, shape in expected.items():
        if tuple(t[name].shape) != shape or (name != "scales" and t[name].dtype != torch.int32):
            raise ValueError(f"{where}.{name} is {t[name].dtype} {tuple(t[name].shape)}, expected "
                             f"{'int32 ' if name != 'scales' else ''}{list(shape)} (groups of {group_size})")
    q = unpack_int32(t["qweight"], bits, 1, n, ORDER).t() - 8
    z = unpack_int32(t["qzeros"], bits, 1, n, ORDER).t() - 8
    return unpacked(where, q.to(torch.int8).contiguous(), t["scales"].float().t().contiguous(),
                    z.to(torch.int8).contiguous(), bits, group_size)
