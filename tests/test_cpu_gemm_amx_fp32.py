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


def test_nan_and_infinite_inputs_stay_in_their_rows() -> None:
    """A row holding NaN or an infinity gives non-finite outputs (no value of it is dropped as a
    piece's remainder), and the other rows the same bits as without it."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 256, generator=g)
    x = torch.randn(MIN_ROWS + 8, 256, generator=g)
    packed = _packed(w)
    clean = _gemm(x, packed, None, 40, 2, amx=True)
    bad = x.clone()
    bad[3, 17] = float("nan")
    bad[9, 100] = float("inf")
    bad[20, 0] = -float("inf")
    out = _gemm(bad, packed, None, 40, 2, amx=True)
    for row in (3, 9, 20):
        assert not out[row].isfinite().any()
    assert out[3].isnan().all()
    keep = [r for r in range(x.shape[0]) if r not in (3, 9, 20)]
    assert torch.equal(out[keep], clean[keep])
