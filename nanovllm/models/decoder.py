"""One decoder-only transformer shared by the Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral families.

They differ only in a few switches (`ArchFlags`): biases on the attention and MLP projections,
and Qwen3's per-head RMSNorm on q and k before rotary; and in each layer's MLP, dense or a mixture
of experts (`make_mlp`, models/moe.py). Module names mirror the Hugging Face
checkpoints (`model.layers.N.self_attn...`) so the loader maps tensors by name, except the packed
`qkv_proj` and `gate_up_proj`, described by `packed_modules_mapping`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nanovllm.layers.rotary_embedding import RotaryEmbedding, attention_factor
from nanovllm.model_config import ModelConfig
from nanovllm.models import cpu_stack

if TYPE_CHECKING:
    import weakref

    import numpy as np

    from nanovllm.distributed.parallel_state import TPGroup


@dataclass(frozen=True)
class ArchFlags:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before rotary


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, flags: ArchFlags, layer_idx: int, backend: str,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=flags.qkv_bias,
            tp=tp,
        )
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=flags.o_bias, tp=tp
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if flags.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.rope)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5 * attention_factor(config.rope) ** 2,
            layer_idx,
            backend,
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        t = hidden.shape[0]
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        # One call from qkv to the attention output where the backend has it (CPU): a decode step
        # at batch 1 spent more time in the Python of the six steps below than in their kernels.
        out = self.attn.forward_qkv(qkv, positions, self.rotary_emb.inv_freq, qk_norm, meta)
        if out is None:
            out = self._attend(qkv, positions, meta)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def _attend(self, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(qkv)
        t = qkv.shape[0]
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.attn(q, k, v, meta)


class DecoderMLP(nn.Module):
    def __init__(self, config: ModelConfig, flags: ArchFlags, tp: TPGroup | None = None) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=flags.mlp_bias, tp=tp
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=flags.mlp_bias, tp=tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


# Builds layer `layer_idx`'s MLP: the dense one, or a mixture of experts (models/moe.py).
MlpFactory = Callable[[ModelConfig, ArchFlags, int, "TPGroup | None"], nn.Module]


def dense_mlp(config: ModelConfig, flags: ArchFlags, layer_idx: int, tp: TPGroup | None) -> nn.Module:
    return DecoderMLP(config, flags, tp)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, flags: ArchFlags, layer_idx: int, backend: str,
                 tp: TPGroup | None = None, make_mlp: MlpFactory = dense_mlp) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, flags, layer_idx, backend, tp)
        self.mlp = make_mlp(config, flags, layer_idx, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream); the next layer's norm adds them (fused)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, flags: ArchFlags, backend: str, tp: TPGroup | None = None,
                 make_mlp: MlpFactory = dense_mlp) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, flags, i, backend, tp, make_mlp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # On the CPU, the layers as one C++ call (models/cpu_stack.py) where they all take its
        # kernels; False runs them in Python always (benchmarks that time the layers' parts).
        self.use_cpu_stack = True
        self._stack_parts: list[cpu_stack.StackLayer] | None = None  # once: the modules do not change
        # The stack and the KV cache tensors it was built on (cpu_stack.cache_refs); None: not yet built.
        self._stack: tuple[tuple[weakref.ref[torch.Tensor], ...], cpu_stack.CpuStack | None] | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        stack = self.layer_stack() if self.use_cpu_stack and input_ids.is_cpu else None
        if stack is not None:
            out = cpu_stack.run(stack, input_ids, positions, meta)
            if out is not None:
                return out
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        if residual is None:  # zero layers
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _stack_layers(self) -> list[cpu_stack.StackLayer]:
        """The stack's view of the layers; empty where an MLP is neither a dense one nor a router
        and its experts (models/moe.py's SparseMoeBlock: `experts(x, gate(x))`)."""
        layers = []
        for layer in self.layers:
            mlp, a = layer.mlp, layer.self_attn
            dense = isinstance(mlp, DecoderMLP)
            router, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
            if not dense and not (isinstance(router, LinearBase) and isinstance(experts, FusedMoE)):
                return []
            layers.append(cpu_stack.StackLayer(
                a.qkv_proj, a.o_proj, mlp.gate_up_proj if dense else None, mlp.down_proj if dense else None,
                None if dense else router, None if dense else experts, layer.input_layernorm,
                layer.post_attention_layernorm, a.q_norm, a.k_norm, a.rotary_emb, a.attn))
        return layers

    def forget_layer_stack(self) -> None:
        """Build the stack again at the next forward: the layers changed (their attention backend, or a
        rotary inv_freq in place: the stack compares the layers' once, when built)."""
        self._stack = None

    def layer_stack(self) -> cpu_stack.CpuStack | None:
        """The C++ stack of this model's layers for its current KV cache (built on first use, again
        when the cache changes), or None where the layers run in Python."""
        if self._stack_parts is None:
            self._stack_parts = self._stack_layers()
        layers = self._stack_parts
        if not layers or layers[0].attn.k_cache.numel() == 0:
            return None
        if self._stack is None or not cpu_stack.same_caches(self._stack[0], layers):
            before = self._stack[1] if self._stack is not None else None
            stack = cpu_stack.build(layers, self.norm, self.embed_tokens)
            if stack is not None and before is not None:
                stack.stack.adopt_buffers(before.stack)
            self._stack = (cpu_stack.cache_refs(layers), stack)
        return self._stack[1]


class DecoderForCausalLM(nn.Module):
    """`model(input_ids [T], positions [T], meta) -> hidden [T, H]`; `compute_logits(hidden [S, H])`.

    Under tensor parallelism (`tp`) each rank holds its shard of every layer and computes the same
    hidden states (the row-parallel layers all-reduce); logits come out on rank 0 only."""

    # checkpoint module name -> (our packed module name, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint tensors that are deliberately not loaded (name suffixes)
    ignored_checkpoint_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    # our module name -> the checkpoint's, where they differ (Mixtral's MoE block is `block_sparse_moe`)
    checkpoint_module_names: ClassVar[dict[str, str]] = {}

    def __init__(self, config: ModelConfig, flags: ArchFlags, attn_backend: str = "torch",
                 tp: TPGroup | None = None, make_mlp: MlpFactory = dense_mlp) -> None:
        super().__init__()
        self.config = config
        self.flags = flags
        self.model = DecoderModel(config, flags, attn_backend, tp, make_mlp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden `[S, H]` (rows already selected at sample_indices) -> fp32 logits `[S, vocab]`
        (None on a tensor-parallel rank other than 0)."""
        return self.lm_head.logits(hidden)

    def has_greedy_head(self) -> bool:
        """Whether `compute_greedy` can give tokens (ParallelLMHead.takes_greedy)."""
        return self.lm_head.takes_greedy()

    def compute_greedy(self, hidden: torch.Tensor) -> np.ndarray | None:
        """hidden `[S, H]` -> each row's greedy token, a host int32 array `[S]`, without the logits where
        the head can (ParallelLMHead.greedy); None where it cannot."""
        return self.lm_head.greedy(hidden)

    def set_attention_backend(self, name: str) -> None:
        for module in self.modules():
            if isinstance(module, Attention):
                module.set_backend(name)
        self.model.forget_layer_stack()  # built for the old backend (or declined for it)
