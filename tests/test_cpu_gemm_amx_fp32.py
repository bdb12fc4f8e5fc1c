"""The fp32 GEMM on AMX tiles (csrc/cpu_gemm_amx_fp32.cpp): fp32 values split into three bf16 pieces,
six piece products summed in fp32. Against a float64 product within fp32's rounding bound, against
the FMA tiles on the same packed weight, and for what must not change with it: thread splits, a
row's place in the batch, rows holding NaN or infinities, the row count where it starts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovllm import _cpu
from nanovllm.cpu import gemm as cpu_gemm

pytestmark = pytest.mark.skipif(not _cpu.has_amx_bf16(), reason="this process has no AMX tiles")

MIN_ROWS = _cpu.amx_fp32_min_rows()
U = 2.0 ** -24  # fp32's unit roundoff

# rows: the least that takes the tiles, a lone 16-row block and a short tail, several 128-row chunks
# (k = 2048: 1.5 MB of pieces a chunk); k: below one 32-deep step, odd, several 128-deep passes with a
# short last one; n: one partial panel, a lone last panel, columns past n in a pair.
SHAPES = [(MIN_ROWS, 32, 16), (MIN_ROWS, 7, 17), (MIN_ROWS + 1, 300, 33), (100, 544, 40), (257, 1000, 70),
          (300, 2048, 48), (97, 3072, 200)]


def _gemm(x: torch.Tensor, packed: cpu_gemm.PackedWeight, bias: torch.Tensor | None, y_stride: int, threads: int,
          amx: bool) -> torch.Tensor:
    rows, k = x.shape
    y = torch.full((rows, y_stride), 7.0)
    _cpu.gemm_cpu(x.data_ptr(), packed.data.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), rows,
                  packed.out_features, k, x.stride(0), y_stride, 0, threads, True, amx)
    return y


def _packed(w: torch.Tensor) -> cpu_gemm.PackedWeight:
    packed = cpu_gemm.prepack(w, "avx2")
    assert isinstance(packed, cpu_gemm.PackedWeight) and packed.pairs
    return packed


@pytest.mark.parametrize("rows,k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_on_amx_tiles_is_within_fp32_rounding_of_the_exact_product(rows: int, k: int, n: int, bias: bool) -> None:
    """Each output within (k + 8) fp32 roundings of the sum of its products' magnitudes, the bound an
    fp32 sum of k products meets plus the pieces left out (~2^-21 at most); a bf16 product, or any one
    piece product missing, errs by 2^-9 or more of it. Nothing written past n."""
    g = torch.Generator().manual_seed(rows * 31 + k + n)
    w = torch.randn(n, k, generator=g)
    wide = torch.randn(rows, k + 40, generator=g)
    x = wide[:, 8:8 + k]  # rows read in place, k + 40 apart, not 64-byte aligned
    b = torch.randn(n, generator=g) if bias else None
    packed = _packed(w)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    magnitude = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    amx = _gemm(x, packed, b, n + 3, 2, amx=True)
    fma = _gemm(x, packed, b, n + 3, 2, amx=False)
    assert ((amx[:, :n].double() - exact).abs() <= (k + 8) * U * magnitude).all()
    assert ((fma[:, :n].double() - exact).abs() <= (k + 8) * U * magnitude).all()
    assert torch.equal(amx[:, n:], torch.full((rows, 3), 7.0))


def test_the_tiles_take_rows_from_amx_fp32_min_rows() -> None:
    """Below the threshold the FMA tiles' bits; at it another summation (the tiles')."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 1024, generator=g)
    packed = _packed(w)
    x = torch.randn(MIN_ROWS, 1024, generator=g)
    below = x[:MIN_ROWS - 1]
    assert torch.equal(_gemm(below, packed, None, 64, 2, amx=True), _gemm(below, packed, None, 64, 2, amx=False))
    assert not torch.equal(_gemm(x, packed, None, 64, 2, amx=True), _gemm(x, packed, None, 64, 2, amx=False))


def test_fp32_amx_gemm_is_the_same_on_any_number_of_threads() -> None:
    """Threads split the panels at even ones (13 panels: the last alone), never a sum."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(200, 640, generator=g)
    x = torch.randn(150, 640, generator=g)
    packed = _packed(w)
    outs = [_gemm(x, packed, None, 200, threads, amx=True) for threads in (1, 2, 3, 5)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_a_row_is_the_same_wherever_it_lies_in_the_batch() -> None:
    """A row's pieces and products do not depend on its block, chunk or the rows beside it (at 2048
    deep a chunk is 128 rows: row 200 lies in the second chunk of one batch, the first of the other)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 2048, generator=g)
    x = torch.randn(300, 2048, generator=g)
    packed = _packed(w)
    whole = _gemm(x, packed, None, 48, 2, amx=True)
    tail = _gemm(x[150:].contiguous(), packed, None, 48, 2, amx=True)
    assert torch.equal(whole[150:], tail)


def test_rows_the_pieces_cannot_hold_take_the_fma_tiles() -> None:
    """A row holding NaN, an infinity or a value that rounds past bf16's largest (3.4e38 < fp32's)
    gives the FMA tiles' bits (an infinity times a zero piece would be NaN where fp32 gives the
    infinity; 3.4e38 as bf16 is infinite); the other rows the same bits as without it."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 256, generator=g).bfloat16().float()  # bf16 values: their lower pieces are zero
    x = torch.randn(MIN_ROWS + 8, 256, generator=g)
    packed = _packed(w)
    clean = _gemm(x, packed, None, 40, 2, amx=True)
    bad = x.clone()
    bad[3, 17] = float("nan")
    bad[9, 100] = float("inf")
    bad[20, 0] = -float("inf")
    bad[30, 5] = 3.4e38
    bad[31] = 0.0
    bad[31, 7] = 3.4e38
    out = _gemm(bad, packed, None, 40, 2, amx=True)
    fma = _gemm(bad, packed, None, 40, 2, amx=False)
    special = (3, 9, 20, 30, 31)
    for row in special:
        torch.testing.assert_close(out[row], fma[row], rtol=0, atol=0, equal_nan=True)
    assert out[3].isnan().all() and out[9].isinf().all() and out[31][w[:, 7].abs() < 1].isfinite().all()
    keep = [r for r in range(x.shape[0]) if r not in special]
    assert torch.equal(out[keep], clean[keep])


def test_a_panel_pair_with_an_infinite_weight_takes_the_fma_tiles() -> None:
    """Infinite weights in one column: its panel pair's outputs are the FMA tiles' (infinities, not the
    NaN of an infinity times zero pieces), the other pairs' the tiles' own."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(96, 300, generator=g)
    x = torch.randn(MIN_ROWS + 20, 300, generator=g).abs()
    clean = _gemm(x, _packed(w), None, 96, 2, amx=True)
    w[40, 200] = float("inf")  # column 40: panel 2, the pair of panels 2 and 3 (columns 32-63)
    packed = _packed(w)
    out = _gemm(x, packed, None, 96, 2, amx=True)
    fma = _gemm(x, packed, None, 96, 2, amx=False)
    assert torch.equal(out[:, 32:64], fma[:, 32:64])
    assert out[:, 40].isposinf().all()
    assert torch.equal(out[:, :32], clean[:, :32]) and torch.equal(out[:, 64:], clean[:, 64:])


def test_subnormal_weights_count_as_zero_and_leave_their_neighbours_alone() -> None:
    """The tiles read bf16 subnormals as zero: a subnormal weight (or what is left of a tiny one) adds
    nothing, and the weight packed beside it in a k pair keeps its value."""
    g = torch.Generator().manual_seed(9)
    rows, k, n = MIN_ROWS, 512, 64
    w = torch.randn(n, k, generator=g)
    w[:, 1::2] = torch.where(torch.rand(n, k // 2, generator=g) < 0.5, torch.tensor(1e-39), w[:, 1::2])
    x = torch.randn(rows, k, generator=g)
    exact = F.linear(x.double(), w.double())
    magnitude = F.linear(x.double().abs(), w.double().abs())
    out = _gemm(x, _packed(w), None, n, 2, amx=True)
    assert ((out.double() - exact).abs() <= (k + 8) * U * magnitude + 1e-36).all()
