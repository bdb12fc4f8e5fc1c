"""The CPU mixture-of-experts layer (csrc/cpu_moe.cpp) behind torch-tensor signatures, on either
packing of cpu/gemm.py:

- ours (`gemm_cpu`'s panels): every expert's gate/up and down weights packed back to back in two
  flat tensors, and the whole layer (routing, grouping, both GEMMs and the SiLU-mul of every chosen
  expert, the weighted sum) is one C++ call, its threads split over (expert, column panel);
- oneDNN: each expert's weights reordered for oneDNN's matmul (kept dense where oneDNN would not
  pack a weight that small). Routing and grouping are one C++ call, the weighted sum another; in
  between, each expert some row chose runs two matmuls and a SiLU-mul from Python.

Either way an expert no row chose is never read. The experts take ours wherever the CPU has AVX2 +
FMA (`expert_kernel`), AVX-512 CPUs included, where the dense layers take oneDNN: a decode step's
experts each see a few rows and are bound by reading their weights, and the per-expert loop's
calls, one OpenMP region each, cost more than oneDNN's wider vectors gain (benchmarks/RESULTS.md,
"Mixture of experts": on the AVX-512 Zen 4 the loop ran a decode step's experts 1.3-2.4x slower on
one thread, ~7x on two; oneDNN was 1.3x faster only at 256 rows per step).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanovllm import _cpu
from nanovllm.cpu import KERNEL_DTYPES, huge_pages
from nanovllm.cpu import fused_ops as cpu_ops
from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.cpu.features import GemmKernel


@dataclasses.dataclass(frozen=True)
class GemmPackedExperts:
    """Our GEMM's copies of every expert, back to back: w13 experts x [moe_gate_up_rows(inter),
    hidden] (gate and up rows interleaved, `interleave_gate_up`), w2 experts x [hidden, depth], each
    flat in the weights' dtype. `pairs`: packed for the AVX-512 pair tiles (cpu_gemm.can_pair): fp32
    in panel pairs, bf16 in k pairs for the AVX512-BF16 tiles (the down weights' depth padded to
    moe_gate_up_rows(inter) / 2); else for the AVX2 tiles (depth inter)."""
    w13: torch.Tensor
    w2: torch.Tensor
    experts: int
    hidden: int
    inter: int
    pairs: bool

    @property
    def bf16_pairs(self) -> bool:
        """bf16 experts in k pairs: they take bf16 activations only."""
        return self.pairs and self.w13.dtype == torch.bfloat16


@dataclasses.dataclass(frozen=True)
class LinearExperts:
    """cpu_gemm's packed copy (oneDNN) of each expert's gate/up and down weight."""
    w13: list[cpu_gemm.Packed]
    w2: list[cpu_gemm.Packed]


PackedExperts = GemmPackedExperts | LinearExperts


@dataclasses.dataclass(frozen=True)
class Routing:
    """moe_route_cpu's output: each row's experts and weights, and the assignments (row * top_k + j)
    grouped by expert: expert e's are sorted[expert_offsets[e]:expert_offsets[e + 1]]."""
    topk_ids: torch.Tensor  # [rows, top_k] int32, by falling weight
    topk_weights: torch.Tensor  # [rows, top_k] fp32
    expert_offsets: torch.Tensor  # [experts + 1] int32
    sorted: torch.Tensor  # [rows * top_k] int32


def expert_kernel() -> GemmKernel:
    """The packing of the experts on this CPU: ours where AVX2 + FMA exist, else the dense layers'."""
    return "avx2" if _cpu.has_avx2_fma() else cpu_gemm.gemm_kernel()


def can_pair(w13: torch.Tensor) -> bool:
    """Whether experts w13 `[E, 2I, H]` can take the AVX-512 pair tiles on this CPU (cpu_gemm.can_pair:
    fp32 on AVX-512, bf16 on AVX512-BF16, whose dot products run twice an FMA's multiply-adds)."""
    return cpu_gemm.can_pair(w13)


def pack_experts(w13: torch.Tensor, w2: torch.Tensor, kernel: GemmKernel | None = None,
                 pairs: bool | None = None) -> PackedExperts | None:
    """The packed copies of w13 `[E, 2I, H]` and w2 `[E, H, I]` for `kernel` (default:
    `expert_kernel()`), or None when cpu_gemm packs nothing of this kind. Ours packs the experts for
    the pair tiles where `can_pair` (unless `pairs` says otherwise)."""
    kernel = kernel or expert_kernel()
    if not cpu_gemm.can_prepack(w13[0], kernel):
        return None
    if kernel == "avx2":
        experts, two_inter, hidden = w13.shape
        inter = two_inter // 2
        pairs = can_pair(w13) if pairs is None else pairs
        if pairs and not can_pair(w13):
            raise ValueError("pairs need fp32 experts on an AVX-512 CPU, or bf16 experts of an even hidden size on an "
                             "AVX512-BF16 CPU")
        if pairs and w13.dtype == torch.bfloat16:  # the down weights' depth padded: the bf16 pair tiles need it even
            w2 = F.pad(w2.detach(), (0, _cpu.moe_gate_up_rows(inter) // 2 - inter))
        return GemmPackedExperts(_gemm_pack_all(interleave_gate_up(w13), pairs), _gemm_pack_all(w2, pairs), experts,
                                 hidden, inter, pairs)
    return LinearExperts([cpu_gemm.prepack(w, kernel) for w in w13], [cpu_gemm.prepack(w, kernel) for w in w2])


def _gemm_pack_all(w: torch.Tensor, pairs: bool) -> torch.Tensor:
    """gemm_pack_cpu's copy (with `pairs` or without) of every `w[e]` of w
    `[E, n, k]`, back to back in one flat tensor on huge pages (a decode step streams it)."""
    if not _cpu.has_avx2_fma():
        raise ValueError("the avx2 GEMM needs a CPU with AVX2 and FMA")
    w = w.detach().contiguous()
    experts, n, k = w.shape
    per = _cpu.gemm_packed_elements(n, k)
    flat = huge_pages.empty(experts * per, w.dtype)
    for e in range(experts):
        _cpu.gemm_pack_cpu(w[e].data_ptr(), KERNEL_DTYPES[w.dtype], n, k, k, flat[e * per:].data_ptr(), pairs)
    return flat


def interleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """w13 `[E, 2I, H]` (gate rows, then up rows) -> `[E, moe_gate_up_rows(I), H]`: in every 16 rows,
    8 gate rows then the 8 up rows of the same intermediate columns, I padded to a multiple of 8 with
    zero rows (csrc/cpu_moe.h: a thread applies SiLU-and-mul to the panels it computed)."""
    experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    inter8 = _cpu.moe_gate_up_rows(inter) // 2
    padded = w13.new_zeros(experts, 2, inter8, hidden)
    padded[:, :, :inter] = w13.detach().view(experts, 2, inter, hidden)
    return padded.view(experts, 2, inter8 // 8, 8, hidden).transpose(1, 2).reshape(experts, 2 * inter8, hidden)


def can_run(x: torch.Tensor, logits: torch.Tensor) -> bool:
    """x `[T, H]` on the CPU in a kernel dtype with contiguous rows, router logits `[T, E]`."""
    return x.device.type == "cpu" and x.dtype in KERNEL_DTYPES and x.dim() == 2 and x.stride(1) == 1 \
        and logits.dim() == 2 and logits.shape[0] == x.shape[0] and logits.device.type == "cpu"


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over the router logits `[T, E]` in fp32, the top_k experts of each row (weights
    renormalized to sum to 1 if `renormalize`), and the rows grouped by expert."""
    logits = logits.float().contiguous()
    rows, experts = logits.shape
    r = Routing(torch.empty(rows, top_k, dtype=torch.int32), torch.empty(rows, top_k, dtype=torch.float32),
                torch.empty(experts + 1, dtype=torch.int32), torch.empty(rows * top_k, dtype=torch.int32))
    _cpu.moe_route_cpu(logits.data_ptr(), rows, experts, experts, top_k, renormalize, r.topk_ids.data_ptr(),
                       r.topk_weights.data_ptr(), r.expert_offsets.data_ptr(), r.sorted.data_ptr(),
                       torch.get_num_threads())
    return r


def combine(y: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The experts' outputs `[T * top_k, H]` (rows in `routing.sorted` order) -> `[T, H]`, each row
    the weighted sum of its top_k outputs."""
    rows, top_k = routing.topk_ids.shape
    if y.dim() != 2 or y.shape[0] != rows * top_k or y.dtype not in KERNEL_DTYPES or y.stride(1) != 1:
        raise ValueError(f"combine: expected [{rows * top_k}, hidden] rows of fp32 or bf16, got {tuple(y.shape)} {y.dtype}")
    y = y.contiguous()
    out = torch.empty(rows, y.shape[1], dtype=y.dtype)
    _cpu.moe_combine_cpu(y.data_ptr(), y.shape[1], routing.sorted.data_ptr(),
                         routing.topk_weights.data_ptr(), rows, top_k, y.shape[1], out.data_ptr(), y.shape[1],
                         KERNEL_DTYPES[y.dtype], torch.get_num_threads())
    return out


def fused_experts(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  packed: PackedExperts | None, top_k: int, renormalize: bool) -> torch.Tensor:
    """The MoE layer's output `[T, H]` for x `[T, H]` and router logits `[T, E]`; w13 `[E, 2I, H]`
    and w2 `[E, H, I]` are the dense weights (empty once `packed` holds their gemm_cpu copies)."""
    if not can_run(x, logits):
        raise ValueError(f"fused_experts: unsupported input {tuple(x.shape)} {x.dtype} on {x.device}")
    if isinstance(packed, GemmPackedExperts):
        return _gemm_experts(x, logits, packed, top_k, renormalize)
    if packed is None:  # dense weights (not prepacked: too small for oneDNN to gain)
        w13s, w2s = list(w13), list(w2)
        project = F.linear
    else:
        w13s, w2s = packed.w13, packed.w2
        project = functools.partial(cpu_gemm.linear, bias=None)
    return looped_experts(x, logits, lambda rows, e: project(rows, w13s[e]), lambda rows, e: project(rows, w2s[e]),
                          top_k, renormalize)


def stack_experts(router: _cpu.DecoderLinear, packed: PackedExperts | None, top_k: int, renormalize: bool,
                  dtype: torch.dtype) -> _cpu.DecoderMoe | None:
    """The layer for the C++ decoder stack (csrc/cpu_decoder.h) as `fused_experts` calls it, on
    activations of `dtype`: our packed experts only (oneDNN's and unpacked ones run in Python)."""
    if not isinstance(packed, GemmPackedExperts) or dtype not in KERNEL_DTYPES or (
            packed.bf16_pairs and dtype != torch.bfloat16):
        return None
    return _cpu.DecoderMoe.dense(router, packed.w13.data_ptr(), packed.w13.numel(), packed.w2.data_ptr(),
                                 packed.w2.numel(), KERNEL_DTYPES[packed.w13.dtype], packed.pairs, packed.hidden,
                                 packed.inter, packed.experts, top_k, renormalize, KERNEL_DTYPES[dtype])


Projection = Callable[[torch.Tensor, int], torch.Tensor]  # (rows, expert) -> rows times its weight^T


def looped_experts(x: torch.Tensor, logits: torch.Tensor, gate_up: Projection, down: Projection, top_k: int,
                   renormalize: bool) -> torch.Tensor:
    """The MoE layer with each chosen expert's two projections given as functions (a packed weight's
    GEMM, a quantized weight's): routing and the weighted sum in C++, the experts some row chose in a
    Python loop between them."""
    routing = route(logits, top_k, renormalize)
    offsets = routing.expert_offsets.tolist()
    xs = x.index_select(0, routing.sorted.long().div_(top_k, rounding_mode="floor"))
    ys = torch.empty_like(xs)
    for e in range(len(offsets) - 1):
        begin, end = offsets[e], offsets[e + 1]
        if begin < end:
            ys[begin:end] = down(cpu_ops.silu_and_mul(gate_up(xs[begin:end], e)), e)
    return combine(ys, routing)


def _gemm_experts(x: torch.Tensor, logits: torch.Tensor, packed: GemmPackedExperts, top_k: int,
                  renormalize: bool) -> torch.Tensor:
    rows, hidden = x.shape
    if hidden != packed.hidden or logits.shape[1] != packed.experts:
        raise ValueError(f"fused_experts: input of {hidden} features and {logits.shape[1]} router logits, the experts "
                         f"take {packed.hidden} and {packed.experts}")
    if packed.bf16_pairs and x.dtype != torch.bfloat16:
        raise ValueError(f"fused_experts: experts packed for bf16 activations, got {x.dtype}")
    x, logits = x.contiguous(), logits.float().contiguous()
    out = torch.empty(rows, hidden, dtype=x.dtype)
    _cpu.moe_experts_cpu(x.data_ptr(), hidden, logits.data_ptr(), packed.experts, packed.w13.data_ptr(),
                         packed.w13.numel(), packed.w2.data_ptr(), packed.w2.numel(), KERNEL_DTYPES[packed.w13.dtype],
                         packed.pairs, rows, hidden, packed.inter, packed.experts, top_k, renormalize,
                         out.data_ptr(), hidden, KERNEL_DTYPES[x.dtype], torch.get_num_threads())
    return out

