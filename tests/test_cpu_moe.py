"""The mixture-of-experts layer (nanovllm/layers/fused_moe.py) on CPU, every path: the fused C++
call on experts packed for our AVX2 GEMM, the per-expert loop on oneDNN-packed or dense weights,
and the torch ops; against a per-token float64 reference on random shapes (experts 1..64, top-k
1..8, rows 0..300, hidden and intermediate sizes that no tile divides). Also the routing and the
combine on their own, bf16, the tensor-parallel split of the experts, and bad input."""

from __future__ import annotations

import pytest
import torch
from moe_cases import CASES, Case, case_id, make_weights, per_token_reference

from nanovllm import _cpu
from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.cpu import moe as cpu_moe
from nanovllm.layers import moe_torch
from nanovllm.layers.fused_moe import FusedMoE

AVX2 = pytest.mark.skipif(not _cpu.has_avx2_fma(), reason="the CPU lacks AVX2 + FMA")
PAIRS = pytest.mark.skipif(not (_cpu.has_avx2_fma() and _cpu.has_avx512_bf16()), reason="the CPU lacks AVX512-BF16")
FP32_PAIRS = pytest.mark.skipif(not (_cpu.has_avx2_fma() and _cpu.has_avx512f()), reason="the CPU lacks AVX-512")
ONEDNN = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
# avx2: our AVX2 tiles; pairs: our AVX-512 pair tiles (fp32 here)
PATHS = [pytest.param("avx2", marks=AVX2), pytest.param("pairs", marks=FP32_PAIRS), pytest.param("onednn", marks=ONEDNN),
         "dense", "torch"]


def run_path(path: str, x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
             renormalize: bool) -> torch.Tensor:
    if path == "torch":
        ids, weights = moe_torch.route(logits, top_k, renormalize)
        return moe_torch.experts(x, ids, weights, w13, w2)
    packed: cpu_moe.PackedExperts | None = None
    if path in ("avx2", "pairs"):  # pairs: the AVX-512 tiles (AVX512-BF16's for bf16 experts)
        packed = cpu_moe.pack_experts(w13, w2, "avx2", pairs=path == "pairs")
        assert isinstance(packed, cpu_moe.GemmPackedExperts) and packed.w13.dtype == w13.dtype
        w13, w2 = w13.new_empty(0), w2.new_empty(0)  # the layer releases them: never read
    elif path == "onednn":  # packed whatever the size (the engine leaves small ones dense)
        packed = cpu_moe.LinearExperts([cpu_gemm.prepack(w, "onednn") for w in w13],
                                       [cpu_gemm.prepack(w, "onednn") for w in w2])
    return cpu_moe.fused_experts(x, logits, w13, w2, packed, top_k, renormalize)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_per_token_reference(path: str, case: Case) -> None:
    x, logits, w13, w2 = make_weights(case, seed=case.experts * 100 + case.rows)
    ref = per_token_reference(x, logits, w13, w2, case.top_k, case.renormalize)
    got = run_path(path, x, logits, w13, w2, case.top_k, case.renormalize)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


@AVX2
def test_fused_call_takes_strided_and_broadcast_rows() -> None:
    """Rows of a wider tensor and one row broadcast over the batch (stride 0) give the same output."""
    c = Case(8, 2, 9, 48, 24, True)
    x, logits, w13, w2 = make_weights(c, seed=5)
    packed = cpu_moe.pack_experts(w13, w2, "avx2")
    wide = torch.randn(c.rows, c.hidden + 7)
    wide[:, 3:3 + c.hidden] = x
    expected = cpu_moe.fused_experts(x, logits, w13, w2, packed, c.top_k, c.renormalize)
    assert torch.equal(cpu_moe.fused_experts(wide[:, 3:3 + c.hidden], logits, w13, w2, packed, c.top_k, True), expected)
    same = x[:1].expand(c.rows, c.hidden)
    torch.testing.assert_close(cpu_moe.fused_experts(same, logits, w13, w2, packed, c.top_k, True),
                               per_token_reference(same, logits, w13, w2, c.top_k, True).float(), rtol=1e-4, atol=1e-5)


@AVX2
def test_experts_nobody_chose_do_not_reach_the_output() -> None:
    """Poison the packed weights of every expert no row chose with NaN: the output stays finite and
    exact, so an expert's rows are never mixed up with another's."""
    c = Case(32, 2, 3, 64, 32, True)
    x, logits, w13, w2 = make_weights(c, seed=6)
    packed = cpu_moe.pack_experts(w13, w2, "avx2")
    assert isinstance(packed, cpu_moe.GemmPackedExperts)
    chosen = set(cpu_moe.route(logits, c.top_k, True).topk_ids.flatten().tolist())
    assert len(chosen) <= 6 < c.experts
    per13, per2 = packed.w13.numel() // c.experts, packed.w2.numel() // c.experts
    for e in set(range(c.experts)) - chosen:
        packed.w13[e * per13:(e + 1) * per13] = float("nan")
        packed.w2[e * per2:(e + 1) * per2] = float("nan")
    got = cpu_moe.fused_experts(x, logits, w13, w2, packed, c.top_k, True)
    torch.testing.assert_close(got.double(), per_token_reference(x, logits, w13, w2, c.top_k, True), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("pairs,dtype", [pytest.param(False, torch.float32, marks=AVX2),
                                         pytest.param(True, torch.float32, marks=FP32_PAIRS),
                                         pytest.param(True, torch.bfloat16, marks=PAIRS)])
def test_fused_call_is_the_same_on_any_number_of_threads(pairs: bool, dtype: torch.dtype) -> None:
    """Threads split (expert, panel) pairs and rows, never a sum: every thread count gives the same bits."""
    c = Case(16, 4, 100, 200, 72, True)
    x, logits, w13, w2 = make_weights(c, seed=7, dtype=dtype)
    packed = cpu_moe.pack_experts(w13, w2, "avx2", pairs=pairs)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            outs.append(cpu_moe.fused_experts(x, logits, w13, w2, packed, c.top_k, True))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], y) for y in outs[1:])


@pytest.mark.parametrize("pairs,dtype", [pytest.param(False, torch.float32, marks=AVX2),
                                         pytest.param(False, torch.bfloat16, marks=AVX2),
                                         pytest.param(True, torch.float32, marks=FP32_PAIRS),
                                         pytest.param(True, torch.bfloat16, marks=PAIRS)])
@pytest.mark.parametrize("few", [1, 3, 6])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("top_k,hot", [(4, False), (1, True)], ids=["even", "hot"])
def test_a_rows_output_does_not_depend_on_the_batch(pairs: bool, dtype: torch.dtype, few: int, threads: int,
                                                     top_k: int, hot: bool) -> None:
    """A few rows (a decode step: the threads take whole experts where at least two per thread are
    chosen, else each expert's panels) and the same rows at the head of a large batch give the same bits. The batch's 37 rows per expert go whole to
    the threads too, which splits them evenly; with one hot expert (every row past the few choosing
    expert 5 alone) no split of whole experts is even, and each expert's panels are split instead."""
    c = Case(32, top_k, 300, 264, 40, True)
    x, logits, w13, w2 = make_weights(c, seed=8, dtype=dtype)
    if hot:
        logits[few:, 5] += 100.0
    packed = cpu_moe.pack_experts(w13, w2, "avx2", pairs=pairs)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        batch = cpu_moe.fused_experts(x, logits, w13, w2, packed, c.top_k, True)
        alone = cpu_moe.fused_experts(x[:few], logits[:few], w13, w2, packed, c.top_k, True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone, batch[:few])


BF16_PATHS = [pytest.param("avx2", marks=AVX2), pytest.param("pairs", marks=PAIRS), pytest.param("onednn", marks=ONEDNN)]


@pytest.mark.parametrize("path", BF16_PATHS)
@pytest.mark.parametrize("case", [Case(16, 4, 40, 136, 48, False), *CASES[3:]], ids=case_id)
def test_bf16_matches_torch_bf16_and_fp32(path: str, case: Case) -> None:
    """bf16 activations and weights: within bf16 rounding of the fp32 result and of torch's bf16 ops
    (an intermediate size 8 does not divide pads the pair tiles' depth)."""
    c = case
    x, logits, w13, w2 = make_weights(c, seed=8, dtype=torch.bfloat16)
    got = run_path(path, x, logits, w13, w2, c.top_k, c.renormalize)
    assert got.dtype == torch.bfloat16
    ref = per_token_reference(x, logits, w13, w2, c.top_k, c.renormalize)
    ids, weights = moe_torch.route(logits, c.top_k, c.renormalize)
    torch_bf16 = moe_torch.experts(x, ids, weights, w13, w2)
    scale = ref.abs().max().item()
    assert (got.double() - ref).abs().max() < 0.02 * scale
    assert (got.double() - torch_bf16.double()).abs().max() < 0.02 * scale


def test_routing_top_k_weights_and_grouping() -> None:
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(50, 12, generator=g)
    for renormalize in (False, True):
        r = cpu_moe.route(logits, 3, renormalize)
        ids, weights = moe_torch.route(logits, 3, renormalize)
        assert torch.equal(r.topk_ids.long(), ids)
        torch.testing.assert_close(r.topk_weights, weights, rtol=1e-6, atol=1e-7)
        counts = torch.bincount(ids.flatten(), minlength=12)
        assert r.expert_offsets.tolist() == [0, *torch.cumsum(counts, 0).tolist()]
        flat = r.topk_ids.flatten()
        for e in range(12):  # expert e's assignments, rows ascending
            mine = r.sorted[r.expert_offsets[e]:r.expert_offsets[e + 1]]
            assert (flat[mine.long()] == e).all() and mine.tolist() == sorted(mine.tolist())
        assert sorted(r.sorted.tolist()) == list(range(150))
    # Ties go to the lower expert id; rows of -inf but one finite logit still route.
    tied = cpu_moe.route(torch.zeros(2, 6), 4, False)
    assert tied.topk_ids.tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(tied.topk_weights, torch.full((2, 4), 1 / 6))
    lone = cpu_moe.route(torch.tensor([[float("-inf"), 3.0, float("-inf")]]), 1, True)
    assert lone.topk_ids.tolist() == [[1]] and lone.topk_weights.tolist() == [[1.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_combine_sums_each_rows_outputs(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(20, 6, generator=g)
    r = cpu_moe.route(logits, 2, False)
    y = torch.randn(40, 150, generator=g).to(dtype)  # one row per assignment, in sorted order
    by_assignment = torch.empty_like(y)
    by_assignment[r.sorted.long()] = y
    expected = (by_assignment.float().view(20, 2, 150) * r.topk_weights[:, :, None]).sum(1)
    got = cpu_moe.combine(y, r)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=1e-5 if dtype == torch.float32 else 2 ** -7, atol=1e-5)


class _FakeRank:
    """A tensor-parallel rank of a group whose all-reduce the test does itself."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


@pytest.mark.parametrize("expert_names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_layer_loads_experts_by_name_and_splits_them_over_ranks(expert_names: tuple[str, str, str]) -> None:
    """Each checkpoint tensor fills its expert's slice through the weight loaders; the two ranks'
    partial outputs (intermediate dimension halved) sum to the whole layer's."""
    c = Case(6, 2, 11, 40, 32, True)
    x, logits, w13, w2 = make_weights(c, seed=11)
    gate, up, down = expert_names
    checkpoint = {}
    for e in range(c.experts):
        checkpoint[f"{e}.{gate}.weight"] = w13[e, :c.inter]
        checkpoint[f"{e}.{up}.weight"] = w13[e, c.inter:]
        checkpoint[f"{e}.{down}.weight"] = w2[e]

    def load(layer: FusedMoE) -> FusedMoE:
        for param in (layer.w13_weight, layer.w2_weight):
            assert len(param.checkpoint_shards) == c.experts * (2 if param is layer.w13_weight else 1)
            for name, shard in param.checkpoint_shards:
                param.weight_loader(param, checkpoint[name], shard)
        return layer

    whole = load(FusedMoE(c.experts, c.top_k, c.hidden, c.inter, True, expert_names))
    assert torch.equal(whole.w13_weight, w13) and torch.equal(whole.w2_weight, w2)
    expected = per_token_reference(x, logits, w13, w2, c.top_k, True)
    torch.testing.assert_close(whole(x, logits).double(), expected, rtol=1e-4, atol=1e-5)
    ranks = [load(FusedMoE(c.experts, c.top_k, c.hidden, c.inter, True, expert_names, _FakeRank(r, 2)))  # type: ignore[arg-type]
             for r in range(2)]
    assert ranks[1].w13_weight.shape == (c.experts, c.inter, c.hidden)
    assert torch.equal(ranks[1].w2_weight, w2[:, :, c.inter // 2:])
    for layer in ranks:
        layer.prepack_for_cpu()
    torch.testing.assert_close(sum(layer(x, logits).double() for layer in ranks), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"shape mismatch: expected \[32, 40\], got \[16, 40\]"):
        whole.w13_weight.weight_loader(whole.w13_weight, w13[0, :16], (0, 0))


def test_layer_prepacks_for_the_expert_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The experts take ours wherever the CPU has AVX2 + FMA, else the dense layers' kernel (a kernel
    forced here); the dense weights are released; oneDNN leaves experts below its size threshold dense."""
    assert cpu_moe.expert_kernel() == ("avx2" if _cpu.has_avx2_fma() else cpu_gemm.gemm_kernel())
    c = Case(4, 2, 5, 64, 32, False)
    x, logits, w13, w2 = make_weights(c, seed=12)
    expected = per_token_reference(x, logits, w13, w2, c.top_k, False)
    kernels = (["avx2"] if _cpu.has_avx2_fma() else []) + (["onednn"] if torch.backends.mkldnn.is_available() else [])
    for kernel, min_weights, packed_type in [(k, m, t) for k in kernels for m, t in (
            (cpu_gemm.PREPACK_MIN_WEIGHTS, cpu_moe.GemmPackedExperts if k == "avx2" else None),
            (0, cpu_moe.GemmPackedExperts if k == "avx2" else cpu_moe.LinearExperts))]:
        monkeypatch.setattr(cpu_moe, "expert_kernel", lambda kernel=kernel: kernel)
        monkeypatch.setattr(cpu_gemm, "PREPACK_MIN_WEIGHTS", min_weights)
        layer = FusedMoE(c.experts, c.top_k, c.hidden, c.inter, False)
        with torch.no_grad():
            layer.w13_weight.copy_(w13)
            layer.w2_weight.copy_(w2)
        assert layer.prepack_for_cpu() == (packed_type is not None)
        assert (layer.packed is None) if packed_type is None else isinstance(layer.packed, packed_type)
        assert layer.w13_weight.numel() == (w13.numel() if packed_type is None else 0)
        assert not layer.prepack_for_cpu()  # once
        torch.testing.assert_close(layer(x, logits).double(), expected, rtol=1e-4, atol=1e-5)


def test_bad_input_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"top_k \(experts per token\) must be between 1 and the number of experts \(4\), got 5"):
        FusedMoE(4, 5, 64, 32, True)
    with pytest.raises(ValueError, match="intermediate size"):
        FusedMoE(4, 2, 64, 33, True, tp=_FakeRank(0, 2))  # type: ignore[arg-type]
    logits = torch.randn(3, 4)
    out = torch.empty(12, dtype=torch.int32)
    with pytest.raises(ValueError, match="top_k"):
        _cpu.moe_route_cpu(logits.data_ptr(), 3, 4, 4, 5, True, out.data_ptr(), out.data_ptr(), out.data_ptr(),
                         out.data_ptr())
    with pytest.raises(ValueError, match="null pointer"):
        _cpu.moe_route_cpu(0, 3, 4, 4, 2, True, out.data_ptr(), out.data_ptr(), out.data_ptr(), out.data_ptr())
    r = cpu_moe.route(logits, 2, True)
    with pytest.raises(ValueError, match=r"expected \[6, hidden\]"):
        cpu_moe.combine(torch.randn(5, 8), r)
    bad = torch.zeros(6, dtype=torch.int32)  # not a permutation
    y, y_out = torch.randn(6, 8), torch.empty(3, 8)
    with pytest.raises(ValueError, match="not a permutation"):
        _cpu.moe_combine_cpu(y.data_ptr(), 8, bad.data_ptr(), r.topk_weights.data_ptr(), 3, 2, 8, y_out.data_ptr(), 8, 0)
    c = Case(4, 2, 3, 64, 32, True)
    x, logits, w13, w2 = make_weights(c, seed=13)
    if _cpu.has_avx2_fma():
        packed = cpu_moe.pack_experts(w13, w2, "avx2")
        assert isinstance(packed, cpu_moe.GemmPackedExperts)
        with pytest.raises(ValueError, match="input of 63 features and 4 router logits, the experts take 64 and 4"):
            cpu_moe.fused_experts(x[:, :63], logits, w13, w2, packed, 2, True)
        with pytest.raises(ValueError, match="packed experts hold"):  # 3 experts' worth for 4
            _cpu.moe_experts_cpu(x.data_ptr(), 64, logits.data_ptr(), 4, packed.w13.data_ptr(),
                                 packed.w13.numel() * 3 // 4, packed.w2.data_ptr(), packed.w2.numel(), 0, False, 3,
                                 64, 32, 4, 2, True, x.data_ptr(), 64, 0)
        with pytest.raises(ValueError, match="pairs need"):  # an odd hidden size, or a CPU without AVX512-BF16
            cpu_moe.pack_experts(w13[:, :, :63].bfloat16(), w2[:, :63].bfloat16(), "avx2", pairs=True)
        with pytest.raises(ValueError, match="bf16 pairs need"):  # fp32 activations
            _cpu.moe_experts_cpu(x.data_ptr(), 64, logits.data_ptr(), 4, packed.w13.data_ptr(), packed.w13.numel(),
                                 packed.w2.data_ptr(), packed.w2.numel(), 1, True, 3, 64, 32, 4, 2, True, x.data_ptr(),
                                 64, 0)
    if _cpu.has_avx2_fma() and _cpu.has_avx512_bf16():
        paired = cpu_moe.pack_experts(w13.bfloat16(), w2.bfloat16(), "avx2", pairs=True)
        with pytest.raises(ValueError, match="packed for bf16 activations, got torch.float32"):
            cpu_moe.fused_experts(x, logits, w13, w2, paired, 2, True)
        with pytest.raises(ValueError, match="k even"):
            _cpu.gemm_pack_cpu(w13.data_ptr(), 1, 4, 63, 63, w13.data_ptr(), True)
    with pytest.raises(ValueError, match="unsupported input"):
        cpu_moe.fused_experts(torch.randn(3, 64, dtype=torch.float64), logits, w13, w2, None, 2, True)
