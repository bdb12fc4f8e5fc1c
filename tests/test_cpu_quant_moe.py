"""int8 / int4 experts of a mixture-of-experts layer in one C++ call on the CPU
(nanovllm/layers/quantization/cpu_moe.py): against the per-token float64 reference on the
dequantized weights, on random shapes (tests/moe_cases.py) and formats (int8 and int4, per channel
and in groups that divide neither size, with and without zero points, the gate/up and down weights
in different bit widths), bf16 activations on both GEMM inputs, experts nobody chose never read,
the same output on any number of threads, and bad input."""

from __future__ import annotations

import pytest
import torch
from moe_cases import CASES, Case, case_id, make_weights, per_token_reference

from nanovllm import _cpu
from nanovllm.layers.quantization import cpu_kernel, cpu_moe
from nanovllm.layers.quantization.weights import QuantizedWeight, signed_range

BF16_ROWS = pytest.mark.skipif(not cpu_kernel.HAS_BF16, reason="the CPU lacks AVX512-BF16")


def random_weight(n: int, k: int, bits: int, group: int | None, zeros: bool, g: torch.Generator) -> QuantizedWeight:
    """Random values, scales and zero points (groups may end short of k)."""
    gs = k if group is None else min(group, k)
    groups = -(-k // gs)
    lo, hi = signed_range(bits)
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, groups, generator=g) + 0.5) / (k ** 0.5 * (hi - lo) / 4)
    z = torch.randint(lo // 2, hi // 2 + 1, (n, groups), generator=g, dtype=torch.int8) if zeros else None
    return QuantizedWeight(q, scales, z, bits, gs)


# (w13 bits, w13 group, w2 bits, w2 group, zero points)
FORMATS = {
    "int8-channel": (8, None, 8, None, True),
    "int4-g16-sym": (4, 16, 4, 16, False),
    "int4-g32-asym": (4, 32, 4, 32, True),
    "int8-g24/int4-g8": (8, 24, 4, 8, True),
    "int4-odd-group": (4, 7, 4, 7, True),  # odd groups: cpu_kernel.pack stores the int4 values a byte each
}


def quantized_experts(c: Case, fmt: str, seed: int) -> tuple[list[QuantizedWeight], list[QuantizedWeight]]:
    bits13, group13, bits2, group2, zeros = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    w13 = [random_weight(2 * c.inter, c.hidden, bits13, group13, zeros, g) for _ in range(c.experts)]
    w2 = [random_weight(c.hidden, c.inter, bits2, group2, zeros, g) for _ in range(c.experts)]
    return w13, w2


def dense(ws: list[QuantizedWeight]) -> torch.Tensor:
    return torch.stack([w.dequantize() for w in ws])


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_per_token_reference(case: Case, fmt: str) -> None:
    x, logits, _, _ = make_weights(case, seed=case.experts * 10 + case.rows)
    w13, w2 = quantized_experts(case, fmt, seed=case.rows + 3)
    packed = cpu_moe.pack_experts(w13, w2)
    got = cpu_moe.fused_experts(x, logits, packed, case.top_k, case.renormalize)
    ref = per_token_reference(x, logits, dense(w13), dense(w2), case.top_k, case.renormalize)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bf16_rows", [False, pytest.param(True, marks=BF16_ROWS)])
@pytest.mark.parametrize("fmt", ["int8-channel", "int4-g32-asym", "int8-g24/int4-g8"])
@pytest.mark.parametrize("case", [Case(16, 4, 40, 136, 48, False), Case(32, 4, 1, 1030, 50, False),
                                  Case(8, 2, 33, 64, 20, True), Case(8, 2, 21, 64, 17, True)], ids=case_id)
def test_bf16_activations_within_bf16_rounding(case: Case, fmt: str, bf16_rows: bool) -> None:
    """bf16 activations, on fp32 rows or on the AVX512-BF16 dot products: within bf16 rounding of the
    fp32 result (the layer rounds where torch's bf16 layers do: the gate/up output, SiLU-and-mul, each
    expert's output). An odd intermediate size: the down GEMM's bf16 rows end in a zero pad column."""
    x, logits, _, _ = make_weights(case, seed=11)
    x = x.bfloat16()
    w13, w2 = quantized_experts(case, fmt, seed=12)
    got = cpu_moe.fused_experts(x, logits, cpu_moe.pack_experts(w13, w2), case.top_k, case.renormalize,
                                bf16_rows=bf16_rows)
    assert got.dtype == torch.bfloat16
    ref = per_token_reference(x, logits, dense(w13), dense(w2), case.top_k, case.renormalize)
    assert (got.double() - ref).abs().max() < 0.02 * ref.abs().max()


@pytest.mark.skipif(not cpu_kernel.HAS_AMX, reason="the CPU lacks AMX tiles")
def test_int8_experts_keep_a_tokens_bits_in_any_batch() -> None:
    """int8 experts whose shapes AMX int8 tiles take (hidden, intermediate and groups multiples of
    64), bf16 activations on an AMX CPU: a token's output is the same bits alone (one row per chosen
    expert, handed over as bf16 as the dense layers' one row) and in a batch (cpu_kernel.bf16_min_rows)."""
    g = torch.Generator().manual_seed(5)
    experts, top_k, hidden, inter = 8, 2, 256, 128
    w13 = [random_weight(2 * inter, hidden, 8, None, True, g) for _ in range(experts)]
    w2 = [random_weight(hidden, inter, 8, 64, False, g) for _ in range(experts)]
    packed = cpu_moe.pack_experts(w13, w2)
    x = torch.randn(8, hidden, generator=g).bfloat16()
    logits = torch.randn(8, experts, generator=g)
    batch = cpu_moe.fused_experts(x, logits, packed, top_k, True)
    for t in range(8):
        assert torch.equal(cpu_moe.fused_experts(x[t:t + 1], logits[t:t + 1], packed, top_k, True), batch[t:t + 1]), t


def test_other_dtypes_run_in_fp32() -> None:
    c = Case(8, 2, 6, 32, 16, True)
    x, logits, _, _ = make_weights(c, seed=13)
    w13, w2 = quantized_experts(c, "int4-g16-sym", seed=14)
    packed = cpu_moe.pack_experts(w13, w2)
    got = cpu_moe.fused_experts(x.half(), logits, packed, c.top_k, True)
    assert got.dtype == torch.float16
    ref = per_token_reference(x.half().float(), logits, dense(w13), dense(w2), c.top_k, True)
    torch.testing.assert_close(got.double(), ref, rtol=2e-3, atol=2e-3)  # fp16's rounding of the output


def test_experts_nobody_chose_are_never_read() -> None:
    """NaN scales in every expert no row chose: the output stays finite and equal to the clean one."""
    c = Case(32, 2, 3, 64, 32, True)
    x, logits, _, _ = make_weights(c, seed=6)
    w13, w2 = quantized_experts(c, "int4-g32-asym", seed=7)
    clean = cpu_moe.fused_experts(x, logits, cpu_moe.pack_experts(w13, w2), c.top_k, True)
    chosen = set(torch.topk(logits, c.top_k).indices.flatten().tolist())
    assert len(chosen) <= 6 < c.experts
    packed = cpu_moe.pack_experts(w13, w2)
    for e in set(range(c.experts)) - chosen:
        packed.w13.scales[e] = float("nan")
        packed.w2.scales[e] = float("nan")
    assert torch.equal(cpu_moe.fused_experts(x, logits, packed, c.top_k, True), clean)


@pytest.mark.parametrize("bf16_rows", [False, pytest.param(True, marks=BF16_ROWS)])
@pytest.mark.parametrize("case,hot", [(Case(32, 4, 8, 264, 40, True), False), (Case(16, 4, 37, 136, 40, True), False),
                                      (Case(32, 4, 300, 264, 40, True), False), (Case(32, 1, 300, 264, 40, True), True)],
                         ids=["decode", "small", "even", "hot"])
def test_the_same_on_any_number_of_threads(bf16_rows: bool, case: Case, hot: bool) -> None:
    """A decode step's or an evenly routed prefill's experts go whole to the threads (one thread takes
    them all; two and three get shares of even cost); with one hot expert (every row past the first
    three choosing expert 5 alone) two and three threads split each expert's panels instead: the same
    bits every way. (A row's bits may differ with how many rows its experts take in the call: one row
    has its own kernel.)"""
    c = case
    x, logits, _, _ = make_weights(c, seed=9)
    x = x.bfloat16() if bf16_rows else x
    if hot:
        logits[3:, 5] += 100.0
    packed = cpu_moe.pack_experts(*quantized_experts(c, "int4-g32-asym", seed=10))
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu_moe.fused_experts(x, logits, packed, c.top_k, True, bf16_rows=bf16_rows))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_formats_that_cannot_be_fused_and_bad_input() -> None:
    c = Case(4, 2, 5, 32, 16, True)
    x, logits, _, _ = make_weights(c, seed=1)
    w13, w2 = quantized_experts(c, "int8-channel", seed=2)
    permuted = QuantizedWeight(w2[0].qweight, w2[0].scales, w2[0].zeros, 8, w2[0].group_size,
                               perm=torch.randperm(c.inter))
    assert cpu_moe.can_pack(w13, w2)
    assert not cpu_moe.can_pack(w13, [permuted, *w2[1:]])  # GPTQ's activation order: each expert its own
    other = quantized_experts(c, "int4-g16-sym", seed=3)[1]
    assert not cpu_moe.can_pack(w13, [other[0], *w2[1:]])  # experts in different formats
    with pytest.raises(ValueError, match="cannot be fused"):
        cpu_moe.pack_experts(w13, [permuted, *w2[1:]])
    packed = cpu_moe.pack_experts(w13, w2)
    with pytest.raises(ValueError, match="the experts take 32 features and 4 logits"):
        cpu_moe.fused_experts(x[:, :16], logits, packed, c.top_k, True)
    with pytest.raises(ValueError, match="top_k"):
        cpu_moe.fused_experts(x, logits, packed, 5, True)
    w = packed.w13
    with pytest.raises(ValueError, match="w13: .* packed bytes"):  # one expert's bytes short
        _cpu.moe_quant_experts_cpu(x.data_ptr(), 32, logits.float().data_ptr(), 4, 5, 32, 16, 4, 2, True,
                                   x.data_ptr(), 32, 0, False, w.packed.data_ptr(), w.packed.numel() - 1,
                                   w.scales.data_ptr(), w.scales.numel(), w.zeros.data_ptr(), w.zeros.numel(),
                                   w.group_size, w.bits, w.zero_offset, packed.w2.packed.data_ptr(),
                                   packed.w2.packed.numel(), packed.w2.scales.data_ptr(), packed.w2.scales.numel(),
                                   packed.w2.zeros.data_ptr(), packed.w2.zeros.numel(), packed.w2.group_size,
                                   packed.w2.bits, packed.w2.zero_offset)
    with pytest.raises(ValueError, match="w2: 0 zero points, expected"):  # a zero-point pointer without its size
        _cpu.moe_quant_experts_cpu(x.data_ptr(), 32, logits.float().data_ptr(), 4, 5, 32, 16, 4, 2, True,
                                   x.data_ptr(), 32, 0, False, w.packed.data_ptr(), w.packed.numel(),
                                   w.scales.data_ptr(), w.scales.numel(), w.zeros.data_ptr(), w.zeros.numel(),
                                   w.group_size, w.bits, w.zero_offset, packed.w2.packed.data_ptr(),
                                   packed.w2.packed.numel(), packed.w2.scales.data_ptr(), packed.w2.scales.numel(),
                                   packed.w2.zeros.data_ptr(), 0, packed.w2.group_size, packed.w2.bits,
                                   packed.w2.zero_offset)
