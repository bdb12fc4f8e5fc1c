"""Random paged-attention inputs for the kernel tests (CUDA, and the CPU emulation of the kernels).

Values are random normals (never zeros, so a kernel that skips work cannot pass by accident), block
tables are shuffled so that neighbouring blocks of a sequence are far apart in the cache, and the
torch backend is the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.attention import make_attention_metadata
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention import torch_backend


def ragged_context_lens(block_size: int, long: int = 0) -> list[int]:
    """Context lengths covering the edge cases: 1, block_size - 1, exact multiples of the block
    size, one past a multiple, and optionally a long one (split-KV territory)."""
    lens = [1, block_size - 1, block_size, 2 * block_size, 2 * block_size + 1, 37, 3]
    if long:
        lens.append(long)
    return [n for n in lens if n >= 1]


@dataclass
class PagedCase:
    query: torch.Tensor  # [num_tokens, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| over the tensor (what the tolerances are stated in)."""
    ref = ref.double()
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def make_case(*, context_lens: list[int], q_lens: list[int] | None = None, num_decode: int | None = None,
              num_kv_heads: int, group: int, head_dim: int, block_size: int, dtype: torch.dtype,
              device: torch.device | str = "cpu", seed: int = 0, spare_blocks: int = 3) -> PagedCase:
    """A batch with every sequence's full context already in the cache.

    `q_lens` default to 1 (all decodes); `num_decode` sequences (default: those with q_len 1 at the
    front) are decodes. The cache holds the blocks the batch needs plus `spare_blocks`, in shuffled
    order, all filled with random values (so unused slots hold garbage a wrong index would read).
    """
    g = torch.Generator().manual_seed(seed)
    q_lens = q_lens or [1] * len(context_lens)
    if num_decode is None:
        num_decode = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
    needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in needed:
        tables.append([perm.pop() for _ in range(n)])
    num_heads = num_kv_heads * group
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    query = torch.randn(cu[-1], num_heads, head_dim, generator=g).to(dtype)
    meta = make_attention_metadata(slot_mapping=[-1] * cu[-1], cu_seqlens_q=cu, context_lens=context_lens,
                                   block_tables=tables, num_decode_tokens=num_decode, block_size=block_size,
                                   device=device)
    return PagedCase(query.to(device), k_cache.to(device), v_cache.to(device), meta, head_dim**-0.5)


def reference(case: PagedCase) -> torch.Tensor:
    """The torch backend's output, computed on the CPU in fp32 from the same inputs."""
    m = case.meta
    host_meta = AttentionMetadata(
        slot_mapping=m.slot_mapping.cpu(), cu_seqlens_q=m.cu_seqlens_q.cpu(), cu_seqlens_k=m.cu_seqlens_k.cpu(),
        context_lens=m.context_lens.cpu(), block_tables=m.block_tables.cpu(), max_seqlen_q=m.max_seqlen_q,
        max_seqlen_k=m.max_seqlen_k, num_prefill_tokens=m.num_prefill_tokens, num_decode_tokens=m.num_decode_tokens,
        block_size=m.block_size, host=m.host)
    return torch_backend.paged_attention(case.query.cpu().float(), case.k_cache.cpu().float(),
                                         case.v_cache.cpu().float(), host_meta, case.scale)
