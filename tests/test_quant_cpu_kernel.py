"""The CPU GEMM on int8 / int4 weights (csrc/cpu_gemm_quant.cpp through
nanovllm/layers/quantization/cpu_kernel.py) against `x @ dequantize(W).T`, on every instruction set
this CPU runs (AVX-512, AVX2, the portable C++): ragged rows (the in-register path up to 12 rows,
the dequantized-slice path past it, register tiles cut anywhere), depths not a multiple of the
group or the 256-deep slice (odd for int4), output columns not a multiple of the 16-column panel,
every group size, symmetric and asymmetric, activation order; and bad metadata is an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from quant_helpers import random_quantized

from nanovllm import _cpu
from nanovllm.layers.quantization import cpu_kernel
from nanovllm.layers.quantization.weights import QuantizedWeight

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not cpu_kernel.isa_supported(isa), reason=f"the CPU lacks {isa}"))
        for isa in ("portable", "avx2", "avx512", "amx")]
# (rows, k, n, group size): k = group size means one group per output channel
SHAPES = [
    (1, 256, 16, 32), (1, 300, 40, 64), (3, 333, 33, 333), (7, 1000, 48, 128), (12, 520, 100, 520),
    (13, 200, 17, 64), (150, 700, 64, 128), (300, 96, 31, 32), (0, 64, 16, 64), (5, 257, 1000, 16),
    (2, 333, 20, 111), (20, 333, 20, 111),  # odd groups: int4 stored a byte per value
    (6, 130, 33, 32), (8, 512, 40, 128), (10, 300, 17, 64), (11, 257, 50, 16),  # in-register row tiles
]


def reference(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.dequantize(torch.float64), None if bias is None else bias.double()).float()


def assert_matches(y: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-5 * max(scale, 1.0))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_kernel_matches_dequantized_product(isa: str, bits: int, symmetric: bool) -> None:
    for i, (rows, k, n, group) in enumerate(SHAPES):
        w = random_quantized(n, k, bits, group, symmetric, seed=i)
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(rows, k, generator=g)
        bias = torch.randn(n, generator=g) if i % 2 else None
        packed = cpu_kernel.pack(w)
        y = cpu_kernel.linear(x, packed, bias, isa=isa)  # type: ignore[arg-type]
        assert y.shape == (rows, n)
        assert_matches(y, reference(x, w, bias))


@pytest.mark.parametrize("isa", ISAS)
def test_activation_order_and_strided_bf16_input(isa: str) -> None:
    """A permuted weight (GPTQ desc_act) reads the input's columns in its own order; rows of a wider
    tensor and bf16 activations go through the same path (the product rounded to bf16)."""
    w = random_quantized(40, 384, 4, 128, symmetric=False, seed=7, act_order=True)
    packed = cpu_kernel.pack(w)
    wide = torch.randn(9, 400, generator=torch.Generator().manual_seed(8))[:, 5:389]
    assert_matches(cpu_kernel.linear(wide, packed, None, isa=isa), reference(wide, w, None))  # type: ignore[arg-type]
    xb = wide.to(torch.bfloat16)
    y = cpu_kernel.linear(xb, packed, None, isa=isa)  # type: ignore[arg-type]
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, reference(xb.float(), w, None).to(torch.bfloat16), rtol=2 ** -7, atol=1e-3)


@pytest.mark.skipif(not _cpu.quant_has_bf16(), reason="the CPU lacks AVX512-BF16")
@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_dot_product_path(bits: int) -> None:
    """bf16 activations on an AVX512-BF16 CPU: bf16 dot products on pairs of input columns (the
    weights' integers are exact in bf16, scales apply in fp32), so as close to the fp32 product of
    the bf16 activations as the in-register fp32 path; odd depths pad a zero column; 1-300 rows."""
    for i, (rows, k, n, group) in enumerate([(1, 333, 40, 112), (13, 700, 64, 100), (40, 255, 17, 255),
                                             (300, 512, 48, 64), (5, 96, 16, 32)]):
        w = random_quantized(n, k, bits, group, symmetric=bool(i % 2), seed=i)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        y = cpu_kernel.linear(x, cpu_kernel.pack(w), None)
        expected = reference(x.float(), w, None)
        torch.testing.assert_close(y.float(), expected, rtol=2 ** -7, atol=2 ** -8 * expected.abs().max().item())
        y32 = cpu_kernel.linear(x, cpu_kernel.pack(w), None, isa="avx2")  # the fp32 path
        assert (y.float() - y32.float()).abs().max() <= 2 ** -7 * y32.float().abs().max()
    x = torch.randn(20, 64).to(torch.bfloat16)
    p = cpu_kernel.pack(random_quantized(16, 63, 4, 63, True, seed=0))
    with pytest.raises(ValueError, match="even"):  # bf16 rows hold k rounded up to even
        _cpu.quant_gemm_cpu(0, p.packed.data_ptr(), p.scales.data_ptr(), 0, 0, torch.empty(20, 16).data_ptr(), 20, 16,
                          63, 63, 16, 63, 4, 8.0, 0, 1, x.data_ptr())


@pytest.mark.skipif(not _cpu.quant_has_bf16(), reason="the CPU lacks AVX512-BF16")
@pytest.mark.parametrize("group", [32, 64, 6, 10, 0])
def test_bf16_path_sums_in_fp32(group: int) -> None:
    """The bf16 path's fp32 output against float64: the products of bf16 activations and integer
    weights are exact, so only fp32 summation separates them. int4 groups of a multiple of 4 take
    two depths of weights per step (the activations reordered to match); groups of 4j + 2 and odd
    tails (depths 4j + 1..3 of a group or of k) the single steps; group 0 is one group per row."""
    for i, (rows, k, n) in enumerate([(1, 1030, 40), (2, 257, 33), (3, 515, 16), (5, 96, 48), (12, 262, 17),
                                      (13, 301, 32)]):
        gs = group or k
        w = random_quantized(n, k, 4, gs, symmetric=bool(i % 2), seed=10 + i)
        p = cpu_kernel.pack(w)
        assert p.bits == 4
        x = torch.randn(rows, k + k % 2, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        x[:, k:] = 0  # the pad column of an odd k
        y = torch.empty(rows, n)
        _cpu.quant_gemm_cpu(0, p.packed.data_ptr(), p.scales.data_ptr(), 0 if p.zeros is None else p.zeros.data_ptr(),
                          0, y.data_ptr(), rows, n, k, x.shape[1], n, gs, 4, p.zero_offset, 0, 2, x.data_ptr())
        expected = reference(x[:, :k].float(), w, None)
        scale = F.linear(x[:, :k].double().abs(), w.dequantize(torch.float64).abs()).max().item()
        torch.testing.assert_close(y, expected, rtol=0, atol=1e-5 * scale)
        yb = torch.empty(rows, n, dtype=torch.bfloat16)  # bf16 out: the same sums, rounded by the kernel
        _cpu.quant_gemm_cpu(0, p.packed.data_ptr(), p.scales.data_ptr(), 0 if p.zeros is None else p.zeros.data_ptr(),
                          0, yb.data_ptr(), rows, n, k, x.shape[1], n, gs, 4, p.zero_offset, 0, 2, x.data_ptr(), True)
        assert torch.equal(yb, y.to(torch.bfloat16))


def int16_block(k: int, group: int) -> int:
    """The int16 path's activation block: the largest of 128, 64, 32 that divides k and the group size."""
    return next(b for b in (128, 64, 32) if k % b == 0 and group % b == 0)


def summed_magnitudes(x: torch.Tensor, w: QuantizedWeight, zero_offset: float) -> torch.Tensor:
    """|x| times the magnitudes the kernels add before a group's zero points come off (its stored
    values and zero points, zero_offset on both, times |scale|): what fp32 rounding is relative to.
    For unsigned int4 these are several times |w| where q and z are close."""
    zeros = torch.zeros_like(w.scales) if w.zeros is None else w.zeros.double()
    stored = (w.qweight.double() + zero_offset).abs()
    stored += (zeros + zero_offset).abs().repeat_interleave(w.group_size, dim=1)[:, :w.in_features]
    return F.linear(x.double().abs(), stored * w.scales.double().abs().repeat_interleave(w.group_size, dim=1)[:, :w.in_features])


def int16_call(x: torch.Tensor, p: cpu_kernel.PackedQuantWeight, y: torch.Tensor,
               bias: torch.Tensor | None = None, isa: str = "auto") -> None:
    """quant_gemm_cpu on the rows of bf16 activations x (x_bf16, rows x.stride(0) apart), fp32 out."""
    k = p.in_features
    _cpu.quant_gemm_cpu(0, p.packed.data_ptr(), p.scales.data_ptr(), 0 if p.zeros is None else p.zeros.data_ptr(),
                        0 if bias is None else bias.data_ptr(), y.data_ptr(), x.shape[0], p.out_features, k,
                        x.stride(0), p.out_features, p.group_size, p.bits, p.zero_offset, cpu_kernel.ISA_CODES[isa],
                        1, x.data_ptr())


VNNI = _cpu.quant_has_vnni512()


def int16_row_path(bits: int) -> object:
    """Runs where one bf16 row takes 16-bit integers: AVX2 CPUs (int4, int8), AVX512-VNNI ones (int4)."""
    return pytest.mark.skipif(not (cpu_kernel.AVX2_BEST or (bits == 4 and VNNI)),
                              reason="one bf16 row takes the int16 path on AVX2 CPUs, and for int4 on AVX512-VNNI")


@pytest.mark.parametrize("bits", [pytest.param(4, marks=int16_row_path(4)), pytest.param(8, marks=int16_row_path(8))])
def test_one_bf16_row_as_16_bit_integers(bits: int) -> None:
    """One bf16 row against int4 or int8 on AVX2: 16-bit integers with a power-of-two scale per block of
    128, 64 or 32 columns (int16_block; largest value below 2^e: steps of 2^(e - 15)), so within half
    a step per value of the fp32 product of the same row (an outlier coarsens its own block only); it
    is not the fp32 path (whose result differs); NaN reaches every output; shapes it does not take
    (k or the groups not a multiple of 32) give the fp32 path's bits."""
    # Slices of 256 columns: a partial last one (384, 320), a group across two (384 of 768).
    for i, (k, n, group) in enumerate([(1024, 40, 128), (256, 33, 32), (512, 16, 512), (96, 100, 32),
                                       (3072, 17, 64), (768, 50, 256), (384, 24, 128), (320, 20, 64),
                                       (768, 20, 384)]):
        w = random_quantized(n, k, bits, group, symmetric=bool(i % 2), seed=60 + i)
        p = cpu_kernel.pack(w)
        block = int16_block(k, group)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        x[0, 3] = 300.0
        x[0, block:2 * block] = 0.0  # a block of zeros takes the scalar rule, the rest its vector form
        bias = torch.randn(n, generator=torch.Generator().manual_seed(100 + i)) if i % 3 == 0 else None
        y = torch.empty(1, n)
        int16_call(x, p, y, bias)
        expected = reference(x.float(), w, bias).double()
        blocks = x.float().reshape(-1, block).abs().amax(dim=1)
        half_step = torch.ldexp(torch.ones_like(blocks), torch.frexp(blocks).exponent - 16).repeat_interleave(block)
        bound = F.linear(half_step.double()[None], w.dequantize(torch.float64).abs())
        scale = F.linear(x.double().abs(), w.dequantize(torch.float64).abs())
        assert ((y.double() - expected).abs() <= bound + 1e-6 * scale).all(), i
        y32 = cpu_kernel.linear(x.float(), p, bias)
        assert not torch.equal(y, y32), i  # the integer path ran
        assert torch.equal(cpu_kernel.linear(x, p, bias), y.to(torch.bfloat16)), i  # linear takes it for bf16 rows
        x[0, k // 2] = float("nan")
        int16_call(x, p, y)
        assert torch.isnan(y).all(), i
    if not cpu_kernel.AVX2_BEST:  # (an AVX512-VNNI CPU's other path for one row is the bf16 one)
        return
    for k, group in ((100, 50), (96, 48), (130, 130)):  # fp32 path: the same bits as from fp32 rows
        w = random_quantized(24, k, bits, group, symmetric=False, seed=k)
        p = cpu_kernel.pack(w)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
        y = torch.empty(1, 24)
        int16_call(x, p, y)
        assert torch.equal(y, cpu_kernel.linear(x.float(), p, None)), k


@pytest.mark.skipif(not (VNNI and cpu_kernel.isa_supported("avx2")), reason="the CPU lacks AVX512-VNNI")
def test_vnni_int4_row_gives_the_avx2_int16_bits() -> None:
    """One bf16 row against int4 on AVX512-VNNI (vpdpwssd over both halves of the AVX2 int16 kernel's
    step in one register) sums the same integers in the same lanes and scales them in the same order:
    the AVX2 kernel's bits, on ragged and strided shapes, every block size, with and without zero
    points and bias; not the bf16 dot products' (the AVX-512 path past kVnniMaxRows rows)."""
    for i, (k, n, group) in enumerate([(1024, 40, 128), (256, 33, 32), (512, 17, 512), (3072, 100, 64),
                                       (768, 50, 256), (320, 20, 64), (96, 1000, 32)]):
        w = random_quantized(n, k, 4, group, symmetric=bool(i % 2), seed=80 + i)
        p = cpu_kernel.pack(w)
        wide = torch.randn(1, k + 24, generator=torch.Generator().manual_seed(i))[:, 8:8 + k].to(torch.bfloat16)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(200 + i)) if i % 3 == 0 else None
        vnni, avx2 = torch.empty(1, n), torch.empty(1, n)
        int16_call(wide, p, vnni, bias)
        int16_call(wide, p, avx2, bias, isa="avx2")
        assert torch.equal(vnni, avx2), i
        dots = torch.empty(VNNI_MAX_ROWS + 1, n)
        int16_call(wide.expand(VNNI_MAX_ROWS + 1, k).contiguous(), p, dots, bias, isa="avx512")
        assert not torch.equal(vnni, dots[:1]), i


VNNI_MAX_ROWS = 4  # csrc/cpu_gemm_quant.cpp's kVnniMaxRows
AMX_INT4_MIN_ROWS = 3  # and kAmxInt4MinRows: from there "auto" takes AMX int8 tiles where the CPU has them


@pytest.mark.skipif(not VNNI, reason="the CPU lacks AVX512-VNNI")
@pytest.mark.parametrize("isa", ["auto", "avx512"])
def test_vnni_int4_rows_give_each_row_alone_bits(isa: str) -> None:
    """Two to kVnniMaxRows bf16 rows against int4 on AVX512-VNNI (the weights decoded once for every
    row's vpdpwssd, on AMX CPUs too): each row's output is that row's alone, bit for bit, whatever
    its neighbours' magnitudes (each row its own block scales), zero blocks, outliers and NaNs (which
    stay in their row); strided rows; against the reference within the one-row path's bound. On an
    AMX CPU "auto" gives the int8 tiles the rows from AMX_INT4_MIN_ROWS (test_weights_on_amx_int8_tiles)."""
    most = AMX_INT4_MIN_ROWS - 1 if isa == "auto" and cpu_kernel.isa_supported("amx") else VNNI_MAX_ROWS
    for i, (k, n, group) in enumerate([(1024, 40, 128), (256, 33, 32), (3072, 100, 64), (768, 50, 256),
                                       (320, 20, 64)]):
        w = random_quantized(n, k, 4, group, symmetric=bool(i % 2), seed=90 + i)
        p = cpu_kernel.pack(w)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(300 + i)) if i % 2 == 0 else None
        for m in range(2, most + 1):
            g = torch.Generator().manual_seed(10 * i + m)
            wide = torch.randn(m, k + 40, generator=g) * torch.logspace(-3, 3, m)[:, None]
            x = wide[:, 16:16 + k].to(torch.bfloat16)  # rows k + 40 apart
            x[0, 5] = 5e4  # an outlier coarsens its own block of its own row only
            x[m - 1, :32] = 0.0
            if m == 3:
                x[1, k // 3] = float("nan")
            y = torch.empty(m, n)
            int16_call(x, p, y, bias, isa)
            for r in range(m):
                alone = torch.empty(1, n)
                int16_call(x[r:r + 1], p, alone, bias, isa)
                assert torch.equal(y[r:r + 1], alone) or (torch.isnan(alone).all() and torch.isnan(y[r]).all()), (i, m, r)
            if m == 3:
                assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2]]).any(), i
            # Within half a step of each value's block (test_one_bf16_row_as_16_bit_integers' bound), row by row.
            block = int16_block(k, group)
            blocks = x.float().reshape(m, -1, block).abs().amax(dim=2)
            half_step = torch.ldexp(torch.ones_like(blocks), torch.frexp(blocks).exponent - 16)
            bound = F.linear(half_step.repeat_interleave(block, dim=1).double(), w.dequantize(torch.float64).abs())
            scale = F.linear(x.double().abs(), w.dequantize(torch.float64).abs())
            ok = (y.double() - reference(x.float(), w, bias).double()).abs() <= bound + 1e-6 * scale
            assert ok[~torch.isnan(y)].all(), (i, m)


def int16_rounded(x: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Rows of x as the 16-bit integer paths take them, the rule written here in float64: the columns
    [bounds[i], bounds[i + 1]) as multiples of 2^(e - 15), e the frexp exponent of their largest
    magnitude, rounded half away from zero; zeros stay zero, and NaN throughout a range holding a NaN or
    an infinity."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for c0, c1 in zip(bounds, bounds[1:]):
        seg = x[:, c0:c1].double()
        most = seg.abs().amax(dim=1)
        step = torch.ldexp(torch.ones_like(most), torch.frexp(most.float()).exponent.long() - 15).double()
        step = torch.where(most.isfinite(), step, float("nan"))
        q = torch.trunc(seg / step[:, None] + 0.5 * torch.sign(seg)).clamp(-32767, 32767)
        out[:, c0:c1] = torch.where(most[:, None] == 0, 0.0, q * step[:, None])
    return out


@pytest.mark.parametrize("bits", [pytest.param(4, marks=int16_row_path(4)), pytest.param(8, marks=int16_row_path(8))])
@pytest.mark.parametrize("exponents", [(-6, 6), (-134, -108), (100, 118)])
@pytest.mark.parametrize("group", [128, 64, 32])
def test_int16_rows_round_half_away_from_zero(bits: int, exponents: tuple[int, int], group: int) -> None:
    """The int16 path's activations: each block's values (int16_block: 128, 64 or 32 columns) as
    multiples of 2^(e - 15) (e the frexp exponent of the block's largest magnitude) rounded half away
    from zero, the rule written here in float64. Most values lie ~2^-12 below their block's largest,
    so every one of them rounds. Rows of ordinary, tiny (down to bf16's subnormals: the scalar form of
    the rule, below 2^-112) and huge magnitudes."""
    k, n = 512, 24
    block = int16_block(k, group)
    w = random_quantized(n, k, bits, group, symmetric=False, seed=5)
    p = cpu_kernel.pack(w)
    g = torch.Generator().manual_seed(5)
    largest = torch.ldexp(torch.ones(k // block), torch.randint(*exponents, (k // block,), generator=g))
    x = torch.randn(k // block, block, generator=g) * 2.0**-12 * largest[:, None]
    x[:, 7] = largest * torch.where(torch.rand(k // block, generator=g) < 0.5, -1.0, 1.0)
    x = x.reshape(1, k).to(torch.bfloat16)
    expected = F.linear(int16_rounded(x, list(range(0, k + 1, block))), w.dequantize(torch.float64))
    y = torch.empty(1, n)
    int16_call(x, p, y)
    assert ((y.double() - expected).abs() <= 1e-6 * summed_magnitudes(x, w, p.zero_offset)).all()


def amx_int_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """The AMX int path's activations: int16_rounded over its segments (a group's part of a 256-deep
    slice)."""
    k = x.shape[1]
    return int16_rounded(x, sorted({0, k} | set(range(0, k, 256)) | set(range(0, k, group))))


@pytest.mark.skipif(not cpu_kernel.isa_supported("amx"), reason="the CPU lacks AMX tiles")
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_weights_on_amx_int8_tiles(bits: int, symmetric: bool) -> None:
    """int8 weights against 1-64 bf16 rows, int4 against 3-20, on an AMX CPU: the rows as 16-bit
    integers per segment (amx_int_rows: values within 2^7 of their segment's largest exact, an outlier
    coarsening its own segment only), each a signed high and an unsigned low byte on int8 tiles, so the
    product of those integers to fp32 summation; which is not the bf16 tiles' result on rows with
    outliers. Groups across slices (192, 384), a partial last slice, rows of zeros, tiny rows, a NaN or
    an infinity (NaN in every output of the row), blocks of fewer than 16 rows (tiles as tall as the
    rows), partial blocks of 16 rows and an odd panel at the end."""
    cases = {8: [(1, 256, 24, 256), (2, 64, 16, 64), (17, 512, 40, 512), (32, 1024, 100, 128), (33, 640, 33, 192),
                 (64, 768, 48, 384), (50, 320, 20, 64)],
             4: [(5, 64, 16, 64), (17, 512, 40, 512), (20, 1024, 100, 128), (12, 640, 33, 192),
                 (8, 768, 48, 384), (19, 320, 20, 64), (6, 1024, 32, 1024), (3, 256, 24, 128),
                 (4, 512, 16, 64)]}[bits]
    for i, (rows, k, n, group) in enumerate(cases):
        w = random_quantized(n, k, bits, group, symmetric, seed=80 + i)
        p = cpu_kernel.pack(w)
        g = torch.Generator().manual_seed(i)
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        x[0, k // 3] = 3000.0  # an outlier: its segment's small values round
        if rows > 4:
            x[1] *= 2.0**-120  # tiny: the scalar form of the rule
            x[2] = 0.0
            x[3, min(k - 1, 300)] = float("nan")
            x[4, 5] = float("inf")
        bias = torch.randn(n, generator=g)

        def product(threads: int, with_bias: bool = True) -> torch.Tensor:
            y = torch.empty(rows, n)
            _cpu.quant_gemm_cpu(0, p.packed.data_ptr(), p.scales.data_ptr(),
                                0 if p.zeros is None else p.zeros.data_ptr(), bias.data_ptr() if with_bias else 0,
                                y.data_ptr(), rows, n, k, k, n, group, bits, p.zero_offset, 0, threads, x.data_ptr())
            return y

        y = product(2)
        xr = amx_int_rows(x, group)
        expected = F.linear(xr, w.dequantize(torch.float64), bias.double())
        finite = xr.isfinite().all(dim=1)
        assert y[~finite].isnan().all(), i
        bound = 1e-6 * summed_magnitudes(x[finite].float(), w, p.zero_offset) + 1e-6 * bias.abs().double()
        assert ((y[finite].double() - expected[finite]).abs() <= bound).all(), i
        # Without the bias, whose size the tiny row's products sit far below, each row on its own scale.
        y0 = product(2, with_bias=False)[finite].double()
        expected0 = F.linear(xr, w.dequantize(torch.float64))[finite]
        assert ((y0 - expected0).abs() <= 1e-6 * summed_magnitudes(x[finite].float(), w, p.zero_offset)).all(), i
        exact = F.linear(x[finite].double(), w.dequantize(torch.float64), bias.double())
        assert not torch.allclose(y[finite].double()[0], exact[0], rtol=0, atol=1e-7 * exact[0].abs().max().item()), i
        for threads in (1, 3):  # threads split the panels, never a sum
            assert torch.equal(product(threads).nan_to_num(), y.nan_to_num()), (i, threads)


@pytest.mark.skipif(not cpu_kernel.isa_supported("amx"), reason="the CPU lacks AMX tiles")
def test_int8_rows_on_amx_int8_tiles_keep_their_bits_at_any_row_count() -> None:
    """int8 against bf16 rows on an AMX CPU (cpu_kernel.linear, "auto"): from one row to 64 the AMX
    int8 tiles take them where k and the groups are multiples of 64 (one row handed over as bf16), so
    a row's output is the same bits whatever rows share its GEMM; elsewhere one row stays fp32."""
    for i, (k, n, group) in enumerate([(512, 100, 512), (1024, 48, 128), (320, 33, 64)]):
        w = random_quantized(n, k, 8, group, symmetric=bool(i % 2), seed=60 + i)
        p = cpu_kernel.pack(w)
        assert cpu_kernel.bf16_row_range(p) == (1, 0), i
        x = torch.randn(64, k, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        x[:, k // 5] *= 300.0  # an outlier in every row: the int rule rounds its segment's small values
        full = cpu_kernel.linear(x, p, None)
        for m in (1, 2, 3, 15, 16, 17, 33):
            assert torch.equal(cpu_kernel.linear(x[:m], p, None), full[:m]), (i, m)
    odd = cpu_kernel.pack(random_quantized(16, 96, 8, 96, symmetric=True, seed=69))
    assert cpu_kernel.bf16_row_range(odd) == (2, 0)  # k = 96: the bf16 dot products from 2 rows


GUARDED_ROWS = """
import ctypes, mmap, sys, torch
from quant_helpers import random_quantized
from nanovllm import _cpu
from nanovllm.layers.quantization import cpu_kernel
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
page = mmap.PAGESIZE
base = libc.mmap(None, 2 * page, 3, 0x22, -1, 0)  # read/write, private anonymous
assert libc.mprotect(base + page, page, 0) == 0  # the second page: no access
m, k, n, stride, group = 2, 64, 16, 128, 32
start = base + page - 2 * (stride + k)  # the last row ends where the guard page begins
x = torch.randn(m, k).to(torch.bfloat16)
rows = torch.frombuffer((ctypes.c_uint16 * (stride + k)).from_address(start), dtype=torch.int16)
rows[:k] = x[0].view(torch.int16)
rows[stride:] = x[1].view(torch.int16)
w = random_quantized(n, k, 4, group, False, seed=1)
p = cpu_kernel.pack(w)
y = torch.empty(m, n)
_cpu.quant_gemm_cpu(0, p.packed.data_ptr(), p.scales.data_ptr(), p.zeros.data_ptr(), 0, y.data_ptr(), m, n, k,
                  stride, n, group, 4, p.zero_offset, 0, 1, start, False)
err = (y - torch.nn.functional.linear(x.double(), w.dequantize(torch.float64)).float()).abs().max().item()
print("max error", err)
sys.exit(0 if err < 1e-3 else 3)
"""


@pytest.mark.skipif(not _cpu.quant_has_bf16(), reason="the CPU lacks AVX512-BF16")
def test_bf16_rows_are_read_only_to_their_length() -> None:
    """Rows x_stride apart (a view of a wider tensor) are read up to k + k % 2 each and no further:
    the last row ends at a page the process may not read (in a subprocess: a read there kills it)."""
    proc = subprocess.run([sys.executable, "-c", GUARDED_ROWS], cwd=Path(__file__).parent, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_output_is_the_fp32_output_rounded(isa: str) -> None:
    """y_bf16: each thread rounds its own columns of the fp32 sums, as torch's .to(bfloat16) would."""
    for i, (rows, k, n, group, bits) in enumerate([(1, 300, 40, 64, 4), (7, 520, 100, 520, 8), (20, 256, 33, 32, 4)]):
        w = random_quantized(n, k, bits, group, symmetric=bool(i % 2), seed=20 + i)
        p = cpu_kernel.pack(w)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(i))
        bias = torch.randn(n, generator=torch.Generator().manual_seed(50 + i))
        code = cpu_kernel.ISA_CODES[isa]
        for threads in (1, 3):
            outs = {}
            for dtype in (torch.float32, torch.bfloat16):
                y = torch.full((rows, n + 3), -1.0, dtype=dtype)  # a wider row: y_stride
                _cpu.quant_gemm_cpu(x.data_ptr(), p.packed.data_ptr(), p.scales.data_ptr(),
                                  0 if p.zeros is None else p.zeros.data_ptr(), bias.data_ptr(), y.data_ptr(), rows, n,
                                  k, k, n + 3, group, p.bits, p.zero_offset, code, threads, 0, dtype == torch.bfloat16)
                assert y[:, n:].eq(-1).all()
                outs[dtype] = y[:, :n]
            assert torch.equal(outs[torch.bfloat16], outs[torch.float32].to(torch.bfloat16)), (i, threads)


@pytest.mark.skipif(not _cpu.quant_has_bf16(), reason="the CPU lacks AVX512-BF16")
@pytest.mark.parametrize("isa", ["avx512", "amx"])
def test_bf16_output_of_bf16_rows_is_the_fp32_output_rounded(isa: str) -> None:
    """y_bf16 from bf16 rows: the AMX path rounds each sum as it finishes it (a last panel of fewer
    than 16 columns stored under a mask), the vdpbf16ps path after; both as torch's .to(bfloat16)."""
    if not cpu_kernel.isa_supported(isa):  # type: ignore[arg-type]
        pytest.skip(f"the CPU does not run {isa}")
    # The last two: k not a multiple of the group (a last group of 128 after two of 256), int8 and
    # int4 groups decoded in several pieces.
    shapes = [(40, 256, 33, 64, 4), (33, 512, 100, 512, 8), (64, 384, 48, 128, 4), (33, 640, 40, 256, 8),
              (40, 640, 40, 256, 4)]
    for i, (rows, k, n, group, bits) in enumerate(shapes):
        w = random_quantized(n, k, bits, group, symmetric=bool(i % 2), seed=40 + i)
        p = cpu_kernel.pack(w)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(i)).bfloat16()
        bias = torch.randn(n, generator=torch.Generator().manual_seed(60 + i))
        for threads in (1, 3):
            outs = {}
            for dtype in (torch.float32, torch.bfloat16):
                y = torch.full((rows, n + 3), -1.0, dtype=dtype)
                _cpu.quant_gemm_cpu(0, p.packed.data_ptr(), p.scales.data_ptr(),
                                  0 if p.zeros is None else p.zeros.data_ptr(), bias.data_ptr(), y.data_ptr(), rows, n,
                                  k, k, n + 3, group, p.bits, p.zero_offset, cpu_kernel.ISA_CODES[isa], threads,
                                  x.data_ptr(), dtype == torch.bfloat16)
                assert y[:, n:].eq(-1).all()
                outs[dtype] = y[:, :n]
            assert torch.equal(outs[torch.bfloat16], outs[torch.float32].to(torch.bfloat16)), (i, threads)


def test_every_isa_gives_the_same_result_on_any_number_of_threads() -> None:
    """Threads split the output panels, never a sum: every thread count gives the same bits."""
    w = random_quantized(200, 300, 4, 64, symmetric=False, seed=3)
    packed = cpu_kernel.pack(w)
    for rows in (2, 40):
        x = torch.randn(rows, 300, generator=torch.Generator().manual_seed(rows))
        for isa in ("portable", "avx2", "avx512", "amx"):
            if not cpu_kernel.isa_supported(isa):  # type: ignore[arg-type]
                continue
            outs = [cpu_kernel.linear(x, packed, None, isa=isa, num_threads=t) for t in (1, 2, 3)]  # type: ignore[arg-type]
            assert all(torch.equal(outs[0], y) for y in outs[1:]), (isa, rows)


def test_odd_int4_groups_are_stored_as_bytes() -> None:
    w = random_quantized(16, 90, 4, 45, symmetric=False, seed=4)
    p = cpu_kernel.pack(w)
    assert p.bits == 8 and p.packed.numel() == 16 * 90
    with pytest.raises(ValueError, match="even size"):
        cpu_kernel.PackedQuantWeight(p.packed[:16 * 45], p.scales, p.zeros, 16, 90, 4, 45, None)
    x = torch.randn(3, 90)
    y = torch.empty(3, 16)
    with pytest.raises(ValueError, match="even group size"):
        _cpu.quant_gemm_cpu(x.data_ptr(), p.packed.data_ptr(), p.scales.data_ptr(), p.zeros.data_ptr(), 0, y.data_ptr(),
                          3, 16, 90, 90, 16, 45, 4, 8.0)


def test_packed_sizes() -> None:
    """int8: a byte per weight; int4: half, K padded to even; rows padded to 16-column panels."""
    assert _cpu.quant_gemm_packed_bytes(16, 256, 8) == 16 * 256
    assert _cpu.quant_gemm_packed_bytes(17, 256, 8) == 32 * 256
    assert _cpu.quant_gemm_packed_bytes(16, 255, 4) == 16 * 256 // 2
    w = random_quantized(33, 333, 4, 112, symmetric=False, seed=1)
    p = cpu_kernel.pack(w)
    assert p.packed.numel() == 48 * 334 // 2 and tuple(p.scales.shape) == (3, 3, 16) == tuple(p.zeros.shape)
    assert p.scales[:, 2, 1:].eq(0).all()  # columns past n: scale 0
    assert cpu_kernel.packed_bytes(w) == p.packed.numel()
    into = torch.empty(2 * p.packed.numel(), dtype=torch.uint8)[p.packed.numel():]  # a caller's buffer
    assert torch.equal(cpu_kernel.pack(w, into).packed, p.packed) and into.equal(p.packed)
    with pytest.raises(ValueError, match="out must be uint8"):
        cpu_kernel.pack(w, into[1:])


def test_bad_metadata_is_an_error() -> None:
    w = random_quantized(32, 128, 4, 64, symmetric=False, seed=2)
    with pytest.raises(ValueError, match=r"scales of shape \(32, 3\)"):
        QuantizedWeight(w.qweight, torch.ones(32, 3), None, 4, 64)
    with pytest.raises(ValueError, match="zero points of shape"):
        QuantizedWeight(w.qweight, w.scales, torch.zeros(32, 2, dtype=torch.int32), 4, 64)
    with pytest.raises(ValueError, match="outside the 4-bit range"):
        QuantizedWeight(torch.full((32, 128), 9, dtype=torch.int8), w.scales, None, 4, 64)
    with pytest.raises(ValueError, match="3-bit"):
        QuantizedWeight(w.qweight, w.scales, None, 3, 64)
    with pytest.raises(ValueError, match="group size 0"):
        QuantizedWeight(w.qweight, w.scales, None, 4, 0)
    with pytest.raises(ValueError, match="permutation"):
        QuantizedWeight(w.qweight, w.scales, None, 4, 64, torch.arange(127))
    p = cpu_kernel.pack(w)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="packed weight of"):
        cpu_kernel.PackedQuantWeight(p.packed[:-1], p.scales, p.zeros, 32, 128, 4, 64, None)
    with pytest.raises(ValueError, match="packed scales"):
        cpu_kernel.PackedQuantWeight(p.packed, p.scales[:, :1], p.zeros, 32, 128, 4, 64, None)
    with pytest.raises(ValueError, match="packed zero points"):
        cpu_kernel.PackedQuantWeight(p.packed, p.scales, p.zeros.float(), 32, 128, 4, 64, None)
    with pytest.raises(ValueError, match="129 features"):
        cpu_kernel.linear(torch.randn(2, 129), p, None)
    with pytest.raises(ValueError, match="bias of shape"):
        cpu_kernel.linear(x, p, torch.randn(31))
    y = torch.empty(2, 32)
    args = [x.data_ptr(), p.packed.data_ptr(), p.scales.data_ptr(), p.zeros.data_ptr(), 0, y.data_ptr(), 2, 32, 128,
            128, 32, 64, 4, 8.0]
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        _cpu.quant_gemm_cpu(*args[:12], 5, 8.0)
    with pytest.raises(ValueError, match="bad sizes"):  # a group larger than k
        _cpu.quant_gemm_cpu(*args[:11], 129, 4, 8.0)
    with pytest.raises(ValueError, match="null pointer"):
        _cpu.quant_gemm_cpu(0, *args[1:])
    with pytest.raises(ValueError, match="isa"):
        _cpu.quant_gemm_cpu(*args, isa=7)
