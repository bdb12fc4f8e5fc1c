"""The CUDA kernels (nanovllm._kernels) and the Triton prefill kernel against the torch reference
backend on a GPU, plus the wrappers' argument checks (those also run on the CPU).

Inputs are random (never zeros), outputs are poisoned with NaN before each launch, and the errors
are relative to the reference's largest magnitude: under 1e-5 in fp32, 2e-2 in bf16 (5e-3 fp16).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import make_case, ragged_context_lens, reference, relative_error

from nanovllm.attention import cuda_ops

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _kernels_built() -> bool:
    return cuda_ops.is_available()


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_kernels = pytest.mark.skipif(not _kernels_built(), reason="nanovllm._kernels is not built (no nvcc at install)")
DEV = "cuda"


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def poison_workspace(num_floats: int) -> None:
    """Leave NaN in the allocator's cache where the split-KV workspace will likely be carved from,
    so a partial result that is read without having been written shows up (best effort)."""
    junk = torch.full((num_floats,), float("nan"), device=DEV)
    del junk


def run_decode(case, num_partitions=None) -> torch.Tensor:
    n = case.meta.num_decode_tokens
    out = torch.full_like(case.query, float("nan"))
    if num_partitions and num_partitions > 1:
        poison_workspace(n * case.query.shape[1] * num_partitions * (case.query.shape[2] + 2))
    cuda_ops.decode_attention(case.query, case.k_cache, case.v_cache, case.meta.block_tables,
                              case.meta.context_lens, case.scale, num_seqs=n, max_context_len=case.meta.max_seqlen_k,
                              out=out, num_partitions=num_partitions)
    torch.cuda.synchronize()
    return out[:n].cpu()


# --- decode ---------------------------------------------------------------------------------------


@needs_gpu
@needs_kernels
@pytest.mark.parametrize("split", [None, 4], ids=["auto", "split4"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(dtype, head_dim, block_size, group, split) -> None:
    case = make_case(context_lens=ragged_context_lens(block_size, long=1500), num_kv_heads=2, group=group,
                     head_dim=head_dim, block_size=block_size, dtype=dtype, device=DEV, seed=head_dim + group)
    out = run_decode(case, split)
    assert not torch.isnan(out).any()
    err = relative_error(out, reference(case))
    assert err < TOL[dtype], f"relative error {err:.2e}"


@needs_gpu
@needs_kernels
def test_decode_split_kv_is_chosen_and_correct_for_long_context_small_batch() -> None:
    sms = cuda_ops.num_sms(torch.device(DEV))
    assert cuda_ops.choose_num_partitions(2, 32, 8, 8192, sms) > 1
    case = make_case(context_lens=[8192, 3000], num_kv_heads=8, group=4, head_dim=128, block_size=16,
                     dtype=torch.bfloat16, device=DEV, seed=1)
    err = relative_error(run_decode(case), reference(case))
    assert err < TOL[torch.bfloat16]


@needs_gpu
@needs_kernels
@pytest.mark.parametrize("num_partitions", [1, 3])
def test_decode_zero_context_rows_are_zero(num_partitions) -> None:
    case = make_case(context_lens=[40, 700], num_kv_heads=2, group=2, head_dim=64, block_size=16,
                     dtype=torch.float32, device=DEV, seed=2)
    ref = reference(case)
    case.meta.context_lens[0] = 0
    out = run_decode(case, num_partitions)
    assert torch.all(out[0] == 0)
    assert relative_error(out[1:], ref[1:]) < 1e-5


@needs_gpu
@needs_kernels
def test_decode_under_cuda_graph_follows_new_context_lengths() -> None:
    """Captured once, replayed with other lengths: the partitions follow each sequence's length."""
    # Block tables must cover every length a replay uses: rows shorter than the context hold -1,
    # which the kernel would dereference (an out-of-bounds read before the cache tensor).
    cover = [900, 899, 256, 255]
    case = make_case(context_lens=cover, num_kv_heads=2, group=4, head_dim=128, block_size=16,
                     dtype=torch.bfloat16, device=DEV, seed=3)
    m = case.meta
    out = torch.empty_like(case.query)

    def launch() -> None:
        cuda_ops.decode_attention(case.query, case.k_cache, case.v_cache, m.block_tables, m.context_lens,
                                  case.scale, max_context_len=4096, out=out)

    launch()  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for lens in ([900, 17, 256, 1], [1, 899, 3, 255], [512, 512, 0, 16]):
        m.context_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        host = make_case(context_lens=cover, num_kv_heads=2, group=4, head_dim=128, block_size=16,
                         dtype=torch.bfloat16, seed=3)
        host.meta.context_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        host.meta.host = None
        keep = [i for i, n in enumerate(lens) if n > 0]
        ref = reference(host)
        got = out.cpu()
        assert relative_error(got[keep], ref[keep]) < TOL[torch.bfloat16], lens
        assert all(torch.all(got[i] == 0) for i, n in enumerate(lens) if n == 0)


# --- cache write ----------------------------------------------------------------------------------


@needs_gpu
@needs_kernels
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cache_write_matches_reference(dtype, head_dim) -> None:
    from nanovllm.attention import torch_backend

    g = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, kv_heads, tokens = 64, 16, 4, 300
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype).to(DEV)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype).to(DEV)
    qkv = torch.randn(tokens, 16 * head_dim, generator=g).to(dtype).to(DEV)
    key = qkv[:, 8 * head_dim:12 * head_dim].view(tokens, kv_heads, head_dim)  # strided, like the model's
    value = qkv[:, 12 * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens].to(torch.int32)
    slots[::7] = -1
    slots = slots.to(DEV)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_backend.write_kv_cache(key, value, ref_k, ref_v, slots)
    cuda_ops.write_kv_cache(key, value, k_cache, v_cache, slots)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


# --- prefill (Triton) and the backend ---------------------------------------------------------------


@needs_gpu
@pytest.mark.skipif(not _has_triton(), reason="needs triton")
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_prefill_matches_reference(dtype, head_dim, block_size, group) -> None:
    from nanovllm.attention.triton_prefill import prefill_attention

    # Two decodes first (not touched), then chunks with and without a cached prefix.
    ctx = [50, 3, 40, block_size + 9, 2 * block_size, 1, 700]
    q_lens = [1, 1, 40, 9, 2 * block_size, 1, 200]
    case = make_case(context_lens=ctx, q_lens=q_lens, num_decode=2, num_kv_heads=2, group=group, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, device=DEV, seed=head_dim)
    m = case.meta
    out = torch.full_like(case.query, float("nan"))
    prefill_attention(case.query, case.k_cache, case.v_cache, out, m.cu_seqlens_q, m.context_lens, m.block_tables,
                      first_seq=2, num_seqs=m.num_seqs - 2, max_seqlen_q=m.max_seqlen_q, scale=case.scale)
    torch.cuda.synchronize()
    got = out[2:].cpu()
    assert not torch.isnan(got).any()
    err = relative_error(got, reference(case)[2:])
    assert err < TOL[dtype], f"relative error {err:.2e}"


@needs_gpu
@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_backend_mixed_batch(dtype) -> None:
    from nanovllm.attention import cuda_backend

    case = make_case(context_lens=[33, 16, 90, 17, 1], q_lens=[1, 1, 60, 17, 1], num_decode=2, num_kv_heads=2,
                     group=4, head_dim=128, block_size=16, dtype=dtype, device=DEV, seed=7)
    out = cuda_backend.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    torch.cuda.synchronize()
    err = relative_error(out.cpu(), reference(case))
    assert err < TOL[dtype], f"{cuda_backend.prefill_implementation(dtype, 16)}: relative error {err:.2e}"


# --- argument checks (CPU tensors: they fail before anything needs a GPU) -------------------------


def _cpu_case(**kw):
    args = dict(context_lens=[5, 20], num_kv_heads=2, group=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    args.update(kw)
    return make_case(**args)


def _decode(case, **kw):
    m = case.meta
    args = dict(query=case.query, k_cache=case.k_cache, v_cache=case.v_cache, block_tables=m.block_tables,
                context_lens=m.context_lens, scale=case.scale)
    args.update(kw)
    return cuda_ops.decode_attention(**args)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c: dict(query=c.query.float()), "dtype"),
        (lambda c: dict(k_cache=c.k_cache.float(), v_cache=c.v_cache.float()), "dtype"),
        (lambda c: dict(v_cache=c.v_cache.float()), "v_cache dtype"),
        (lambda c: dict(query=c.query[:, :, :32]), "head_dim"),
        (lambda c: dict(query=c.query[:, :3]), "multiple of num_kv_heads"),
        (lambda c: dict(query=c.query[0]), "query must be"),
        (lambda c: dict(k_cache=c.k_cache[0]), "k_cache must be"),
        (lambda c: dict(v_cache=c.v_cache[:-1]), "v_cache shape"),
        (lambda c: dict(block_tables=c.meta.block_tables.long()), "block_tables must be torch.int32"),
        (lambda c: dict(block_tables=c.meta.block_tables[:1]), "block_tables must be"),
        (lambda c: dict(block_tables=c.meta.block_tables.t()), "block_tables"),
        (lambda c: dict(context_lens=c.meta.context_lens.long()), "context_lens must be torch.int32"),
        (lambda c: dict(context_lens=c.meta.context_lens[:1]), "context_lens must be"),
        (lambda c: dict(query=c.query.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
        (lambda c: dict(k_cache=c.k_cache[..., :40], v_cache=c.v_cache[..., :40]), "head_dim"),
        (lambda c: dict(out=torch.empty(2, 4, 64)), "out dtype"),
        (lambda c: dict(out=torch.empty(1, 4, 64, dtype=torch.bfloat16)), "out must be"),
        (lambda c: dict(num_partitions=0), "num_partitions"),
        (lambda c: dict(num_partitions=1000), "num_partitions"),
        (lambda c: dict(num_seqs=3), "num_seqs"),
        (lambda c: dict(), "CUDA tensor"),  # everything right but the device
    ],
)
def test_decode_rejects_bad_arguments_before_launch(change, match) -> None:
    case = _cpu_case()
    with pytest.raises(ValueError, match=match):
        _decode(case, **change(case))


def test_decode_rejects_unsupported_head_dim() -> None:
    case = _cpu_case(head_dim=48)
    with pytest.raises(ValueError, match="head_dim 48 is not supported"):
        _decode(case)


def test_decode_rejects_misaligned_cache() -> None:
    case = _cpu_case(dtype=torch.float16)
    wide_k = torch.zeros(*case.k_cache.shape[:3], 72, dtype=torch.float16)
    k = wide_k[..., 4:68]  # 8-byte offset
    with pytest.raises(ValueError, match="16-byte aligned"):
        _decode(case, k_cache=k, v_cache=k)


@needs_gpu
def test_decode_rejects_mixed_devices() -> None:
    case = _cpu_case()
    with pytest.raises(ValueError, match="is on cpu"):
        _decode(case, query=case.query.to(DEV), k_cache=case.k_cache.to(DEV), v_cache=case.v_cache.to(DEV))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: dict(key=a["key"].float()), "key dtype"),
        (lambda a: dict(value=a["value"][:, :1]), "value must be"),
        (lambda a: dict(key=a["key"][:2]), "fewer than slot_mapping"),
        (lambda a: dict(slot_mapping=a["slot_mapping"].long()), "slot_mapping must be torch.int32"),
        (lambda a: dict(slot_mapping=a["slot_mapping"][None]), "slot_mapping must be 1-D"),
        (lambda a: dict(slot_mapping=a["slot_mapping"].repeat(2)[::2]), "contiguous"),
        (lambda a: dict(key=a["key"].transpose(1, 2).contiguous().transpose(1, 2)), "key must be contiguous"),
        (lambda a: dict(v_cache=a["v_cache"].float()), "v_cache dtype"),
        (lambda a: dict(), "CUDA tensor"),
    ],
)
def test_cache_write_rejects_bad_arguments_before_launch(change, match) -> None:
    args = dict(key=torch.randn(3, 2, 64).bfloat16(), value=torch.randn(3, 2, 64).bfloat16(),
                k_cache=torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16),
                v_cache=torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16),
                slot_mapping=torch.tensor([0, -1, 9], dtype=torch.int32))
    args.update(change(args))
    with pytest.raises(ValueError, match=match):
        cuda_ops.write_kv_cache(**args)


def test_split_kv_heuristic() -> None:
    # A full batch fills the GPU on its own: no split, whatever the context.
    assert cuda_ops.choose_num_partitions(256, 16, 8, 32768, 132) == 1
    # Short contexts never split.
    assert cuda_ops.choose_num_partitions(1, 16, 8, 300, 132) == 1
    # One long sequence: split, but never into partitions shorter than the minimum.
    p = cuda_ops.choose_num_partitions(1, 16, 8, 2048, 132)
    assert 1 < p <= 2048 // cuda_ops.TOKENS_PER_PARTITION_MIN
    assert cuda_ops.choose_num_partitions(1, 64, 8, 10**6, 132) <= cuda_ops.MAX_PARTITIONS
