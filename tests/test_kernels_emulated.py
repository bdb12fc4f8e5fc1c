"""The CUDA kernels' source, run on the CPU through an emulation of CUDA (tests/kernel_emulation),
against the torch reference backend, through the real Python wrappers (nanovllm.attention.cuda_ops).

No GPU needed: this is what checks the kernels' indexing, masking, online softmax, GQA grouping,
split-KV partitioning and reduction, and the wrappers' argument marshalling on every machine. It
cannot check what only hardware shows (cp.async pipelining, barriers' memory ordering, timing,
register or shared-memory limits): tests/test_kernels_cuda.py does, on a GPU.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kernel_cases import make_case, ragged_context_lens, reference, relative_error

from nanovllm.attention import cuda_ops

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "kernel_emulation" / "harness.cpp"

# fp32 accumulates in a different order than the reference; 16-bit types also round the output.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

u64, i64, i32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32


def _exported_function(lib: ctypes.CDLL, name: str, argtypes: list) -> Callable[..., int]:
    """The harness exports each entry point as a pointer to kernels/launchers.h's entry template."""
    address = ctypes.c_void_p.in_dll(lib, name).value
    return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(address)


class Emulated:
    """Stands in for nanovllm._kernels: same functions, same arguments (the stream is ignored)."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))  # keeps the library loaded while the pointers are used
        self._cache_write = _exported_function(self.lib, "emu_cache_write", [u64] * 5 + [i64] * 15 + [u64])
        self._paged_decode = _exported_function(self.lib, "emu_paged_decode",
                                                [u64] * 9 + [i64] * 11 + [i32] * 7 + [ctypes.c_float, u64])
        self.widths: list[int] = []

    def cache_write(self, *args: int) -> None:
        width = self._cache_write(*args)
        assert width > 0, "no access width fits the arguments"
        self.widths.append(width)

    def paged_decode(self, *args: int | float) -> None:
        rc = self._paged_decode(*args)
        if rc:
            raise RuntimeError(f"emulated paged_decode failed: {rc}")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> Emulated:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++20 compiler (g++) to build the kernel emulation")
    out = tmp_path_factory.mktemp("kernel_emulation") / "emulated_kernels.so"
    cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-I{REPO / 'kernels'}",
           f"-I{HARNESS.parent}", str(HARNESS), "-o", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"building the emulation failed:\n{result.stderr[-4000:]}"
    return Emulated(out)


@pytest.fixture
def emu(emulated: Emulated, monkeypatch: pytest.MonkeyPatch) -> Emulated:
    monkeypatch.setattr(cuda_ops, "_emulation", emulated)
    emulated.widths.clear()
    return emulated


def run_decode(case, num_partitions=None):
    n = case.meta.num_decode_tokens
    out = torch.full_like(case.query, float("nan"))  # poisoned: every row must be written
    cuda_ops.decode_attention(case.query, case.k_cache, case.v_cache, case.meta.block_tables,
                              case.meta.context_lens, case.scale, num_seqs=n, max_context_len=case.meta.max_seqlen_k,
                              out=out, num_partitions=num_partitions)
    return out[:n]


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
def test_decode_head_dims_and_dtypes(emu: Emulated, dtype: torch.dtype, head_dim: int) -> None:
    case = make_case(context_lens=ragged_context_lens(16), num_kv_heads=2, group=4, head_dim=head_dim,
                     block_size=16, dtype=dtype, seed=head_dim)
    err = relative_error(run_decode(case), reference(case))
    assert err < TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("block_size", [16, 256])
def test_decode_gqa_groups_and_block_sizes(emu: Emulated, group: int, block_size: int) -> None:
    # group 3 runs on the 4-head kernel with one head idle, 16 on two CTAs of 8 heads.
    case = make_case(context_lens=ragged_context_lens(block_size), num_kv_heads=2, group=group, head_dim=32,
                     block_size=block_size, dtype=torch.float32, seed=group)
    err = relative_error(run_decode(case), reference(case))
    assert err < TOL[torch.float32], f"relative error {err:.2e}"


@pytest.mark.parametrize("num_partitions", [2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_split_kv_forced(emu: Emulated, num_partitions: int, dtype: torch.dtype) -> None:
    # Lengths below num_partitions * tile leave some partitions empty; 300 spans several tiles each.
    case = make_case(context_lens=[1, 15, 16, 33, 300], num_kv_heads=2, group=2, head_dim=64, block_size=16,
                     dtype=dtype, seed=num_partitions)
    ref = reference(case)
    err = relative_error(run_decode(case, num_partitions=num_partitions), ref)
    assert err < TOL[dtype], f"relative error {err:.2e}"


def test_decode_split_kv_more_partitions_than_reduce_threads(emu: Emulated) -> None:
    # 200 partitions: the combine's first 72 threads take two each; the 9000-token context fills 141
    # of them (64 tokens each), the shorter ones leave most empty.
    case = make_case(context_lens=[1, 300, 9000], num_kv_heads=1, group=2, head_dim=32, block_size=16,
                     dtype=torch.float32, seed=11)
    err = relative_error(run_decode(case, num_partitions=200), reference(case))
    assert err < TOL[torch.float32], f"relative error {err:.2e}"


def test_decode_split_kv_chosen_for_long_context_small_batch(emu: Emulated) -> None:
    assert cuda_ops.choose_num_partitions(1, 8, 2, 1500, cuda_ops.EMULATED_NUM_SMS) > 1
    case = make_case(context_lens=[1500], num_kv_heads=2, group=2, head_dim=32, block_size=16,
                     dtype=torch.float32, seed=3)
    err = relative_error(run_decode(case), reference(case))
    assert err < TOL[torch.float32]


def test_decode_zero_context_rows_are_zero(emu: Emulated) -> None:
    # What CUDA-graph padding rows look like: context 0, a dummy block table row.
    case = make_case(context_lens=[5, 40], num_kv_heads=2, group=2, head_dim=32, block_size=16,
                     dtype=torch.float32, seed=4)
    ref = reference(case)
    case.meta.context_lens[1] = 0
    for parts in (None, 3):
        out = run_decode(case, num_partitions=parts)
        assert torch.all(out[1] == 0)
        assert relative_error(out[:1], ref[:1]) < 1e-5


def test_decode_strided_query_and_out(emu: Emulated) -> None:
    # Row-strided views (e.g. query as a slice of a fused projection) are read through their strides.
    case = make_case(context_lens=[7, 20], num_kv_heads=1, group=4, head_dim=32, block_size=16,
                     dtype=torch.float32, seed=5)
    wide = torch.randn(2, 4, 96)
    wide[:, :, 32:64] = case.query
    case.query = wide[:, :, 32:64]
    out_wide = torch.full((2, 4, 64), float("nan"))
    out = out_wide[:, :, 16:48]
    cuda_ops.decode_attention(case.query, case.k_cache, case.v_cache, case.meta.block_tables,
                              case.meta.context_lens, case.scale, out=out)
    assert relative_error(out, reference(case)) < 1e-5
    assert torch.isnan(out_wide[:, :, :16]).all() and torch.isnan(out_wide[:, :, 48:]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_cache_write_matches_reference(emu: Emulated, dtype: torch.dtype, head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, kv_heads, tokens = 6, 16, 2, 11
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    # key/value as column slices of one fused [tokens, (4 + 2 + 2) heads * D] projection, like qkv.
    qkv = torch.randn(tokens, 8 * head_dim, generator=g).to(dtype)
    key = qkv[:, 4 * head_dim:6 * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, 6 * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([0, 17, -1, 95, 16, 31, -1, 50, 2, 80, 64], dtype=torch.int32)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    from nanovllm.attention import torch_backend

    torch_backend.write_kv_cache(key, value, ref_k, ref_v, slots)
    cuda_ops.write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert emu.widths == [16]


def test_cache_write_unaligned_rows_fall_back_to_narrower_accesses(emu: Emulated) -> None:
    # The decode kernel needs 16-byte cache rows, so the wrapper rejects others (head_dim 20 fp16:
    # 40-byte rows) ...
    k_cache = torch.randn(2, 4, 1, 24).half()[..., :20]
    v_cache = torch.randn(2, 4, 1, 20).half()
    with pytest.raises(ValueError, match="16-byte"):
        cuda_ops.write_kv_cache(torch.randn(3, 1, 20).half(), torch.randn(3, 1, 20).half(), k_cache, v_cache,
                                torch.tensor([0, 5, 7], dtype=torch.int32))
    # ... but key/value rows only need element alignment: the copy narrows its accesses.
    k_cache = torch.randn(2, 4, 1, 16).half()
    v_cache = torch.randn(2, 4, 1, 16).half()
    fused = torch.randn(3, 1, 40).half()
    key, value = fused[:, :, 4:20], fused[:, :, 22:38]  # 8- and 4-byte aligned rows
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    from nanovllm.attention import torch_backend

    torch_backend.write_kv_cache(key, value, ref_k, ref_v, torch.tensor([0, 5, 7], dtype=torch.int32))
    cuda_ops.write_kv_cache(key, value, k_cache, v_cache, torch.tensor([0, 5, 7], dtype=torch.int32))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert emu.widths == [4]


def test_cuda_backend_mixed_batch_matches_reference(emu: Emulated) -> None:
    """The backend entry point: decodes through the (emulated) kernel, prefill chunks through the
    first available prefill path (the torch reference here, without triton and flash-attn)."""
    pytest.importorskip("nanovllm._kernels")
    from nanovllm.attention import cuda_backend

    case = make_case(context_lens=[9, 16, 7, 30, 1], q_lens=[1, 1, 7, 5, 1], num_decode=2, num_kv_heads=2, group=2,
                     head_dim=32, block_size=16, dtype=torch.float32, seed=6)
    out = cuda_backend.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    assert relative_error(out, reference(case)) < 1e-5


def test_engine_greedy_with_emulated_cuda_backend_matches_transformers(
        emu: Emulated, tmp_path: Path) -> None:
    """The whole engine with the model on the `cuda` backend (cache write and decode through the
    emulated kernels, prefill through the reference): chunked prefill, mixed steps, GQA."""
    pytest.importorskip("nanovllm._kernels")
    from engine_helpers import hf_greedy, random_prompts
    from tiny_models import make_tiny_model

    from nanovllm import LLM, SamplingParams

    path = make_tiny_model(tmp_path, "qwen3")
    llm = LLM(str(path), device="cpu", num_kvcache_blocks=32, block_size=16, max_model_len=256,
              max_num_batched_tokens=24, max_num_seqs=3)
    llm.engine.executor.runner.model.set_attention_backend("cuda")
    prompts = random_prompts([5, 17, 40], 512, seed=1)
    eos = llm.get_tokenizer().eos_token_id
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8, eos), f"prompt of {len(prompt)} tokens"


class EagerReplay:
    """Stands in for a captured CUDA graph: replay() runs the decode forward over the static
    buffers, exactly what the captured graph would replay."""

    def __init__(self, graphs, bs: int) -> None:
        self.graphs, self.bs = graphs, bs

    def replay(self) -> None:
        g, bs = self.graphs, self.bs
        g.hidden[:bs] = g.model(g.input_ids[:bs], g.positions[:bs], g._meta(bs))


def test_engine_decode_graph_path_pads_batches_and_matches_transformers(
        emu: Emulated, tmp_path: Path) -> None:
    """The runner's CUDA-graph decode path without CUDA: static buffers, bucket padding (slot -1,
    context 0) and the reset of rows a larger batch left behind, through the emulated kernels."""
    pytest.importorskip("nanovllm._kernels")
    from engine_helpers import hf_greedy, random_prompts
    from tiny_models import make_tiny_model

    from nanovllm import LLM, SamplingParams
    from nanovllm.worker.cuda_graph import DecodeGraphs

    path = make_tiny_model(tmp_path, "llama")
    llm = LLM(str(path), device="cpu", num_kvcache_blocks=48, block_size=16, max_model_len=128, max_num_seqs=6)
    runner = llm.engine.executor.runner
    runner.model.set_attention_backend("cuda")
    graphs = DecodeGraphs(runner.model, device=runner.device, dtype=runner.dtype,
                          hidden_size=runner.model_config.hidden_size, max_num_seqs=runner.max_num_seqs,
                          max_model_len=runner.max_model_len, block_size=runner.block_size)
    assert graphs.buckets == [1, 2, 4, 6]
    graphs.graphs = {bs: EagerReplay(graphs, bs) for bs in graphs.buckets}
    replays: list[int] = []
    run = graphs.run

    def counting_run(v):
        replays.append(v.num_seqs)
        return run(v)

    graphs.run = counting_run
    runner.graphs = graphs
    prompts = random_prompts([3, 9, 14, 20, 6], 512, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 7, 9, 11)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, p.max_tokens, None)
    # Batches of 5 (bucket 6), 4, 3 (bucket 4), 2 and 1 all replayed.
    assert {5, 4, 3, 2, 1} <= set(replays), replays
