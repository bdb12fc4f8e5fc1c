"""GPTQ's packing (AutoGPTQ / GPTQModel, `checkpoint_format` "gptq" and "gptq_v2"), from its
definition: per linear module (the weight stored `[in, out]`)

- `qweight` int32 `[in / (32 / bits), out]`: unsigned values packed along the input dimension,
  value i of word j is row j * (32 / bits) + i;
- `qzeros` int32 `[groups, out / (32 / bits)]`: unsigned zero points packed along the output
  dimension; format "gptq" (v1) stores each zero point minus one, "gptq_v2" as it is;
- `scales` `[groups, out]` (float16);
- `g_idx` int32 `[in]`: each input row's group (rows in activation order with desc_act; i // group
  without, where a checkpoint may leave it out).

w[i, o] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o].
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nanovllm.layers.quantization.packing import unpack_int32
from nanovllm.layers.quantization.weights import QuantizedWeight, permutation_from_g_idx, unpacked

TENSOR_NAMES = ("qweight", "qzeros", "scales", "g_idx")


def unpack(t: Mapping[str, torch.Tensor], bits: int, group_size: int, symmetric: bool, zero_offset: int,
           out_features: int, in_features: int, where: str) -> QuantizedWeight:
    n, k = out_features, in_features
    per_word = 32 // bits
    groups = -(-k // group_size)
    expected = {"qweight": (-(-k // per_word), n), "qzeros": (groups, -(-n // per_word)), "scales": (groups, n)}
    if "g_idx" in t:
        expected["g_idx"] = (k,)
    for name, shape in expected.items():
        if tuple(t[name].shape) != shape or (name in ("qweight", "qzeros") and t[name].dtype != torch.int32):
            raise ValueError(f"{where}.{name} is {t[name].dtype} {tuple(t[name].shape)}, expected "
                             f"{'int32 ' if name in ('qweight', 'qzeros') else ''}{list(shape)} ({bits}-bit, "
                             f"groups of {group_size})")
    offset = 1 << (bits - 1)
    q = (unpack_int32(t["qweight"], bits, 0, k) - offset).t()
    z = unpack_int32(t["qzeros"], bits, 1, n).t() + zero_offset - offset
    if int(z.max()) > 127 or int(z.min()) < -128:
        raise ValueError(f"{where}.qzeros: a zero point outside [0, 255]")
    zeros = None if symmetric and not bool(z.any()) else z.to(torch.int8).contiguous()
    perm = permutation_from_g_idx(t["g_idx"], group_size, f"{where}.g_idx") if "g_idx" in t else None
    q = q if perm is None else q[:, perm]
    return unpacked(where, q.to(torch.int8).contiguous(), t["scales"].float().t().contiguous(), zeros, bits,
                    group_size, perm)
