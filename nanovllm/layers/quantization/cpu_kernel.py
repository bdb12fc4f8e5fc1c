"""The CPU GEMM on quantized weights (csrc/cpu_gemm_quant.cpp): the weight packed once in its
layout, and `linear` = `F.linear(x, dequantize(W), bias)` with the weight read at its stored width
and dequantized in registers. AVX-512 where the CPU has it, else AVX2 + FMA, else plain C++ (`isa`
forces one: tests run each that the CPU can)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F

from nanovllm import _cpu
from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.cpu import huge_pages
from nanovllm.layers.quantization.weights import QuantizedWeight

PANEL = 16  # csrc/cpu_gemm.h kGemmPanel
SLICE = 256  # csrc/cpu_gemm_quant.cpp kQuantKc
# bf16 activations take the bf16 dot-product path from this many rows on, by bit width: int4 always
# (one Zen 4 core, 6144 x 1024: 202 us at 1 row against 245 for the fp32 path, 1.0 ms at 12 against
# 2.2); int8 from 2 (its values need a conversion per row of weights: 332 us at 1 row against 263),
# but from 1 on AMX int8 tiles (bf16_min_rows).
BF16_MIN_ROWS = {4: 1, 8: 2}
# "amx": AVX-512 with bf16 activations on AMX tiles (k and the groups multiples of 32), which "auto"
# takes from 2 rows where the process has them.
Isa = Literal["auto", "portable", "avx2", "avx512", "amx"]
ISA_CODES: dict[str, int] = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3, "amx": 4}
HAS_BF16 = _cpu.quant_has_bf16()  # AVX512-BF16: asked once, a forward runs dozens of these GEMMs
HAS_AMX = bool(_cpu.quant_isa_supported(ISA_CODES["amx"]))
AVX2_BEST = _cpu.quant_isa_best() == ISA_CODES["avx2"]  # AVX2 without AVX-512


def bf16_row_range(p: PackedQuantWeight, isa: Isa = "auto") -> tuple[int, int]:
    """The row counts (least, most; most 0: any) at which bf16 activations go to the kernel as bf16
    (else widened to fp32): where the CPU has AVX512-BF16, its dot products from BF16_MIN_ROWS rows;
    on an AVX2 CPU one row, as 16-bit integers (csrc/cpu_gemm_quant.cpp: fewer operations than the
    fp32 decode, exact to bf16's precision for values within 2^7 of the largest of their block of
    128, 64 or 32 columns). (0, 0): never (groups of an odd size)."""
    if not groups_pair(p.group_size, p.in_features):
        return 0, 0
    if HAS_BF16 and isa in ("auto", "avx512", "amx"):
        return bf16_min_rows(p.bits, p.group_size, p.in_features, isa), 0
    if isa in ("auto", "avx2") and AVX2_BEST:
        return 1, 1
    return 0, 0


def bf16_min_rows(bits: int, group_size: int, k: int, isa: Isa = "auto") -> int:
    """From how many rows bf16 activations reach a `k`-column weight as bf16 on a CPU with AVX512-BF16:
    BF16_MIN_ROWS, but int8 from one row where AMX int8 tiles take its shape (k and every group
    multiples of 64: csrc/cpu_gemm_quant.cpp amx_int_path), so a row's bits do not depend on its
    GEMM's row count up to 64 rows."""
    if bits == 8 and HAS_AMX and isa in ("auto", "amx") and k % 64 == 0 and (group_size % 64 == 0 or group_size >= k):
        return 1
    return BF16_MIN_ROWS[bits]


def groups_pair(group_size: int, k: int) -> bool:
    """Whether every group of a `k`-column weight starts on an even input column: int4 values and
    bf16 activations come in pairs of input columns, so a group may not start inside a pair."""
    return group_size % 2 == 0 or group_size >= k


def isa_supported(isa: Isa) -> bool:
    return bool(_cpu.quant_isa_supported(ISA_CODES[isa]))


def best_isa() -> Isa:
    return next(name for name, code in ISA_CODES.items() if code == _cpu.quant_isa_best())


@dataclasses.dataclass(frozen=True)
class PackedQuantWeight:
    packed: torch.Tensor  # uint8, _cpu.quant_gemm_packed_bytes(out, in, bits)
    scales: torch.Tensor  # float32 [groups, panels, 16]
    zeros: torch.Tensor | None  # int8 [groups, panels, 16]
    out_features: int
    in_features: int
    bits: int
    group_size: int
    perm: torch.Tensor | None  # the input's columns in the weight's order (activation order)

    def __post_init__(self) -> None:
        check(self)

    @property
    def zero_offset(self) -> float:
        # The kernel reads int4 values as their nibbles, q + 8, so their zero points move by 8 too.
        return 8.0 if self.bits == 4 else 0.0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.zeros) if t is not None)


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[n, c] -> [panels, 16, c], rows past n zero."""
    n = t.shape[0]
    pad = -n % PANEL
    return F.pad(t, (0, 0, 0, pad)).reshape(-1, PANEL, t.shape[1])


def stored_bits(w: QuantizedWeight) -> int:
    """The width pack() stores `w`'s values at: int4 values pair up two input columns to a byte, so
    groups must start at even columns; int4 in groups of an odd size (no format writes them, but
    nothing forbids them) is stored a byte per value."""
    return 8 if w.bits == 4 and not groups_pair(w.group_size, w.in_features) else w.bits


def packed_bytes(w: QuantizedWeight) -> int:
    """The size of pack(w).packed."""
    return _cpu.quant_gemm_packed_bytes(w.out_features, w.in_features, stored_bits(w))


def pack(w: QuantizedWeight, out: torch.Tensor | None = None) -> PackedQuantWeight:
    """The kernel's copy of `w` (csrc/cpu_gemm_quant.h: panels of 16 columns, slices 256 deep, values
    at stored_bits(w)). The packed values go into `out` (uint8 [packed_bytes(w)]: a caller's buffer,
    such as one expert's part of the stacked experts), else into a new tensor on 2 MiB pages."""
    n, k, bits = w.out_features, w.in_features, stored_bits(w)
    q = w.qweight if bits == 8 else (w.qweight.to(torch.int16) + 8).to(torch.uint8)
    if bits == 4 and k % 2:
        q = F.pad(q, (0, 1))  # int4 rows come in pairs; the pad is never read
    q = _panels(q.view(torch.uint8) if bits == 8 else q)  # [panels, 16, kp]
    kp = q.shape[2]
    slices = []
    for k0 in range(0, kp, SLICE):
        block = q[:, :, k0:k0 + SLICE].transpose(1, 2)  # [panels, depth, 16]
        if bits == 4:
            pairs = block.reshape(block.shape[0], -1, 2, PANEL)
            block = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
        slices.append(block.reshape(-1))
    size = packed_bytes(w)
    if sum(s.numel() for s in slices) != size:
        raise AssertionError("packed size disagrees with the kernel's layout")
    if out is None:
        # On 2 MiB pages, as the dense packed weights (cpu/huge_pages.py): streamed from memory every
        # step, 1.1-1.3x faster at one row on Zen 4 (2 threads, 96 MB of weights cycled).
        out = huge_pages.empty(size, torch.uint8)
    elif out.dtype != torch.uint8 or tuple(out.shape) != (size,):
        raise ValueError(f"pack: out must be uint8 [{size}], got {out.dtype} {tuple(out.shape)}")
    torch.cat(slices, out=out)
    scales = _panels(w.scales).permute(2, 0, 1).contiguous()
    zeros = None if w.zeros is None else _panels(w.zeros).permute(2, 0, 1).contiguous()
    return PackedQuantWeight(out, scales, zeros, n, k, bits, w.group_size, w.perm)


def _check_groups(p: PackedQuantWeight) -> None:
    if p.bits == 4 and not groups_pair(p.group_size, p.in_features):
        raise ValueError(f"int4 groups must have an even size (got {p.group_size}): pack() stores odd ones as int8")


def check(p: PackedQuantWeight) -> None:
    """The sizes the kernel will read, checked once when the packed weight is made (it trusts them)."""
    _check_groups(p)
    panels, groups = -(-p.out_features // PANEL), -(-p.in_features // p.group_size)
    if p.packed.dtype != torch.uint8 or p.packed.numel() != _cpu.quant_gemm_packed_bytes(p.out_features, p.in_features,
                                                                                       p.bits):
        raise ValueError(f"packed weight of {p.packed.numel()} {p.packed.dtype} elements for a {p.bits}-bit "
                         f"[{p.out_features}, {p.in_features}] weight")
    if p.scales.dtype != torch.float32 or tuple(p.scales.shape) != (groups, panels, PANEL):
        raise ValueError(f"packed scales {tuple(p.scales.shape)} ({p.scales.dtype}): expected float32 "
                         f"[{groups}, {panels}, {PANEL}]")
    if p.zeros is not None and (p.zeros.dtype != torch.int8 or tuple(p.zeros.shape) != (groups, panels, PANEL)):
        raise ValueError(f"packed zero points {tuple(p.zeros.shape)} ({p.zeros.dtype}): expected int8 "
                         f"[{groups}, {panels}, {PANEL}]")
    if not all(t.is_contiguous() for t in (p.packed, p.scales, p.zeros) if t is not None):
        raise ValueError("packed tensors must be contiguous")


def _bf16_rows(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """bf16 rows the kernel reads in pairs of columns: in place when contiguous with an even length,
    else a copy with a zero pad column."""
    m, k = rows.shape
    if k % 2 == 0 and rows.is_contiguous():
        return rows, k
    padded = torch.zeros((m, k + k % 2), dtype=torch.bfloat16)
    padded[:, :k] = rows
    return padded, padded.shape[1]


def stack_linear(p: PackedQuantWeight, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> tuple[_cpu.DecoderLinear, torch.Tensor | None] | None:
    """`p` as the C++ decoder stack multiplies by it (csrc/cpu_decoder.h), for activations of `dtype`
    taking `linear`'s path, with the fp32 bias it points at (the caller keeps it alive); None for an
    activation-order weight (`perm`: the stack does not gather columns)."""
    if p.perm is not None:
        return None
    b = None if bias is None else bias.float().contiguous()
    least, most = bf16_row_range(p) if dtype == torch.bfloat16 else (0, 0)
    return _cpu.DecoderLinear.quant(p.packed.data_ptr(), p.scales.data_ptr(), 0 if p.zeros is None else p.zeros.data_ptr(),
                                    0 if b is None else b.data_ptr(), p.out_features, p.in_features, p.group_size,
                                    p.bits, p.zero_offset, least, most), b


def linear(x: torch.Tensor, p: PackedQuantWeight, bias: torch.Tensor | None, isa: Isa = "auto",
           num_threads: int | None = None) -> torch.Tensor:
    """`F.linear(x, dequantize(W), bias)` for the weight `p` was packed from; x `[..., in]`."""
    if x.shape[-1] != p.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {p.in_features}")
    if bias is not None and bias.shape != (p.out_features,):
        raise ValueError(f"bias of shape {tuple(bias.shape)} for {p.out_features} outputs")
    rows = x if x.dim() == 2 else x.reshape(-1, p.in_features)
    if p.perm is not None:
        rows = rows.index_select(1, p.perm)
    m = rows.shape[0]
    least, most = bf16_row_range(p, isa) if x.dtype == torch.bfloat16 else (0, 0)
    bf16 = least > 0 and m >= least and (most == 0 or m <= most)
    xs, stride = _bf16_rows(rows) if bf16 else cpu_gemm.fp32_rows(rows)
    b = None if bias is None else bias.float().contiguous()
    # bf16 activations get bf16 out of the kernel (rounded from its fp32 sums); others fp32, converted.
    y = torch.empty((m, p.out_features), dtype=torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
    if m:
        _cpu.quant_gemm_cpu(0 if bf16 else xs.data_ptr(), p.packed.data_ptr(), p.scales.data_ptr(),
                          0 if p.zeros is None else p.zeros.data_ptr(), 0 if b is None else b.data_ptr(),
                          y.data_ptr(), m, p.out_features, p.in_features, stride, p.out_features, p.group_size,
                          p.bits, p.zero_offset, ISA_CODES[isa],
                          torch.get_num_threads() if num_threads is None else num_threads,
                          xs.data_ptr() if bf16 else 0, y.dtype == torch.bfloat16)
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], p.out_features)
