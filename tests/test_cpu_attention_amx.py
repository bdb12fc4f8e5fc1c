"""Prefill attention on AMX tiles (csrc/cpu_attention_amx.cpp): bf16 caches, head_dim a multiple of
64, tasks of 16 or more query vectors a KV head. Against the float64 softmax of the same bf16
values, within what the path rounds: each softmax weight to bf16 before its products (at most 2^-8
of it) and the output to bf16 (2^-8 of it)."""

from __future__ import annotations

import pytest
import torch
from test_cpu_attention import random_case

from nanovllm import _cpu
from nanovllm.attention import cpu_backend, torch_backend

pytestmark = pytest.mark.skipif(not _cpu.has_amx_bf16(), reason="this process has no AMX tiles")


def assert_within_rounding(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, scale: float) -> None:  # noqa: ANN001
    ours = cpu_backend.paged_attention(query, k, v, meta, scale).double()
    ref = torch_backend.paged_attention(query.double(), k.double(), v.double(), meta, scale)
    magnitude = torch_backend.paged_attention(query.double(), k.double(), v.double().abs(), meta, scale)  # sum p |v|
    bound = 2.0 ** -8 * (ref.abs() + 1.01 * magnitude) + 1e-5
    excess = (ours - ref).abs() - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} values past the rounding bound, worst by {excess.max():.3g}"


# GQA groups 2, 4, 1 and 3; head_dim 64 and 128; block sizes that are, and are not, multiples of the
# 16-key tiles. Rows: a lone decode (the vector path, in the same call), a fresh prompt shorter than
# a block of 16 vectors, chunks after cached prefixes (rows not a multiple of the group's rows per
# block), one longer than a task's 256 vectors, and a prompt whose last key tile is partial.
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"),
                         [(16, 8, 64, 16), (8, 2, 128, 12), (4, 4, 64, 256), (12, 4, 64, 16), (4, 2, 256, 16)])
def test_prefill_chunks_match_the_float64_softmax(heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    q_lens = [1, 5, 9, 70, 300, 33]
    ctx = [50, 5, 9, 100, 333, 1200]
    query, k, v, meta = random_case(3, q_lens, ctx, heads, kv_heads, dim, block_size, torch.bfloat16)
    assert_within_rounding(query, k, v, meta, dim ** -0.5)


def test_large_scores_and_one_dominant_key() -> None:
    """Scores tens of units apart (a scaled query), where exp underflows for all but the top keys:
    the max is taken before the exponentials, and the sums stay finite."""
    query, k, v, meta = random_case(5, [64, 17], [64, 400], 8, 4, 64, 16, torch.bfloat16)
    assert_within_rounding(query * 8, k, v, meta, 1.0)


def test_unwritten_cache_rows_do_not_leak_into_the_output() -> None:
    """Rows of a sequence's last block past its context hold whatever was there (NaN here): their
    keys are masked and their values gathered as zeros, so the output stays finite and unchanged."""
    query, k, v, meta = random_case(7, [40, 23], [40, 123], 8, 4, 64, 16, torch.bfloat16)
    clean = cpu_backend.paged_attention(query, k, v, meta, 0.125)
    k_nan, v_nan = k.clone(), v.clone()
    for seq, length in enumerate(meta.context_lens.tolist()):
        last = meta.block_tables[seq, (length - 1) // 16]
        k_nan[last, length % 16 or 16:] = float("nan")
        v_nan[last, length % 16 or 16:] = float("nan")
    assert torch.equal(cpu_backend.paged_attention(query, k_nan, v_nan, meta, 0.125), clean)
