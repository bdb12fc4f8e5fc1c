"""The fused C++ CPU layers (RMSNorm with residual add, q/k norm over strided heads, SiLU-and-mul)
against the layers' torch code, in fp32 and bf16, and the layers' fallback for what they do not take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovllm.layers import RMSNorm, SiluAndMul, cpu_ops

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_over_strided_head_views(dtype: torch.dtype) -> None:
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = qkv[:, :64].reshape(5, 4, 16)  # a view: rows 128 elements apart
    assert not q.is_contiguous() and cpu_ops.can_rms_norm(q, _norm(16, dtype).weight)
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
    assert not cpu_ops.can_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(SiluAndMul()(x), F.silu(gate) * up)
    norm = _norm(32, torch.float32)
    assert not cpu_ops.can_rms_norm(x, norm.weight)  # weight and input dtypes differ
    torch.testing.assert_close(norm(x), norm._norm(x))
    with pytest.raises(ValueError, match="unsupported"):
        cpu_ops.silu_and_mul(x)
