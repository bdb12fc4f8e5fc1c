"""A decoder's embedding lookup and layers as one C++ call per forward on the CPU
(`_cpu.DecoderStack`, csrc/cpu_decoder.h), where every layer runs on the kernels its Python forward
would call: our packed GEMMs (dense or int8 / int4), the fused RMSNorm and SiLU-and-mul, the CPU
backend's qkv_attention. The stack calls those kernels in the same order on the same inputs, so the
hidden states are the same bits; it saves the Python around them (~0.15 ms a layer a step: most of
a batch-1 decode step's time outside the kernels).

Mixture-of-experts layers run as the Python layer's one C++ call (the router's GEMM, then the
experts). Where anything differs (tensor parallelism, oneDNN-packed or activation-order weights,
experts the Python layer loops over, another attention backend, a norm of another epsilon) `build`
returns None and the model runs its layers in Python. A step whose tensors the kernels do not take
as they are does too (`run` returns None).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from nanovllm import _cpu
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.cpu import KERNEL_DTYPES
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import VocabParallelEmbedding
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import LinearBase
from nanovllm.layers.rotary_embedding import RotaryEmbedding


@dataclasses.dataclass(frozen=True)
class StackLayer:
    """The modules of one decoder layer the stack reads (models/decoder.py's DecoderLayer): its MLP
    dense (gate_up, down) or a mixture of experts (router, experts)."""
    qkv: LinearBase
    o: LinearBase
    gate_up: LinearBase | None
    down: LinearBase | None
    router: LinearBase | None
    experts: FusedMoE | None
    input_norm: RMSNorm
    post_norm: RMSNorm
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    rotary: RotaryEmbedding
    attn: Attention


@dataclasses.dataclass(frozen=True)
class CpuStack:
    stack: _cpu.DecoderStack
    dtype: torch.dtype
    hidden: int
    keep: tuple[torch.Tensor, ...]  # tensors whose memory the stack points at besides the modules'


def caches(layers: list[StackLayer]) -> list[torch.Tensor]:
    """What the stack points at of the KV cache: every layer's K and V."""
    return [c for layer in layers for c in (layer.attn.k_cache, layer.attn.v_cache)]


def cache_refs(layers: list[StackLayer]) -> tuple[weakref.ref[torch.Tensor], ...]:
    """Weak references to the caches a stack is built on (no hold on their memory)."""
    return tuple(weakref.ref(c) for c in caches(layers))


def same_caches(refs: tuple[weakref.ref[torch.Tensor], ...], layers: list[StackLayer]) -> bool:
    """Whether the layers still hold the cache tensors `refs` were taken of: a tensor that lives keeps
    its memory (the caches are never resized), so the stack's pointers hold. Checked every step, as
    object identities: no torch call (each costs microseconds on a decode step's cold caches)."""
    return all(r() is c for r, c in zip(refs, caches(layers), strict=True))


def _is_kernel_tensor(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return t.is_cpu and t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous()


def build(layers: list[StackLayer], final_norm: RMSNorm, embedding: VocabParallelEmbedding) -> CpuStack | None:
    """The stack for these layers, or None where any of them would not run on the kernels it calls
    (see the module's docstring)."""
    inter = {layer.down.input_size for layer in layers if layer.down is not None}
    if not layers or len(inter) > 1:
        return None
    dtype = final_norm.weight.dtype
    first = layers[0].attn
    heads, kv_heads, dim = first.num_heads, first.num_kv_heads, first.head_dim
    hidden, eps = final_norm.weight.shape[0], final_norm.eps
    if dtype not in KERNEL_DTYPES or not final_norm.weight.is_cpu:
        return None
    table = embedding.weight
    if embedding.tp is not None or not _is_kernel_tensor(table, dtype, (embedding.vocab_size, hidden)):
        return None
    k_shape = tuple(first.k_cache.shape)
    if len(k_shape) != 4 or k_shape[2:] != (kv_heads, dim) or dim % 2 or dim > 1024:
        return None
    out: list[_cpu.DecoderLayer] = []
    keep: list[torch.Tensor] = []
    for layer in layers:
        a = layer.attn
        if (getattr(a.backend, "qkv_attention", None) is None or (a.num_heads, a.num_kv_heads, a.head_dim, a.scale)
                != (heads, kv_heads, dim, first.scale)):
            return None
        if not all(_is_kernel_tensor(c, dtype, k_shape) for c in (a.k_cache, a.v_cache)):
            return None
        if (layer.q_norm is None) != (layer.k_norm is None):
            return None
        norms = [(layer.input_norm, hidden), (layer.post_norm, hidden)]
        norms += [(n, dim) for n in (layer.q_norm, layer.k_norm) if n is not None]
        if any(n.eps != eps or not _is_kernel_tensor(n.weight, dtype, (size,)) for n, size in norms):
            return None
        inv_freq = layer.rotary.inv_freq
        if not _is_kernel_tensor(inv_freq, torch.float32, (dim // 2,)):
            return None
        mlp = (layer.gate_up, layer.down) if layer.experts is None else (layer.router,)
        linears = [lin.stack_linear(dtype) if lin is not None else None for lin in (layer.qkv, layer.o, *mlp)]
        if any(w is None for w in linears):
            return None
        keep += [b for _, b in linears if b is not None]  # type: ignore[misc]
        ws = [w for w, _ in linears]  # type: ignore[misc]
        moe = None
        if layer.experts is not None:
            moe = layer.experts.stack_experts(ws[2], dtype)
            if moe is None:
                return None
        out.append(_cpu.DecoderLayer(
            ws[0], ws[1], ws[2] if moe is None else None, ws[3] if moe is None else None,
            layer.input_norm.weight.data_ptr(), layer.post_norm.weight.data_ptr(),
            0 if layer.q_norm is None else layer.q_norm.weight.data_ptr(),
            0 if layer.k_norm is None else layer.k_norm.weight.data_ptr(),
            inv_freq.data_ptr(), a.k_cache.data_ptr(), a.v_cache.data_ptr(), moe))
    stack = _cpu.DecoderStack(KERNEL_DTYPES[dtype], hidden, heads, kv_heads, dim, inter.pop() if inter else 1, eps,
                              first.scale, k_shape[1], k_shape[0], out, final_norm.weight.data_ptr(),
                              table.data_ptr(), table.shape[0])
    return CpuStack(stack, dtype, hidden, tuple(keep))


def run(s: CpuStack, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
    """The final norm's output `[T, hidden]` for the tokens `input_ids` `[T]` (int32, as the plan's;
    embedded by the stack), writing the step's K/V; None where the step's tensors are not what the
    kernels take (the caller then runs the embedding and the layers in Python, which raise the
    errors for bad input)."""
    tokens = input_ids.shape[0] if input_ids.dim() == 1 else -1
    n = meta.num_seqs
    if (n == 0 or not _is_kernel_tensor(input_ids, torch.int32, (tokens,))
            or not _is_kernel_tensor(positions, torch.int32, (tokens,)) or meta.slot_mapping.shape[0] > tokens):
        return None
    for t in (meta.slot_mapping, meta.block_tables, meta.context_lens, meta.cu_seqlens_q):
        if t.dtype != torch.int32 or not t.is_contiguous() or not t.is_cpu:
            return None
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] < n or meta.cu_seqlens_q.shape[0] < n + 1:
        return None
    out = torch.empty((tokens, s.hidden), dtype=s.dtype)
    s.stack.forward(input_ids.data_ptr(), out.data_ptr(), positions.data_ptr(), meta.slot_mapping.data_ptr(),
                    meta.slot_mapping.shape[0], meta.block_tables.data_ptr(), meta.block_tables.shape[1],
                    meta.context_lens.data_ptr(), meta.cu_seqlens_q.data_ptr(), n, tokens, torch.get_num_threads())
    return out
