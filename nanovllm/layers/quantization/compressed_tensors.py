"""compressed-tensors' `pack-quantized` format (what llmcompressor writes for W4A16 / W8A16), from
its definition: per linear module

- `weight_packed` int32 `[out, ceil(in / (32 / bits))]`: the values q (signed, [-2^(b-1), 2^(b-1)))
  stored as q + 2^(b-1), 32 / bits to a word along the input dimension, value i of a word in bits
  [i * bits, (i + 1) * bits);
- `weight_scale` `[out, groups]` in the model's dtype (one column for "channel");
- `weight_zero_point` (asymmetric only) the zero points z, stored as z + 2^(b-1) and packed the same
  way but along the output dimension: int32 `[ceil(out / (32 / bits)), groups]`;
- `weight_g_idx` int32 `[in]` (actorder "group" only): each input column's group;
- `weight_shape` `[2]`: (out, in).

w = (q - z) * s. `pack` writes the same tensors (`nanovllm quantize`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nanovllm.layers.quantization.packing import pack_int32, unpack_int32
from nanovllm.layers.quantization.weights import QuantizedWeight, permutation_from_g_idx, unpacked


def tensor_names(symmetric: bool, actorder: bool) -> tuple[str, ...]:
    names = ("weight_packed", "weight_scale", "weight_shape")
    return names + (() if symmetric else ("weight_zero_point",)) + (("weight_g_idx",) if actorder else ())


def unpack(t: Mapping[str, torch.Tensor], bits: int, group_size: int | None, symmetric: bool, out_features: int,
           in_features: int, where: str) -> QuantizedWeight:
    n, k = out_features, in_features
    shape = [int(v) for v in t["weight_shape"].flatten().tolist()]
    if shape != [n, k]:
        raise ValueError(f"{where}.weight_shape is {shape}, the layer is [{n}, {k}]")
    per_word = 32 // bits
    packed = t["weight_packed"]
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, -(-k // per_word)):
        raise ValueError(f"{where}.weight_packed is {packed.dtype} {tuple(packed.shape)}, expected int32 "
                         f"[{n}, {-(-k // per_word)}] for {bits}-bit values")
    gs = k if group_size is None else group_size
    groups = -(-k // gs)
    scale = t["weight_scale"]
    if tuple(scale.shape) != (n, groups):
        raise ValueError(f"{where}.weight_scale has shape {tuple(scale.shape)}, expected [{n}, {groups}] "
                         f"(groups of {gs} over {k} columns)")
    offset = 1 << (bits - 1)
    q = (unpack_int32(packed, bits, 1, k) - offset).to(torch.int8)
    zeros = None
    if not symmetric:
        zp = t["weight_zero_point"]
        if zp.dtype != torch.int32 or tuple(zp.shape) != (-(-n // per_word), groups):
            raise ValueError(f"{where}.weight_zero_point is {zp.dtype} {tuple(zp.shape)}, expected int32 "
                             f"[{-(-n // per_word)}, {groups}] (packed along the output dimension)")
        zeros = (unpack_int32(zp, bits, 0, n) - offset).to(torch.int8)
    perm = None
    if "weight_g_idx" in t:
        g_idx = t["weight_g_idx"]
        if tuple(g_idx.shape) != (k,):
            raise ValueError(f"{where}.weight_g_idx has shape {tuple(g_idx.shape)}, expected [{k}]")
        perm = permutation_from_g_idx(g_idx, gs, f"{where}.weight_g_idx")
        if perm is not None:
            q = q[:, perm].contiguous()
    return unpacked(where, q, scale.float().contiguous(), zeros, bits, gs, perm)


def pack(w: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one module (suffixes of its name) for `w` (column order as stored: no perm)."""
    if w.perm is not None:
        raise ValueError("writing activation-ordered weights is not supported")
    offset = 1 << (w.bits - 1)
    out = {
        "weight_packed": pack_int32(w.qweight.to(torch.int32) + offset, w.bits, 1),
        "weight_scale": w.scales.to(scale_dtype).contiguous(),
        "weight_shape": torch.tensor([w.out_features, w.in_features], dtype=torch.int64),
    }
    if w.zeros is not None:
        out["weight_zero_point"] = pack_int32(w.zeros.to(torch.int32) + offset, w.bits, 0)
    return out
