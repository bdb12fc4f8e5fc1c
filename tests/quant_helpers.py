"""Random quantized weights and checkpoints for the quantization tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nanovllm.entrypoints.quantize import LINEAR
from nanovllm.layers.quantization.packing import pack_int32
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


def awq_tensors(w: QuantizedWeight) -> dict[str, torch.Tensor]:
    order = [0, 2, 4, 6, 1, 3, 5, 7]

    def pack_awq(values: torch.Tensor) -> torch.Tensor:  # [rows, cols] unsigned nibbles
        rows, cols = values.shape
        out = torch.zeros(rows, cols // 8, dtype=torch.int64)
        for pos, col in enumerate(order):
            out |= values[:, col::8].to(torch.int64) << (4 * pos)
        return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)

    return {"qweight": pack_awq((w.qweight.t().to(torch.int16) + 8)),
            "qzeros": pack_awq(w.zeros.t().to(torch.int16) + 8),  # type: ignore[union-attr]
            "scales": w.scales.t().to(torch.float16).contiguous()}


def gptq_tensors(w: QuantizedWeight, g_idx: torch.Tensor, zero_offset: int) -> dict[str, torch.Tensor]:
    """w's values in checkpoint row order (`g_idx` assigns each row its group)."""
    off = 1 << (w.bits - 1)
    zeros = torch.zeros_like(w.scales, dtype=torch.int32) if w.zeros is None else w.zeros.to(torch.int32)
    return {"qweight": pack_int32(w.qweight.t().to(torch.int32) + off, w.bits, 0),
            "qzeros": pack_int32((zeros + off - zero_offset).t(), w.bits, 1),
            "scales": w.scales.t().to(torch.float16).contiguous(), "g_idx": g_idx.to(torch.int32)}


def write_checkpoint(src: Path, out: Path, quantization_config: dict, convert) -> Path:  # noqa: ANN001
    """A copy of src whose linear weights `convert(name, weight)` replaces by checkpoint tensors."""
    shutil.copytree(src, out)
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(raw))
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            match = LINEAR.match(name)
            if match is None:
                tensors[name] = f.get_tensor(name)
            else:
                tensors.update({f"{match.group(1)}.{k}": v for k, v in convert(name, f.get_tensor(name)).items()})
    save_file(tensors, str(out / "model.safetensors"))
    return out
