"""GEMMs on AMX tiles against the same products in fp32 and against the AVX512-BF16 paths on the same
packed weights: gemm_bf16 (csrc/cpu_gemm_amx.cpp) and the quantized GEMM's bf16 activations
(csrc/cpu_gemm_quant.cpp). Row blocks of 16 with a zero-padded tail, two blocks by two panels at a
time, a lone last panel, columns past n, bias, strides, groups, thread splits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovllm import _cpu
from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.layers.quantization import cpu_kernel
from quant_helpers import random_quantized

pytestmark = pytest.mark.skipif(not _cpu.has_amx_bf16(), reason="this process has no AMX tiles")

# rows: 0, below one block, a block, blocks and a tail, two-block groups and a lone block; k: one tile
# deep, a slice and a part, several slices (multiples of 32, AMX's condition); n: one panel, an odd
# number of panels (a lone last one), columns past n in the last pair or panel; a depth at which the
# rows go in chunks of 32 (768 KB of A tiles: 32, 32, then 6 rows). The last three take the depth in
# 256-deep passes (16 blocks or more, k > 512): 17 blocks with a lone one-row block and a last pass
# 32 deep, a lone panel spilling 8 columns; 18 blocks and a tail; two chunks of 384 rows and one of 32.
SHAPES = [(1, 32, 16), (5, 64, 40), (16, 256, 32), (17, 288, 48), (33, 1024, 200), (150, 512, 33), (0, 64, 16),
          (300, 96, 1000), (70, 8192, 40), (257, 544, 40), (273, 640, 48), (800, 1024, 72)]


def _gemm(x: torch.Tensor, packed: cpu_gemm.PackedWeight, bias: torch.Tensor | None, y_stride: int, threads: int,
          amx: bool) -> torch.Tensor:
    rows, k = x.shape
    y = torch.full((rows, y_stride), 7.0)
    _cpu.gemm_bf16_cpu(x.data_ptr(), packed.data.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                       rows, packed.out_features, k, x.stride(0), y_stride, threads, amx)
    return y


@pytest.mark.parametrize("rows,k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_amx_tiles_are_the_fp32_products_of_bf16_values(rows: int, k: int, n: int, bias: bool) -> None:
    """Exact bf16 products summed in fp32, in the tiles' order: the fp32 product of the bf16 values
    to fp32 rounding, and the pair tiles' result as closely; nothing written past n."""
    g = torch.Generator().manual_seed(rows * 31 + k + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    wide = torch.randn(rows, k + 40, generator=g).bfloat16()
    x = wide[:, 8:8 + k]  # rows read in place, k + 40 apart, not 64-byte aligned
    b = torch.randn(n, generator=g) if bias else None
    packed = cpu_gemm.prepack(w, "avx2")
    assert isinstance(packed, cpu_gemm.PackedWeight) and packed.pairs
    expected = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    amx = _gemm(x, packed, b, n + 3, 2, amx=True)
    pairs = _gemm(x, packed, b, n + 3, 2, amx=False)
    torch.testing.assert_close(amx[:, :n], expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(amx[:, :n], pairs[:, :n], rtol=1e-5, atol=1e-4)
    assert torch.equal(amx[:, n:], torch.full((rows, 3), 7.0))


@pytest.mark.parametrize("rows", [3, 16, 70])
def test_amx_gemm_is_the_same_on_any_number_of_threads(rows: int) -> None:
    """Threads split the panels at even ones (13 panels: the last alone), never a sum: the same bits
    on any team, and each row's bits whatever rows share its call."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(200, 320, generator=g).bfloat16(), torch.randn(rows, 320, generator=g).bfloat16()
    packed = cpu_gemm.prepack(w, "avx2")
    assert isinstance(packed, cpu_gemm.PackedWeight)
    outs = [_gemm(x, packed, None, 200, threads, amx=True) for threads in (1, 2, 3, 5)]
    assert all(torch.equal(outs[0], y) for y in outs[1:])
    alone = _gemm(x[rows // 2:rows // 2 + 1].contiguous(), packed, None, 200, 1, amx=True)
    assert torch.equal(alone[0], outs[0][rows // 2])


def test_a_depth_that_32_does_not_divide_takes_the_pair_tiles() -> None:
    """AMX tiles take 32 values of k at a time: a depth of 2 mod 32 runs on the pair tiles, the same
    bits as asking for them."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(48, 98, generator=g).bfloat16(), torch.randn(20, 98, generator=g).bfloat16()
    packed = cpu_gemm.prepack(w, "avx2")
    assert isinstance(packed, cpu_gemm.PackedWeight)
    assert torch.equal(_gemm(x, packed, None, 48, 2, amx=True), _gemm(x, packed, None, 48, 2, amx=False))


# Rounded to bf16 as the decoder stack's bf16 layers take their products: each panel pair rounded
# out of the thread's scratch on AMX tiles. SHAPES plus rows in several chunks (k 1024: 384 rows a
# chunk): 384 + 384 + 32 (full blocks), 384 + 21 (a last block of 5 rows); an output past 2 MB,
# whose whole lines are written past the caches (its 6-row last block too).
NARROWED_SHAPES = SHAPES + [(405, 1024, 16), (1030, 1024, 1056)]


@pytest.mark.parametrize("rows,k,n", NARROWED_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("amx", [True, False])
def test_bf16_output_is_the_fp32_product_rounded(rows: int, k: int, n: int, bias: bool, amx: bool) -> None:
    """gemm_bf16_narrowed: the fp32 product (bias included) rounded to nearest even, bit for bit, on
    either tiles; nothing written past the rows' n columns."""
    g = torch.Generator().manual_seed(rows * 7 + k + n)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    packed = cpu_gemm.prepack(w, "avx2")
    assert isinstance(packed, cpu_gemm.PackedWeight)
    expected = _gemm(x, packed, b, n, 2, amx=amx).bfloat16()
    out = torch.full((rows * n + 8,), 3.0, dtype=torch.bfloat16)
    y = torch.empty(rows, n)
    _cpu.gemm_bf16_cpu(x.data_ptr(), packed.data.data_ptr(), 0 if b is None else b.data_ptr(), y.data_ptr(), rows,
                       n, k, k, n, 2, amx, out.data_ptr())
    assert torch.equal(out[:rows * n].view(rows, n), expected)
    assert torch.equal(out[rows * n:], torch.full((8,), 3.0, dtype=torch.bfloat16))


def test_a_row_is_the_same_alone_and_in_a_batch_of_passes() -> None:
    """A 257-row batch takes the depth in passes, one row alone in one: the same bits."""
    g = torch.Generator().manual_seed(11)
    w, x = torch.randn(40, 544, generator=g).bfloat16(), torch.randn(257, 544, generator=g).bfloat16()
    packed = cpu_gemm.prepack(w, "avx2")
    batch = _gemm(x, packed, None, 40, 2, amx=True)
    for r in (0, 131, 256):
        assert torch.equal(_gemm(x[r:r + 1].contiguous(), packed, None, 40, 2, amx=True)[0], batch[r])


def test_bf16_output_rounds_subnormal_and_nan_sums_as_torch() -> None:
    """Outputs that are fp32 subnormals (which vcvtneps2bf16 reads as zero; here zero rows plus a
    subnormal bias: AMX tiles flush subnormal products themselves) rounded to bf16 as torch rounds
    the fp32 output, bit for bit; NaN stays NaN."""
    g = torch.Generator().manual_seed(12)
    w, x = torch.randn(48, 64, generator=g).bfloat16(), torch.randn(40, 64, generator=g).bfloat16()
    x[:20] = 0.0
    x[30, 5] = float("nan")
    bias = torch.randn(48, generator=g) * 1e-39  # fp32 subnormals with all their low bits
    packed = cpu_gemm.prepack(w, "avx2")
    y = torch.empty(40, 48)
    out = torch.empty(40, 48, dtype=torch.bfloat16)
    _cpu.gemm_bf16_cpu(x.data_ptr(), packed.data.data_ptr(), bias.data_ptr(), y.data_ptr(), 40, 48, 64, 64, 48, 2,
                       True, out.data_ptr())
    expected = _gemm(x, packed, bias, 48, 2, amx=True).bfloat16()
    assert torch.equal(expected[:20], bias.bfloat16().expand(20, 48)) and expected[30].isnan().all()
    assert (expected[:20] != 0).sum() > 500  # subnormals, rounded rather than flushed
    nan = expected.isnan()  # torch writes one NaN (0x7fc0); ours keep the sign and payload's top
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


# Quantized weights, bf16 activations (csrc/cpu_gemm_quant.cpp's panels_amx): (rows, k, n, group
# size). Groups of 32, 64, 128 and one per row; rows below a block, a block and one, two-block groups
# and a tail; n past the last full panel, an odd number of panels.
QUANT_SHAPES = [(1, 256, 16, 32), (15, 512, 40, 128), (16, 96, 17, 96), (17, 320, 48, 64), (33, 1024, 100, 128),
                (150, 288, 33, 32), (64, 768, 1000, 768)]


def _quant_fp32_out(x: torch.Tensor, p: cpu_kernel.PackedQuantWeight, bias: torch.Tensor | None, isa: str,
                    threads: int = 2) -> torch.Tensor:
    rows, k = x.shape
    y = torch.empty(rows, p.out_features)
    _cpu.quant_gemm_cpu(0, p.packed.data_ptr(), p.scales.data_ptr(), 0 if p.zeros is None else p.zeros.data_ptr(),
                        0 if bias is None else bias.data_ptr(), y.data_ptr(), rows, p.out_features, k, x.stride(0),
                        p.out_features, p.group_size, p.bits, p.zero_offset, cpu_kernel.ISA_CODES[isa], threads,
                        x.data_ptr(), False)
    return y


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantized_weights_on_amx_tiles_match_the_dequantized_product(bits: int, symmetric: bool) -> None:
    """The weights' integers are exact in bf16 and the tiles sum exact products in fp32, the scales and
    zero points applied per segment as on the vdpbf16ps path: both within fp32 rounding of the product
    of the bf16 activations with the dequantized weight, and of each other."""
    for i, (rows, k, n, group) in enumerate(QUANT_SHAPES):
        w = random_quantized(n, k, bits, group, symmetric, seed=i)
        g = torch.Generator().manual_seed(50 + i)
        x = torch.randn(rows, k + 24, generator=g).bfloat16()[:, 8:8 + k]  # rows k + 24 apart
        bias = torch.randn(n, generator=g) if i % 2 else None
        p = cpu_kernel.pack(w)
        expected = F.linear(x.double(), w.dequantize(torch.float64), None if bias is None else bias.double()).float()
        amx = _quant_fp32_out(x, p, bias, "amx")
        dots = _quant_fp32_out(x, p, bias, "avx512")
        scale = max(expected.abs().max().item(), 1.0)
        torch.testing.assert_close(amx, expected, rtol=1e-4, atol=1e-5 * scale)
        torch.testing.assert_close(amx, dots, rtol=1e-4, atol=1e-5 * scale)
        if rows >= 2:  # what "auto" takes from 2 rows
            assert torch.equal(_quant_fp32_out(x, p, bias, "auto"), amx)


def test_quantized_amx_path_is_the_same_on_any_number_of_threads() -> None:
    w = random_quantized(200, 512, 4, 128, False, seed=3)
    p = cpu_kernel.pack(w)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(4)).bfloat16()
    outs = [_quant_fp32_out(x, p, None, "amx", threads) for threads in (1, 2, 3)]
    assert all(torch.equal(outs[0], y) for y in outs[1:])
