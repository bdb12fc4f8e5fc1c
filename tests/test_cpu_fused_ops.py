"""The fused C++ CPU layers (RMSNorm with residual add, q/k norm over strided heads, SiLU-and-mul,
rotary embedding in place) against the layers' torch code, in fp32 and bf16, and the layers'
fallback for what they do not take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovllm.cpu import fused_ops
from nanovllm.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from nanovllm.model_config import RopeConfig

# fp32: only the summation order differs. bf16: both round the same ops to bf16, so at most the
# rare value whose fp32 intermediate lands on the other side of a rounding boundary differs, by one
# bf16 step (2^-8 relative).
TOL = {torch.float32: {"rtol": 1e-6, "atol": 1e-6}, torch.bfloat16: {"rtol": 2 ** -7, "atol": 1e-3}}


def _norm(hidden: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 256 elements: split over threads
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    norm = _norm(256, dtype)
    x = (3 * torch.randn(rows, 256, generator=g)).to(dtype)
    residual = torch.randn(rows, 256, generator=g).to(dtype)
    inputs = (x.clone(), residual.clone())
    torch.testing.assert_close(norm(x), norm._norm(x), **TOL[dtype])
    out, res = norm(x, residual)
    assert torch.equal(res, x + residual)  # the add is one rounding on both sides: exact
    torch.testing.assert_close(out, norm._norm(x + residual), **TOL[dtype])
    assert out.dtype == dtype and torch.equal(x, inputs[0]) and torch.equal(residual, inputs[1])


def test_bf16_residual_sum_keeps_subnormals_ties_and_overflow_as_torch_rounds_them() -> None:
    """The residual add rounded to bf16 bit for bit as torch rounds it, where the AVX512-BF16
    conversion would read a subnormal sum as zero: subnormal sums, ties to even (down and up), a
    sum that rounds up to infinity, infinities; NaN stays NaN."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 48, generator=g).bfloat16()
    residual = torch.randn(3, 48, generator=g).bfloat16()
    tiny = torch.tensor([1e-39, -3e-39, 5e-40, 1.1e-38], dtype=torch.bfloat16)  # bf16 subnormals
    x[0, :4], residual[0, :4] = tiny, tiny * 0.5
    big = torch.finfo(torch.bfloat16).max  # (2 - 2^-7) 2^127; + 2^119 is the tie with 2^128: inf
    x[1, :6] = torch.tensor([1.0, 1.0078125, big, float("inf"), -float("inf"), float("nan")], dtype=torch.bfloat16)
    residual[1, :6] = torch.tensor([2 ** -8, 2 ** -8, 2.0 ** 119, 1.0, -1.0, 1.0], dtype=torch.bfloat16)
    norm = _norm(48, torch.bfloat16)
    _, res = norm(x, residual)
    expected = x + residual
    assert expected[1, 0] == 1.0 and expected[1, 1] == 1.015625 and expected[1, 2].isinf()  # the cases hold
    nan = expected.isnan()
    assert torch.equal(res.isnan(), nan)
    assert torch.equal(res.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_over_strided_head_views(dtype: torch.dtype) -> None:
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = qkv[:, :64].reshape(5, 4, 16)  # a view: rows 128 elements apart
    assert not q.is_contiguous() and fused_ops.can_rms_norm(q, _norm(16, dtype).weight)
    norm = _norm(16, dtype, seed=2)
    torch.testing.assert_close(norm(q), norm._norm(q), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9, 200])
def test_silu_and_mul(dtype: torch.dtype, rows: int) -> None:
    fused = 4 * torch.randn(rows, 2 * 384, generator=torch.Generator().manual_seed(rows)).to(dtype)
    for x in (fused, fused[:, :-2][:, :2 * 383]):  # contiguous, and rows further apart than 2 * inner
        gate, up = x.chunk(2, dim=-1)
        torch.testing.assert_close(SiluAndMul()(x), F.silu(gate) * up, **TOL[dtype])


def test_layers_fall_back_to_torch_for_what_the_kernels_do_not_take() -> None:
    x = torch.randn(4, 32, dtype=torch.float64)
    assert not fused_ops.can_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(SiluAndMul()(x), F.silu(gate) * up)
    norm = _norm(32, torch.float32)
    assert not fused_ops.can_rms_norm(x, norm.weight)  # weight and input dtypes differ
    torch.testing.assert_close(norm(x), norm._norm(x))
    with pytest.raises(ValueError, match="unsupported"):
        fused_ops.silu_and_mul(x)
    # the layers' entry points: None (the torch code runs), never an error
    assert fused_ops.try_silu_and_mul(x) is None and fused_ops.try_rms_norm(x, norm.weight, 1e-6) is None
    q = torch.randn(3, 4, 16)
    assert not fused_ops.try_rotary_(torch.arange(3, dtype=torch.int32), q, q[:, :2].clone(), torch.ones(7))


@pytest.mark.parametrize("hidden", [8, 40, 100])  # the 16-lane loops' masked tails
def test_bf16_rms_norm_rotary_and_silu_on_widths_16_does_not_divide(hidden: int) -> None:
    g = torch.Generator().manual_seed(hidden)
    norm = _norm(hidden, torch.bfloat16)
    x, residual = torch.randn(9, hidden, generator=g).bfloat16(), torch.randn(9, hidden, generator=g).bfloat16()
    out, res = norm(x, residual)
    assert torch.equal(res, x + residual)
    torch.testing.assert_close(out, norm._norm(x + residual), **TOL[torch.bfloat16])
    fused = 4 * torch.randn(9, 2 * hidden, generator=g).bfloat16()
    gate, up = fused.chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMul()(fused), F.silu(gate) * up, **TOL[torch.bfloat16])
    head_dim = hidden // 4 * 2  # halves of 2, 10, 25
    layer = RotaryEmbedding(head_dim, RopeConfig())
    q, k = torch.randn(9, 3, head_dim, generator=g).bfloat16(), torch.randn(9, 1, head_dim, generator=g).bfloat16()
    positions = torch.randint(0, 4000, (9,), dtype=torch.int32, generator=g)
    expected = layer(positions.long(), q.clone(), k.clone())
    for ours, ref in zip(layer(positions, q, k), expected):
        torch.testing.assert_close(ours, ref, **TOL[torch.bfloat16])


LLAMA3 = RopeConfig(theta=500000.0, rope_type="llama3", scaling={
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [RopeConfig(), LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize("tokens", [1, 70])
def test_rotary_in_place_on_qkv_views(dtype: torch.dtype, rope: RopeConfig, tokens: int) -> None:
    layer = RotaryEmbedding(64, rope)
    qkv = 3 * torch.randn(tokens, (8 + 2 + 2) * 64, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    q, k = qkv[:, :512].reshape(tokens, 8, 64), qkv[:, 512:640].reshape(tokens, 2, 64)
    positions = torch.randint(0, 40000, (tokens,), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    assert fused_ops.can_rotary(positions, q, k) and not fused_ops.can_rotary(positions.long(), q, k)
    expected = layer(positions.long(), q.clone(), k.clone())  # int64 positions: the torch code
    v_before = qkv[:, 640:].clone()
    got = layer(positions, q, k)
    assert got[0].data_ptr() == q.data_ptr() and got[1].data_ptr() == k.data_ptr()  # rotated in place
    # fp32: cos/sin from libm against torch's vectorized ones, a last-bit difference at most;
    # bf16: cos, sin and every product rounded to bf16 as torch rounds them.
    for ours, ref in zip(got, expected):
        torch.testing.assert_close(ours, ref, **TOL[dtype])
    assert torch.equal(qkv[:, 640:], v_before)  # v untouched


def test_rotary_rejects_what_it_cannot_take() -> None:
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    positions = torch.arange(3, dtype=torch.int32)
    assert not fused_ops.can_rotary(positions, q.double(), k.double())
    assert not fused_ops.can_rotary(positions, q.transpose(0, 1).contiguous().transpose(0, 1), k)
    with pytest.raises(ValueError, match="unsupported"):
        fused_ops.rotary_(positions, q, k, torch.ones(7))  # inv_freq of the wrong size
