"""The fast CPU backend (one C++ call for decode rows and prefill chunks, fp32 and bf16) against the
torch reference, on random caches with shuffled block tables, GQA and ragged context lengths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model
from tiny_pager import TinyPager

from nanovllm.attention import cpu_backend, torch_backend
from nanovllm.attention.metadata import make_attention_metadata
from nanovllm.cpu import fused_ops
from nanovllm.layers import bind_kv_cache
from nanovllm.models import load_model

# bf16 inputs, fp32 accumulation on both sides: the outputs differ by the final rounding to bf16
# (2^-8 relative) plus summation order.
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}


def random_case(seed: int, q_lens: list[int], ctx_lens: list[int], heads: int, kv_heads: int, dim: int,
                block_size: int, dtype: torch.dtype = torch.float32):  # noqa: ANN202
    """Sequences in the given order (decodes must come first); every context's K/V already cached."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, start = [], 0
    for b in blocks_needed:
        tables.append(perm[start:start + b])
        start += b
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    query = torch.randn(sum(q_lens), heads, dim, generator=g).to(dtype)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    slots = [tables[i][p // block_size] * block_size + p % block_size
             for i, (q, c) in enumerate(zip(q_lens, ctx_lens)) for p in range(c - q, c)]
    meta = make_attention_metadata(slot_mapping=slots, cu_seqlens_q=cu, context_lens=ctx_lens, block_tables=tables,
                                   num_decode_tokens=sum(1 for q in q_lens if q == 1), block_size=block_size)
    return query, k_cache, v_cache, meta


def assert_matches_reference(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> None:  # noqa: ANN001
    ours = cpu_backend.paged_attention(query, k, v, meta, scale)
    ref = torch_backend.paged_attention(query, k, v, meta, scale)
    assert ours.dtype == query.dtype
    torch.testing.assert_close(ours, ref, **TOL[query.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"),
                         # The AVX2 value tiles take a head's 1, 2, 3 or 4 vectors with 64, 32, 32 or 16 columns at
                         # a time, then 32, then eight at a time; the AVX-512 ones (head_dim a multiple of 16, on
                         # AVX512-BF16 CPUs) 1 or 2 vectors with 128, 3 or 4 with 64, then 64, then sixteen at a
                         # time, and score two vectors at once: groups 1 to 5, head_dims that leave columns over.
                         [(4, 4, 32, 16), (8, 4, 48, 16), (12, 4, 40, 8), (8, 2, 64, 16), (16, 2, 128, 4),
                          (6, 3, 20, 256), (4, 1, 7, 1), (10, 2, 80, 8), (4, 2, 128, 16), (3, 3, 144, 16),
                          # blocks the tiles walk 16 rows at a time (vLLM's CPU default 128), or whole (24)
                          (8, 2, 64, 128), (8, 4, 64, 48), (4, 2, 32, 24)])
def test_decode_matches_reference(heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype) -> None:
    ctx = [1, block_size, block_size + 1, 3 * block_size, 37, 2]
    query, k, v, meta = random_case(1, [1] * len(ctx), ctx, heads, kv_heads, dim, block_size, dtype)
    assert_matches_reference(query, k, v, meta, 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 4, 32), (6, 3, 64), (4, 1, 16), (4, 4, 20)])
def test_few_decode_rows_split_their_heads_over_threads(heads: int, kv_heads: int, dim: int, threads: int,
                                                        dtype: torch.dtype) -> None:
    """Fewer decode rows than threads: each row's KV heads are cut into consecutive ranges, one task
    each (uneven when the threads do not divide them; never more ranges than heads), on the tiles'
    path and the portable one (a step's only row on the tiles' path is cut by keys instead); the
    same output whatever the thread count."""
    rows = [1] if threads == 2 else [1, 1]  # one row on two threads; two rows on three or five
    query, k, v, meta = random_case(7, rows, [300, 41][:len(rows)], heads, kv_heads, dim, 16, dtype)
    ref = torch_backend.paged_attention(query, k, v, meta, dim**-0.5)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_backend.paged_attention(query, k, v, meta, dim**-0.5)
        torch.set_num_threads(threads)
        split = cpu_backend.paged_attention(query, k, v, meta, dim**-0.5)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(split, ref, **TOL[dtype])
    assert torch.equal(split, one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("ctx", "block_size"), [(255, 16), (256, 16), (257, 16), (1000, 16), (3000, 16), (130, 8),
                                                 (2 * 8 * 256 + 1, 256), (100, 16), (300, 128), (2000, 128),
                                                 (1000, 48), (700, 24)])
def test_a_lone_decode_row_split_by_keys(ctx: int, block_size: int, dtype: torch.dtype) -> None:
    """A step's only row, a decode, is cut into 1, 2, 4 or 8 parts of its keys (at least 8 chunks
    of 16 keys each, or of a block where 16 does not divide it, so parts may end within a block; the
    last part shorter), whose partial softmaxes are merged: the reference's output, and the same bits
    on 1, 2 or 3 threads (the parts do not depend on the thread count)."""
    query, k, v, meta = random_case(11, [1], [ctx], 8, 2, 64, block_size, dtype)
    ref = torch_backend.paged_attention(query, k, v, meta, 0.125)
    previous = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(cpu_backend.paged_attention(query, k, v, meta, 0.125))
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(outs[0], ref, **TOL[dtype])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "heads", "kv_heads", "dim"), [(4, 8, 2, 128), (8, 4, 2, 64), (65, 4, 2, 64)])
def test_verification_rows_get_decode_rows_bits(rows: int, heads: int, kv_heads: int, dim: int,
                                                dtype: torch.dtype) -> None:
    """A speculative verification's rows (a sequence of up to 65 query rows) attend as the same rows
    decoded one at a time, bit for bit: greedy speculation must give decoding's tokens. (On a CPU
    with AMX tiles such a bf16 task of 16 or more query vectors a KV head went to the tiles, which
    round the softmax weights to bf16.)"""
    ctx, bs = 300, 16
    query, k, v, meta = random_case(5, [rows], [ctx], heads, kv_heads, dim, bs, dtype)
    table = meta.block_tables[0].tolist()
    lens = [ctx - rows + 1 + j for j in range(rows)]
    decoded = make_attention_metadata(slot_mapping=[-1] * rows, cu_seqlens_q=list(range(rows + 1)), context_lens=lens,
                                      block_tables=[table] * rows, num_decode_tokens=rows, block_size=bs)
    together = cpu_backend.paged_attention(query, k, v, meta, dim**-0.5)
    one_by_one = cpu_backend.paged_attention(query, k, v, decoded, dim**-0.5)
    torch.testing.assert_close(together, torch_backend.paged_attention(query, k, v, meta, dim**-0.5), **TOL[dtype])
    assert torch.equal(together, one_by_one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 256])
def test_one_sequence_reads_only_its_own_blocks(block_size: int, dtype: torch.dtype) -> None:
    """One sequence a call, its block table exactly its blocks: decodes shorter than eight keys, than
    a block, of several blocks and in key parts, and prefill chunks, on 1 to 3 threads (heads split
    between threads where the row is short), against the reference. scripts/sanitize_core.sh runs
    this under AddressSanitizer, where a read of the table past the sequence's blocks (the kernel
    asks for rows ahead of the ones it reads) fails."""
    cases = [(1, 1), (5, 1), (9, 1), (block_size, 1), (block_size + 3, 1), (3 * block_size + 5, 1),
             (20 * block_size + 1, 1), (7, 7), (40, 13), (3 * block_size + 5, block_size + 2)]
    previous = torch.get_num_threads()
    try:
        for ctx, q in cases:
            query, k, v, meta = random_case(ctx, [q], [ctx], 8, 2, 64, block_size, dtype)
            assert tuple(meta.block_tables.shape) == (1, -(-ctx // block_size))
            ref = torch_backend.paged_attention(query, k, v, meta, 0.125)
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                torch.testing.assert_close(cpu_backend.paged_attention(query, k, v, meta, 0.125), ref, **TOL[dtype])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# head_dim and block_size multiples of 8 take the AVX2 score tiles (on a CPU with AVX2; bf16 with
# head_dim a multiple of 32 the AVX512-BF16 scores where the CPU has them), the others the portable
# loops.
@pytest.mark.parametrize(("dim", "block_size"), [(64, 16), (64, 256), (20, 16), (64, 12)],
                         ids=["tiles_bs16", "tiles_bs256", "portable_dim20", "portable_bs12"])
def test_mixed_decode_and_prefill_chunks_match_reference(dim: int, block_size: int, dtype: torch.dtype) -> None:
    # Decodes first, as the core lays out a batch; then a fresh prompt, chunks after a cached prefix
    # (a prefix hit or an earlier chunk: the kernel cannot tell them apart), one longer than a
    # task's tile of query rows and crossing blocks, and a one-token chunk after a long prefix.
    q_lens = [1, 1, 1, 5, 9, 70, 300, 2]
    ctx = [17, 3, 290, 5, 30, 100, 333, 260]
    query, k, v, meta = random_case(2, q_lens, ctx, 8, 2, dim, block_size, dtype)
    assert_matches_reference(query, k, v, meta, 0.125)


def test_padding_rows_are_zero_and_no_sequences_is_fine() -> None:
    query, k, v, meta = random_case(4, [1, 3], [4, 9], 4, 2, 8, 4)
    padded = torch.cat([query, torch.randn(2, 4, 8)])
    out = cpu_backend.paged_attention(padded, k, v, meta, 1.0)
    torch.testing.assert_close(out[:4], torch_backend.paged_attention(query, k, v, meta, 1.0), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[4:], torch.zeros(2, 4, 8))
    empty = make_attention_metadata(slot_mapping=[], cu_seqlens_q=[0], context_lens=[], block_tables=[],
                                    num_decode_tokens=0, block_size=4)
    assert cpu_backend.paged_attention(query[:0], k, v, empty, 1.0).shape == (0, 4, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(6, 4, 2, 8, generator=g).to(dtype) for _ in range(2))
    caches = [k_cache, v_cache, k_cache.clone(), v_cache.clone()]
    qkv = torch.randn(5, 3 * 16, generator=g).to(dtype)  # key and value as strided views, as the model passes them
    key, value = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([3, -1, 17, 0], dtype=torch.int32)  # one skipped, the fifth row is padding
    cpu_backend.write_kv_cache(key, value, caches[0], caches[1], slots)
    torch_backend.write_kv_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_rejects_bad_tensors_before_running() -> None:
    query, k, v, meta = random_case(3, [1, 1], [4, 9], 4, 2, 8, 4)
    with pytest.raises(ValueError, match="k_cache"):
        cpu_backend.paged_attention(query, k.transpose(1, 2), v, meta, 1.0)
    with pytest.raises(ValueError, match="k_cache"):
        cpu_backend.paged_attention(query, k.bfloat16(), v, meta, 1.0)  # caches not in the query's dtype
    meta.block_tables = meta.block_tables.long()
    with pytest.raises(ValueError, match="block_tables"):
        cpu_backend.paged_attention(query, k, v, meta, 1.0)
    meta.block_tables = meta.block_tables.int()
    meta.block_tables[1, 0] = k.shape[0]
    with pytest.raises(IndexError, match="not a block"):
        cpu_backend.paged_attention(query, k, v, meta, 1.0)
    with pytest.raises(IndexError, match="not a slot"):
        cpu_backend.write_kv_cache(query[:, :2], query[:, :2], k, v, torch.tensor([0, 4 * k.shape[0]], dtype=torch.int32))


def test_other_dtypes_use_the_reference() -> None:
    query, k, v, meta = random_case(6, [1, 4], [5, 4], 4, 2, 8, 4, torch.float16)
    assert torch.equal(cpu_backend.paged_attention(query, k, v, meta, 0.5),
                       torch_backend.paged_attention(query, k, v, meta, 0.5))


def separate_steps(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, norms, k_cache, v_cache,  # noqa: ANN001
                   meta, scale: float, heads: int, kv_heads: int) -> torch.Tensor:
    """What the decoder layer runs without qkv_attention: split, q/k norm, rotary, the KV write, attention."""
    dim = k_cache.shape[-1]
    t = qkv.shape[0]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.reshape(t, heads, dim), k.reshape(t, kv_heads, dim), v.reshape(t, kv_heads, dim)
    if norms is not None:
        q, k = fused_ops.rms_norm(q, norms[0], norms[2]), fused_ops.rms_norm(k, norms[1], norms[2])
    fused_ops.rotary_(positions, q, k, inv_freq)
    cpu_backend.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    return cpu_backend.paged_attention(q, k_cache, v_cache, meta, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("dim", [64, 20], ids=["tiles", "portable"])
def test_qkv_attention_is_the_separate_steps_bit_for_bit(dtype: torch.dtype, qk_norm: bool, dim: int) -> None:
    """One call from the qkv rows (a strided view, as the projection's output may be; two padding rows
    past the slot mapping) gives the same output and caches as the six steps it replaces."""
    heads, kv_heads = 8, 2
    q_lens, ctx = [1, 1, 5, 40], [17, 290, 30, 100]
    _, k_cache, v_cache, meta = random_case(3, q_lens, ctx, heads, kv_heads, dim, 16, dtype)
    g = torch.Generator().manual_seed(4)
    tokens = sum(q_lens) + 2
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(tokens, width + 8, generator=g).to(dtype)[:, :width]
    positions = torch.tensor([p for q, c in zip(q_lens, ctx) for p in range(c - q, c)] + [0, 0], dtype=torch.int32)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    norms = (torch.rand(dim, generator=g).to(dtype) + 0.5, torch.rand(dim, generator=g).to(dtype) + 0.5, 1e-6)
    norms = norms if qk_norm else None
    caches = [k_cache.clone(), v_cache.clone()]
    ref = separate_steps(qkv.clone(), positions, inv_freq, norms, caches[0], caches[1], meta, 0.125, heads, kv_heads)
    out = cpu_backend.qkv_attention(qkv, positions, inv_freq, norms, k_cache, v_cache, meta, 0.125, heads, kv_heads)
    assert out is not None
    assert torch.equal(out, ref) and torch.equal(out[-2:], torch.zeros_like(out[-2:]))
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])


def test_qkv_attention_declines_what_its_kernels_do_not_take_and_checks_the_rest() -> None:
    _, k_cache, v_cache, meta = random_case(5, [1, 3], [4, 9], 4, 2, 8, 4)
    qkv = torch.randn(4, 8 * 8)
    positions = torch.tensor([3, 6, 7, 8], dtype=torch.int32)
    inv_freq = torch.ones(4)
    run = lambda qkv, positions, inv_freq, norms=None: cpu_backend.qkv_attention(  # noqa: E731
        qkv, positions, inv_freq, norms, k_cache, v_cache, meta, 1.0, 4, 2)
    assert run(qkv, positions, inv_freq) is not None
    # Declined (the separate steps then run, and raise where the input is wrong): other dtypes,
    # int64 positions, a qkv whose columns are not contiguous, norm weights of another dtype.
    assert run(qkv.half(), positions, inv_freq) is None
    assert run(qkv, positions.long(), inv_freq) is None
    assert run(torch.randn(64, 4).t(), positions, inv_freq) is None
    assert run(torch.randn(1, 64).expand(4, 64), positions, inv_freq) is None  # rows overlap
    assert run(qkv, positions, inv_freq, (torch.ones(8).bfloat16(), torch.ones(8).bfloat16(), 1e-6)) is None
    # What only the kernel can see, checked at the binding before anything is written.
    meta.slot_mapping[1] = k_cache.shape[0] * k_cache.shape[1]
    before = k_cache.clone()
    with pytest.raises(IndexError, match="not a slot"):
        run(qkv, positions, inv_freq)
    assert torch.equal(k_cache, before)
    meta.slot_mapping[1] = 0
    meta.block_tables[1, 0] = k_cache.shape[0]
    with pytest.raises(IndexError, match="not a block"):
        run(qkv, positions, inv_freq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_models_take_the_one_call_path_with_the_same_logits(name: str, dtype: torch.dtype, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3 (q/k norm) and Llama (none) fed chunk by chunk through the CPU backend give the
    same logits with and without qkv_attention, and every layer's attention took the one call."""
    path = make_tiny_model(tmp_path, name)
    model, config = load_model(path, dtype=str(dtype).removeprefix("torch."), attn_backend="cpu")
    tokens = torch.randint(0, config.vocab_size, (30,), generator=torch.Generator().manual_seed(0)).tolist()

    def logits() -> torch.Tensor:
        bind_kv_cache(model, torch.zeros(2, config.num_hidden_layers, 32, 4, config.num_key_value_heads,
                                         config.head_dim, dtype=dtype))
        pager = TinyPager(32, 4, seed=1)
        out, done = [], 0
        for n in [13, 14, 1, 1, 1]:
            batch = pager.step([(0, tokens[done:done + n])])
            done += n
            with torch.no_grad():
                hidden = model(batch.input_ids, batch.positions.int(), batch.meta)
            out.append(model.compute_logits(hidden))
        return torch.cat(out)

    took: list[bool] = []
    fused = cpu_backend.qkv_attention

    def counted(*args):  # noqa: ANN002, ANN202
        out = fused(*args)
        took.append(out is not None)
        return out

    monkeypatch.setattr(cpu_backend, "qkv_attention", counted)
    one_call = logits()
    assert took == [True] * (5 * config.num_hidden_layers)
    monkeypatch.delattr(cpu_backend, "qkv_attention")
    assert torch.equal(one_call, logits())
