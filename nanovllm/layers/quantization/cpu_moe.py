"""int8 / int4 experts of a mixture-of-experts layer as one C++ call per layer on the CPU
(csrc/cpu_moe.cpp, `moe_quant_experts_cpu`): the same layer as the dense experts' (nanovllm/cpu/moe.py:
routing, grouping, both GEMMs and SiLU-and-mul of every chosen expert, the weighted sum, threads split
over column panels), with each GEMM reading its expert's packed int8 / int4 weight (cpu_kernel's
layout) and dequantizing in registers. Every expert's weights lie back to back; the gate/up rows are
interleaved 8 and 8 per 16-row panel, as the dense experts', so a thread applies SiLU-and-mul to the
panels it computed. Looping over the experts from Python instead cost ~500 GEMM calls a decode step at
32 sequences, each its own OpenMP region, and made quantized experts slower than bf16 ones.
"""

from __future__ import annotations

import dataclasses

import torch

from nanovllm import _cpu
from nanovllm.cpu import KERNEL_DTYPES, huge_pages
from nanovllm.cpu import moe as dense_moe
from nanovllm.layers.quantization import cpu_kernel
from nanovllm.layers.quantization.weights import QuantizedWeight


@dataclasses.dataclass(frozen=True)
class StackedQuantWeights:
    """One projection of every expert, each packed by cpu_kernel.pack, back to back."""
    packed: torch.Tensor  # uint8 [experts * bytes per expert], on huge pages (a decode step streams it)
    scales: torch.Tensor  # float32 [experts, groups, panels, 16]
    zeros: torch.Tensor | None  # int8, as scales
    bits: int
    group_size: int
    zero_offset: float

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.zeros) if t is not None)


@dataclasses.dataclass(frozen=True)
class PackedQuantExperts:
    w13: StackedQuantWeights  # [moe_gate_up_rows(inter), hidden] per expert, gate/up rows interleaved
    w2: StackedQuantWeights  # [hidden, inter] per expert
    experts: int
    hidden: int
    inter: int

    def nbytes(self) -> int:
        return self.w13.nbytes() + self.w2.nbytes()


def can_pack(w13: list[QuantizedWeight], w2: list[QuantizedWeight]) -> bool:
    """Whether the experts fit one call: every expert's projection in the same format (bits, groups)
    and no activation-order permutation (GPTQ's desc_act: each expert would permute its input)."""
    return all(all(w.perm is None for w in ws) and len({(w.bits, w.group_size, w.zeros is None) for w in ws}) == 1
               for ws in (w13, w2))


def interleave_gate_up(w: QuantizedWeight) -> QuantizedWeight:
    """An expert's gate/up weight (`inter` gate rows, then `inter` up rows) with its rows, scales and
    zero points in the dense experts' order (nanovllm/cpu/moe.py interleave_gate_up: per 16 rows, 8
    gate rows then the 8 up rows of the same columns, `inter` padded to a multiple of 8 with rows of
    scale 0)."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        return dense_moe.interleave_gate_up(t[None])[0]

    return QuantizedWeight(rows(w.qweight), rows(w.scales), None if w.zeros is None else rows(w.zeros), w.bits,
                           w.group_size)


def _stack(weights: list[QuantizedWeight]) -> StackedQuantWeights:
    per = cpu_kernel.packed_bytes(weights[0])  # the same for every expert (can_pack)
    flat = huge_pages.empty(len(weights) * per, torch.uint8)
    packs = [cpu_kernel.pack(w, flat[e * per:(e + 1) * per]) for e, w in enumerate(weights)]
    first = packs[0]
    zeros = None if first.zeros is None else torch.stack([p.zeros for p in packs])  # type: ignore[misc]
    return StackedQuantWeights(flat, torch.stack([p.scales for p in packs]), zeros, first.bits, first.group_size,
                               first.zero_offset)


def pack_experts(w13: list[QuantizedWeight], w2: list[QuantizedWeight]) -> PackedQuantExperts:
    """Every expert's gate/up (`[2I, H]`, gate rows first) and down (`[H, I]`) weight, packed for
    `fused_experts`; `can_pack` must hold."""
    if not can_pack(w13, w2):
        raise ValueError("the experts' weights differ in format or permute their inputs: they cannot be fused")
    inter, hidden = w2[0].in_features, w2[0].out_features
    return PackedQuantExperts(_stack([interleave_gate_up(w) for w in w13]), _stack(w2), len(w13), hidden, inter)


def _bf16_min_per_expert(dtype: torch.dtype, p: PackedQuantExperts) -> int:
    """The rows an expert must see on average for bf16 activations to take the bf16 dot products
    (cpu_kernel.bf16_min_rows, as the dense layers), where the CPU has them and the groups allow
    pairs of input columns; 0: never."""
    if dtype != torch.bfloat16 or not cpu_kernel.HAS_BF16 or p.hidden % 2:
        return 0
    if not (cpu_kernel.groups_pair(p.w13.group_size, p.hidden) and cpu_kernel.groups_pair(p.w2.group_size, p.inter)):
        return 0
    return max(cpu_kernel.bf16_min_rows(p.w13.bits, p.w13.group_size, p.hidden),
               cpu_kernel.bf16_min_rows(p.w2.bits, p.w2.group_size, p.inter))


def _bf16_rows(x: torch.Tensor, p: PackedQuantExperts, top_k: int) -> bool:
    least = _bf16_min_per_expert(x.dtype, p)
    assignments = x.shape[0] * top_k
    return least > 0 and assignments / max(1, min(p.experts, assignments)) >= least


def _weight_args(w: StackedQuantWeights) -> list[int | float]:
    """One projection of the experts as moe_quant_experts_cpu takes it."""
    return [w.packed.data_ptr(), w.packed.numel(), w.scales.data_ptr(), w.scales.numel(),
            0 if w.zeros is None else w.zeros.data_ptr(), 0 if w.zeros is None else w.zeros.numel(), w.group_size,
            w.bits, w.zero_offset]


def stack_experts(router: _cpu.DecoderLinear, p: PackedQuantExperts, top_k: int, renormalize: bool,
                  dtype: torch.dtype) -> _cpu.DecoderMoe | None:
    """The layer for the C++ decoder stack (csrc/cpu_decoder.h) as `fused_experts` calls it."""
    if dtype not in KERNEL_DTYPES:
        return None
    return _cpu.DecoderMoe.quant(router, p.hidden, p.inter, p.experts, top_k, renormalize, KERNEL_DTYPES[dtype],
                                 _bf16_min_per_expert(dtype, p), *_weight_args(p.w13), *_weight_args(p.w2))


def fused_experts(x: torch.Tensor, logits: torch.Tensor, p: PackedQuantExperts, top_k: int, renormalize: bool,
                  bf16_rows: bool | None = None) -> torch.Tensor:
    """The layer's output `[T, H]` for x `[T, H]` and router logits `[T, E]` (CPU tensors); x in
    another dtype than fp32 / bf16 runs in fp32. `bf16_rows` forces bf16 activations onto (True) or
    off (False) the bf16 dot products; None: where they are faster."""
    if x.dim() != 2 or x.shape[1] != p.hidden or logits.shape != (x.shape[0], p.experts):
        raise ValueError(f"quantized experts: input {tuple(x.shape)} and router logits {tuple(logits.shape)}, the "
                         f"experts take {p.hidden} features and {p.experts} logits")
    if x.dtype not in KERNEL_DTYPES:
        return fused_experts(x.float(), logits, p, top_k, renormalize, bf16_rows).to(x.dtype)
    rows = x.shape[0]
    x, logits = x.contiguous(), logits.float().contiguous()
    out = torch.empty(rows, p.hidden, dtype=x.dtype)
    weights = _weight_args(p.w13) + _weight_args(p.w2)
    _cpu.moe_quant_experts_cpu(x.data_ptr(), p.hidden, logits.data_ptr(), p.experts, rows, p.hidden, p.inter,
                               p.experts, top_k, renormalize, out.data_ptr(), p.hidden, KERNEL_DTYPES[x.dtype],
                               _bf16_rows(x, p, top_k) if bf16_rows is None else bf16_rows, *weights,
                               torch.get_num_threads())
    return out
