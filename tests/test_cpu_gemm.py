"""CPU GEMMs on prepacked weights (nanovllm/cpu/gemm.py), both kernels: ours (`gemm_cpu` with
AVX2 tiles or AVX-512 pair tiles, `gemm_bf16_cpu` with AVX512-BF16 pair tiles) and oneDNN's. The same products as `F.linear` up to summation order (register tiles, cache blocks
and panels cut anywhere: ragged rows, columns and depths), the dense weight released (a tied LM
head packs a copy, the embedding keeps its own); bad sizes are errors; and an engine whose layers
are prepacked still matches transformers token for token. Also: the CPU kernels share torch's
OpenMP runtime (one libgomp in the process), so they never add threads of their own."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import assert_greedy_matches, random_prompts

from nanovllm import LLM, SamplingParams, _cpu
from nanovllm.builtin_model import BUILTIN_SPEC, create_model_dir
from nanovllm.cpu import features as cpu_features
from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.cpu import huge_pages
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear


def _filled(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return layer


KERNELS = [
    pytest.param("avx2", marks=pytest.mark.skipif(not _cpu.has_avx2_fma(), reason="the CPU lacks AVX2 + FMA")),
    pytest.param("onednn", marks=pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows,k,n", [
    (1, 64, 16), (5, 600, 40), (7, 256, 1000), (13, 1000, 48), (150, 300, 33), (0, 64, 16),
])  # rows: 6-row tiles and 144-row blocks, k: 256-deep slices, n: 16-column panels, each cut ragged
@pytest.mark.parametrize("bias", [False, True])
def test_packed_gemm_matches_f_linear(kernel: cpu_features.GemmKernel, rows: int, k: int, n: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = cpu_gemm.prepack(w, kernel)
    assert isinstance(packed, cpu_gemm.PackedWeight) == (kernel == "avx2")
    torch.testing.assert_close(cpu_gemm.linear(x, packed, b), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    # Rows of a wider tensor (read in place), and a row broadcast over the batch (stride 0: copied).
    wide = torch.randn(rows, k + 5, generator=g)[:, 3:3 + k]
    torch.testing.assert_close(cpu_gemm.linear(wide, packed, b), F.linear(wide, w, b), rtol=1e-4, atol=1e-4)
    same = x[:1].expand(rows, k)
    torch.testing.assert_close(cpu_gemm.linear(same, packed, b), F.linear(same, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not _cpu.has_avx2_fma(), reason="the CPU lacks AVX2 + FMA")
def test_avx2_gemm_keeps_bf16_weights_bf16() -> None:
    """A bf16 weight is packed as bf16 (half an fp32 copy) and widened exactly: the product equals
    the fp32 product with the widened weight, rounded to the activations' dtype."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(70, 520, generator=g).to(torch.bfloat16)
    x = torch.randn(9, 520, generator=g)
    packed = cpu_gemm.prepack(w, "avx2")
    assert isinstance(packed, cpu_gemm.PackedWeight) and packed.data.dtype == torch.bfloat16
    assert packed.data.numel() == _cpu.gemm_packed_elements(70, 520) == 5 * 16 * 520
    assert packed.pairs == _cpu.has_avx512_bf16()
    # The pair tiles multiply bf16 by bf16: fp32 rows are rounded to bf16 first.
    rows = x.to(torch.bfloat16).float() if packed.pairs else x
    torch.testing.assert_close(cpu_gemm.linear(x, packed, None), F.linear(rows, w.float()), rtol=1e-5, atol=1e-5)
    y = cpu_gemm.linear(x.to(torch.bfloat16), packed, None)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, F.linear(x.to(torch.bfloat16).float(), w.float()).to(torch.bfloat16))


RAGGED = [(1, 64, 16), (5, 600, 40), (7, 256, 1000), (13, 1000, 48), (150, 300, 33), (0, 64, 16), (25, 2, 17)]


@pytest.mark.skipif(not _cpu.has_avx2_fma(), reason="the CPU lacks AVX2 + FMA")
@pytest.mark.parametrize("rows,k,n", RAGGED)  # 6- and 12-row tiles, 144-row blocks, 256-deep slices, cut ragged
def test_fp32_tiles_of_either_layout_match_f_linear(rows: int, k: int, n: int) -> None:
    """An fp32 weight packed in panel pairs takes the AVX-512 tiles (12 x 32, where the CPU has
    AVX-512F), packed without them the AVX2 tiles (6 x 16): both are F.linear."""
    g = torch.Generator().manual_seed(rows + k + n)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(rows, k + 3, generator=g)[:, 1:1 + k], torch.randn(n, generator=g)
    y = torch.full((rows, n + 2), 7.0)
    for pairs in (False, True) if _cpu.has_avx512f() else (False,):
        packed = torch.empty(_cpu.gemm_packed_elements(n, k))
        _cpu.gemm_pack_cpu(w.data_ptr(), 0, n, k, k, packed.data_ptr(), pairs)
        y.fill_(7.0)
        _cpu.gemm_cpu(x.data_ptr(), packed.data_ptr(), b.data_ptr(), y.data_ptr(), rows, n, k, k + 3, n + 2, 0, 2, pairs)
        torch.testing.assert_close(y[:, :n], F.linear(x, w, b), rtol=1e-4, atol=1e-4)
        assert torch.equal(y[:, n:], torch.full((rows, 2), 7.0))  # nothing written past n
    assert cpu_gemm.can_pair(w) == _cpu.has_avx512f()
    bf16 = torch.empty(_cpu.gemm_packed_elements(n, k), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pairs need fp32 weights"):  # bf16 pairs are gemm_bf16_cpu's
        _cpu.gemm_cpu(x.data_ptr(), bf16.data_ptr(), 0, y.data_ptr(), rows, n, k, k + 3, n + 2, 1, 1, True)


@pytest.mark.skipif(not _cpu.has_avx512_bf16(), reason="the CPU lacks AVX512-BF16")
@pytest.mark.parametrize("rows,k,n", [(r, k + k % 2, n) for r, k, n in RAGGED])  # the pairs need k even
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_pair_tiles_match_the_fp32_product_of_bf16_values(rows: int, k: int, n: int, bias: bool) -> None:
    """Pair-packed bf16 weights times bf16 rows: exact products summed in fp32, rounded to bf16."""
    g = torch.Generator().manual_seed(rows * 7 + k + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    packed = cpu_gemm.prepack(w, "avx2")
    assert isinstance(packed, cpu_gemm.PackedWeight) and packed.pairs
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    y = cpu_gemm.linear(x, packed, b)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected.to(torch.bfloat16))
    padded = torch.full((rows, n + 2), 7.0)  # nothing written past n (the masked stores of the last panel)
    _cpu.gemm_bf16_cpu(x.data_ptr(), packed.data.data_ptr(), 0, padded.data_ptr(), rows, n, k, k, n + 2, 2)
    torch.testing.assert_close(padded[:, :n], F.linear(x.float(), w.float()))
    assert torch.equal(padded[:, n:], torch.full((rows, 2), 7.0))
    wide = torch.randn(rows, k + 6, generator=g).to(torch.bfloat16)[:, 3:3 + k]  # rows read in place
    torch.testing.assert_close(cpu_gemm.linear(wide, packed, b).float(),
                               F.linear(wide.float(), w.float(), None if b is None else b.float()),
                               rtol=2 ** -7, atol=2e-2)


@pytest.mark.skipif(not _cpu.has_avx512_bf16(), reason="the CPU lacks AVX512-BF16")
def test_bf16_pair_gemm_rejects_bad_sizes() -> None:
    w = torch.randn(32, 64).to(torch.bfloat16)
    packed = cpu_gemm.prepack(w, "avx2")
    x, y = torch.randn(4, 64).to(torch.bfloat16), torch.empty(4, 32)
    with pytest.raises(ValueError, match="k even"):
        _cpu.gemm_bf16_cpu(x.data_ptr(), packed.data.data_ptr(), 0, y.data_ptr(), 4, 32, 63, 64, 32)
    with pytest.raises(ValueError, match="bad sizes"):
        _cpu.gemm_bf16_cpu(x.data_ptr(), packed.data.data_ptr(), 0, y.data_ptr(), 4, 32, 64, 62, 32)
    with pytest.raises(ValueError, match="null pointer"):
        _cpu.gemm_bf16_cpu(0, packed.data.data_ptr(), 0, y.data_ptr(), 4, 32, 64, 64, 32)
    w_odd, x_odd = torch.randn(32, 63).to(torch.bfloat16), torch.randn(3, 63).to(torch.bfloat16)
    odd = cpu_gemm.prepack(w_odd, "avx2")
    assert isinstance(odd, cpu_gemm.PackedWeight) and not odd.pairs  # an odd depth: widened in registers
    torch.testing.assert_close(cpu_gemm.linear(x_odd, odd, None), F.linear(x_odd.float(), w_odd.float()).to(torch.bfloat16))


def test_layer_kernel_gives_large_native_bf16_weights_to_onednn() -> None:
    """Ours for fp32 and small bf16 weights wherever AVX2 + FMA exist; oneDNN for large bf16 ones
    where the CPU computes bf16 natively (its bf16 GEMM prefilled faster than our pair tiles)."""
    big, small = cpu_gemm.PREPACK_MIN_WEIGHTS, cpu_gemm.PREPACK_MIN_WEIGHTS // 2
    ours = "avx2" if _cpu.has_avx2_fma() else "onednn"
    assert cpu_gemm.layer_kernel(torch.empty(big // 256, 256)) == ours
    assert cpu_gemm.layer_kernel(torch.empty(small // 256, 256, dtype=torch.bfloat16)) == ours
    vector_bf16 = cpu_features.native_bf16() and torch.backends.mkldnn.is_available() and not _cpu.has_amx_bf16()
    assert cpu_gemm.layer_kernel(torch.empty(big // 256, 256, dtype=torch.bfloat16)) == ("onednn" if vector_bf16 else ours)


@pytest.mark.skipif(not _cpu.has_avx2_fma(), reason="the CPU lacks AVX2 + FMA")
def test_avx2_gemm_is_the_same_on_any_number_of_threads() -> None:
    """Threads split the output panels (at even ones, where fp32 weights are packed in panel pairs),
    never a sum: every thread count gives the same bits."""
    g = torch.Generator().manual_seed(11)
    w, x = torch.randn(200, 300, generator=g), torch.randn(150, 300, generator=g)
    packed = cpu_gemm.prepack(w, "avx2")
    assert isinstance(packed, cpu_gemm.PackedWeight)
    outs = []
    for threads in (1, 2, 3, 5):
        y = torch.empty(150, 200)
        _cpu.gemm_cpu(x.data_ptr(), packed.data.data_ptr(), 0, y.data_ptr(), 150, 200, 300, 300, 200, 0, threads,
                      packed.pairs)
        outs.append(y)
    assert all(torch.equal(outs[0], y) for y in outs[1:])
    torch.testing.assert_close(outs[0], F.linear(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not _cpu.has_avx512_bf16(), reason="the CPU lacks AVX512-BF16")
@pytest.mark.parametrize("rows", [3, 150])  # below and above the rows that take the software prefetch
def test_bf16_pair_gemm_is_the_same_on_any_number_of_threads(rows: int) -> None:
    """The pair layout interleaves panels 2j and 2j + 1: threads split at even panels, whatever their
    number, with an odd panel count (13) whose last panel stands alone."""
    g = torch.Generator().manual_seed(12)
    w, x = torch.randn(200, 300, generator=g).bfloat16(), torch.randn(rows, 300, generator=g).bfloat16()
    packed = cpu_gemm.prepack(w, "avx2")
    assert isinstance(packed, cpu_gemm.PackedWeight) and packed.pairs
    outs = []
    for threads in (1, 2, 3, 5, 7):
        y = torch.empty(rows, 200)
        _cpu.gemm_bf16_cpu(x.data_ptr(), packed.data.data_ptr(), 0, y.data_ptr(), rows, 200, 300, 300, 200, threads)
        outs.append(y)
    assert all(torch.equal(outs[0], y) for y in outs[1:])
    torch.testing.assert_close(outs[0], F.linear(x.float(), w.float()))


@pytest.mark.skipif(not _cpu.has_avx2_fma(), reason="the CPU lacks AVX2 + FMA")
def test_avx2_gemm_rejects_bad_sizes() -> None:
    w, x = torch.randn(32, 64), torch.randn(4, 64)
    packed = cpu_gemm.prepack(w, "avx2")
    with pytest.raises(ValueError, match="65 features, the weight 64"):
        cpu_gemm.linear(torch.randn(4, 65), packed, None)
    y = torch.empty(4, 32)
    with pytest.raises(ValueError, match="bad sizes"):  # rows closer than k apart
        _cpu.gemm_cpu(x.data_ptr(), packed.data.data_ptr(), 0, y.data_ptr(), 4, 32, 64, 63, 32, 0)
    with pytest.raises(ValueError, match="null pointer"):
        _cpu.gemm_cpu(0, packed.data.data_ptr(), 0, y.data_ptr(), 4, 32, 64, 64, 32, 0)
    with pytest.raises(ValueError, match="bias of shape"):
        cpu_gemm.linear(x, packed, torch.randn(3))
    with pytest.raises(ValueError, match="bad sizes"):  # weight rows closer than k apart
        _cpu.gemm_pack_cpu(w.data_ptr(), 0, 32, 64, 63, packed.data.data_ptr())
    with pytest.raises(ValueError, match=">= 1"):
        _cpu.gemm_packed_elements(0, 64)
    with pytest.raises(ValueError, match="fit int64"):
        _cpu.gemm_packed_elements(1 << 40, 1 << 40)
    # A weight whose rows overlap (expand) is packed from a contiguous copy.
    row = torch.randn(1, 64)
    torch.testing.assert_close(cpu_gemm.linear(x, cpu_gemm.prepack(row.expand(32, 64), "avx2"), None),
                               F.linear(x, row.expand(32, 64)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("make", [
    lambda: ReplicatedLinear(256, 1024, bias=True),
    lambda: MergedColumnParallelLinear(256, [768, 768]),
    lambda: RowParallelLinear(768, 256, bias=True),
], ids=["replicated_bias", "merged", "row"])
def test_prepacked_linear_matches_f_linear(make: object, rows: int) -> None:
    layer = _filled(make(), seed=rows)  # type: ignore[operator]
    weight, bias = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    x = torch.randn(rows, layer.input_size, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x, weight, bias)
    assert layer.prepack_for_cpu()
    assert layer.packed is not None and layer.weight.numel() == 0  # the dense copy is released
    assert not layer.prepack_for_cpu()  # once
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    # Views of a wider tensor and more than two dimensions take the same path.
    wide = torch.randn(rows, 2 * layer.input_size)
    torch.testing.assert_close(layer(wide[:, ::2]), F.linear(wide[:, ::2], weight, bias), rtol=1e-5, atol=1e-5)
    x3 = x.reshape(1, rows, -1)
    torch.testing.assert_close(layer(x3), expected.reshape(1, rows, -1), rtol=1e-5, atol=1e-5)


def test_which_layers_are_prepacked() -> None:
    """Ours packs every fp32 / bf16 weight (small ones gain too: 64 x 256 x 256 took 56 us against
    83 with F.linear); oneDNN only those of PREPACK_MIN_WEIGHTS and more; other devices none."""
    small = ReplicatedLinear(64, 128)
    assert small.weight.numel() < cpu_gemm.PREPACK_MIN_WEIGHTS
    assert cpu_gemm.can_prepack(small.weight, "avx2") and not cpu_gemm.can_prepack(small.weight, "onednn")
    packs = cpu_features.gemm_kernel() == "avx2"
    assert small.prepack_for_cpu() == packs and (small.packed is not None) == packs
    assert small.weight.numel() == (0 if packs else 64 * 128)
    meta = ReplicatedLinear(1024, 1024).to("meta")
    assert not cpu_gemm.can_prepack(meta.weight, "avx2") and not cpu_gemm.can_prepack(meta.weight, "onednn")
    assert not cpu_gemm.can_prepack(torch.zeros(64, 64, dtype=torch.float16), "avx2")


@pytest.mark.parametrize("size", [64, 512])  # below and above the fp32 threshold
def test_bf16_layers_prepacked_natively_or_as_fp32_copies(size: int) -> None:
    """Ours packs bf16 weights as bf16 (small ones, or all where the CPU lacks native bf16). With
    oneDNN: where the CPU computes bf16, large bf16 weights are packed as bf16; where it does not, every bf16 layer keeps an fp32 packed copy (emulated
    bf16 GEMMs are 5-10x slower). The output is the bf16 rounding of the fp32 product, as a bf16
    GEMM with fp32 accumulation gives."""
    layer = _filled(ReplicatedLinear(size, size, bias=True), seed=3).to(torch.bfloat16)
    x = torch.randn(16, size).to(torch.bfloat16)
    expected = F.linear(x, layer.weight, layer.bias)
    native = cpu_features.native_bf16()
    ours = cpu_features.gemm_kernel() == "avx2"
    assert layer.prepack_for_cpu() == (ours or not native or size * size >= cpu_gemm.PREPACK_MIN_WEIGHTS)
    if isinstance(layer.packed, cpu_gemm.PackedWeight):
        assert layer.packed.data.dtype == torch.bfloat16  # ours widens bf16 in registers
    elif layer.packed is not None:
        assert layer.packed.dtype == (torch.bfloat16 if native else torch.float32)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected, rtol=2 ** -7, atol=2e-2)


def test_lm_head_prepacked_and_a_tied_one_keeps_the_embedding() -> None:
    head = _filled(ParallelLMHead(4096, 256), seed=4)
    weight = head.weight.detach().clone()
    hidden = torch.randn(5, 256)
    assert head.prepack_for_cpu() and head.weight.numel() == 0
    torch.testing.assert_close(head(hidden), F.linear(hidden, weight), rtol=1e-5, atol=1e-5)

    embedding = _filled(VocabParallelEmbedding(4096, 256), seed=5)
    dense = embedding.weight.detach().clone()
    tied = ParallelLMHead(4096, 256)
    tied.tie_to(embedding)
    assert tied.prepack_for_cpu() and tied.weight is embedding.weight and torch.equal(embedding.weight, dense)
    torch.testing.assert_close(tied(hidden), F.linear(hidden, dense), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([0, 17, 4095])
    assert torch.equal(embedding(ids), dense[ids])  # the lookup still reads the dense rows


PAIRS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not _cpu.has_avx512f(), reason="the pair tiles need AVX-512 (bf16 pairs: AVX512-BF16)"))]


@pytest.mark.skipif(not _cpu.has_avx2_fma(), reason="the CPU lacks AVX2 + FMA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 5, 33])
@pytest.mark.parametrize("pairs", PAIRS)
@pytest.mark.parametrize("k", [72, 96])
def test_lm_head_logits_in_one_call_equal_the_linear_then_float(dtype: torch.dtype, weight_dtype: torch.dtype,
                                                                rows: int, pairs: bool, k: int) -> None:
    """cpu_gemm.logits (gemm_logits_cpu) is `_gemm(rows).float()` bit for bit (no NaN here): bf16 rows
    give fp32 logits rounded to bf16, as F.linear's bf16 output widened, on fp32 or bf16 weights
    (fp32 rows on a pair-packed bf16 weight rounded to bf16 first); rows read in place at their stride.
    A depth of 96 takes AMX tiles for bf16 pairs where the CPU has them (which round each panel pair's
    logits as they are summed), 72 the pair tiles."""
    if pairs and weight_dtype == torch.bfloat16 and not _cpu.has_avx512_bf16():
        pytest.skip("bf16 pairs need AVX512-BF16")
    g = torch.Generator().manual_seed(rows + k)
    n = 1000  # cut ragged by the 16-column panels
    weight = torch.randn(n, k, generator=g).to(weight_dtype)
    packed = cpu_gemm.prepack(weight, "avx2")
    assert isinstance(packed, cpu_gemm.PackedWeight)
    if pairs != packed.pairs:
        pytest.skip("this CPU packs the weight the other way")
    wide = (torch.randn(rows, k + 9, generator=g) * 4).to(dtype)
    for x in (wide[:, :k].contiguous(), wide[:, 5:5 + k], wide[:1, :k].expand(rows, k)):
        logits = cpu_gemm.logits(x, packed)
        assert logits.dtype == torch.float32 and logits.shape == (rows, n)
        assert torch.equal(logits, cpu_gemm._gemm(x, packed, None).float())
    head = ParallelLMHead(n, k).to(weight_dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
    assert head.prepack_for_cpu()
    x = wide[:, :k]
    assert torch.equal(head.logits(x), head(x).float())


@pytest.mark.skipif(not _cpu.has_avx2_fma(), reason="the CPU lacks AVX2 + FMA")
def test_lm_head_logits_reject_bad_sizes() -> None:
    packed = cpu_gemm.prepack(torch.randn(32, 16), "avx2")
    assert isinstance(packed, cpu_gemm.PackedWeight)
    with pytest.raises(ValueError, match="16 inputs"):
        cpu_gemm.logits(torch.randn(2, 15), packed)
    y = torch.empty(2, 32)
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="bad sizes"):
        _cpu.gemm_logits_cpu(x.data_ptr(), 0, packed.data.data_ptr(), 0, False, y.data_ptr(), 2, 32, 16, 15, 32)
    with pytest.raises(ValueError, match="null pointer"):
        _cpu.gemm_logits_cpu(x.data_ptr(), 0, 0, 0, False, y.data_ptr(), 2, 32, 16, 16, 32)
    with pytest.raises(ValueError, match="x_dtype"):
        _cpu.gemm_logits_cpu(x.data_ptr(), 5, packed.data.data_ptr(), 0, False, y.data_ptr(), 2, 32, 16, 16, 32)


def test_a_bf16_lm_head_takes_our_gemm_wherever_it_runs() -> None:
    """The head sees decode rows only: ours (even the pair tiles where linear layers take oneDNN)."""
    head = _filled(ParallelLMHead(4096, 256), seed=6).to(torch.bfloat16)
    weight = head.weight.detach().clone()
    ours = cpu_features.gemm_kernel() == "avx2"
    expected_kernel = "avx2" if ours else cpu_gemm.layer_kernel(weight)
    assert cpu_gemm.head_kernel() == expected_kernel
    assert head.prepack_for_cpu()
    assert isinstance(head.packed, cpu_gemm.PackedWeight) == (expected_kernel == "avx2")
    hidden = torch.randn(3, 256).to(torch.bfloat16)
    torch.testing.assert_close(head(hidden).float(), F.linear(hidden.float(), weight.float()), rtol=2 ** -7, atol=2e-2)


@pytest.fixture(scope="module")
def builtin_shaped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The built-in model's shapes (most of its layers above the prepack threshold), two layers.
    spec = dataclasses.replace(BUILTIN_SPEC, num_hidden_layers=2, seed=21)
    return create_model_dir(tmp_path_factory.mktemp("gemm") / "m", spec=spec)


def test_engine_with_prepacked_layers_matches_transformers(builtin_shaped: Path) -> None:
    llm = LLM(str(builtin_shaped), device="cpu", num_kvcache_blocks=64, block_size=16, max_model_len=512)
    # ours: every projection and the LM head; oneDNN: all but o_proj (below its threshold).
    per_layer = 4 if cpu_features.gemm_kernel() == "avx2" else 3
    assert llm.engine.executor.runner.num_prepacked == 2 * per_layer + 1
    assert_greedy_matches(llm, builtin_shaped, random_prompts([1, 30, 100], 4096, seed=22), max_new=24)


def test_one_openmp_runtime_shared_with_torch(builtin_shaped: Path) -> None:
    """_cpu's kernels (attention, norms, sampler) and torch's GEMMs use the same libgomp, hence the
    same team of threads."""
    llm = LLM(str(builtin_shaped), device="cpu", num_kvcache_blocks=64, block_size=16, max_model_len=512)
    llm.generate([[1, 2, 3] * 40], SamplingParams(temperature=0.8, max_tokens=4), use_tqdm=False)
    with open(f"/proc/{os.getpid()}/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def test_large_packed_weights_lie_on_huge_pages() -> None:
    """A tensor of 2 MiB or more from huge_pages.empty starts on a 2 MiB boundary and, where Linux
    offers transparent huge pages, is backed by them once touched; smaller ones are plain tensors.
    The memory outlives the function that mapped it (the tensor holds the mapping)."""
    small = huge_pages.empty(1000, torch.bfloat16)
    assert small.shape == (1000,) and small.dtype == torch.bfloat16
    big = huge_pages.empty(3 << 20, torch.float32)  # 12 MiB
    assert big.shape == (3 << 20,) and big.dtype == torch.float32 and big.data_ptr() % huge_pages.HUGE_PAGE == 0
    before = _anon_huge_kib()
    big.fill_(2.0)
    assert big.sum().item() == 2.0 * (3 << 20)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert _anon_huge_kib() - before >= 8 << 10  # at least 4 of the 6 pages (khugepaged aside)
    if _cpu.has_avx2_fma():
        packed = cpu_gemm.prepack(torch.randn(1024, 1024), "avx2")
        assert isinstance(packed, cpu_gemm.PackedWeight) and packed.data.data_ptr() % huge_pages.HUGE_PAGE == 0
