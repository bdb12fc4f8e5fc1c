"""ModelRunner: owns the model and the paged KV cache, and turns one StepPlan into sampled tokens.

Per step: the plan's arrays become tensors (one copy of the plan buffer), copy-on-write block
copies run before the forward, the model runs over the flattened batch, logits are computed only
at the sampled positions, and the sampler picks one token per sampled sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm import _C
from nanovllm.attention.metadata import AttentionMetadata, HostSeqLens
from nanovllm.engine.plan_tensors import PlanTensors, PlanViews
from nanovllm.layers.attention import bind_kv_cache
from nanovllm.layers.sampler import Sampler, SamplingBatch
from nanovllm.model_config import ModelConfig
from nanovllm.models.loader import load_model


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element


class ModelRunner:
    def __init__(self, model_dir: str, dtype: str | torch.dtype, device: torch.device, block_size: int) -> None:
        self.device = device
        # On CPU the fast backend (C++ decode kernel); the torch reference elsewhere until the
        # CUDA kernels take over.
        backend = "cpu" if device.type == "cpu" else "torch"
        self.model, self.config = load_model(model_dir, dtype=dtype, device=device, attn_backend=backend)
        self.model.eval()
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = block_size
        self.sampler = Sampler()
        self.kv_cache: torch.Tensor | None = None
        self._plan_tensors: PlanTensors | None = None

    @property
    def kv_spec(self) -> KVCacheSpec:
        c: ModelConfig = self.config
        return KVCacheSpec(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.block_size, self.dtype)

    def profile_num_blocks(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        """Blocks that fit in the GPU memory left after a forward at the maximum batch."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._dummy_forward(max_num_batched_tokens)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_now = total - free
        peak_extra = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        budget = int(total * gpu_memory_utilization) - used_now - peak_extra
        return max(0, budget // self.kv_spec.bytes_per_block)

    @torch.inference_mode()
    def _dummy_forward(self, num_tokens: int) -> None:
        """A prefill of `num_tokens` that writes no KV (every slot -1), for memory profiling."""
        dev = self.device
        num_blocks = -(-num_tokens // self.block_size)
        self.allocate_kv_cache(num_blocks)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            cu_seqlens_k=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None],
            max_seqlen_q=num_tokens, max_seqlen_k=num_tokens,
            num_prefill_tokens=num_tokens, num_decode_tokens=0, block_size=self.block_size,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int32, device=dev)
        positions = torch.arange(num_tokens, dtype=torch.int32, device=dev)
        hidden = self.model(ids, positions, meta)
        self.model.compute_logits(hidden[-1:])
        self.kv_cache = None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        s = self.kv_spec
        self.kv_cache = torch.zeros(
            (2, s.num_layers, num_blocks, s.block_size, s.num_kv_heads, s.head_dim), dtype=s.dtype, device=self.device
        )
        bind_kv_cache(self.model, self.kv_cache)

    def _views(self, plan: _C.StepPlan) -> PlanViews:
        if self._plan_tensors is None:
            self._plan_tensors = PlanTensors(plan)
        if self.device.type == "cpu":
            return self._plan_tensors.views(plan)
        return self._plan_tensors.to(self.device, plan)

    def _copy_blocks(self, copies: torch.Tensor) -> None:
        src, dst = copies[:, 0].long(), copies[:, 1].long()
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def forward(self, plan: _C.StepPlan) -> tuple[PlanViews, torch.Tensor]:
        """Copy-on-write copies, then the model over the flattened batch: (views, hidden states)."""
        v = self._views(plan)
        if v.num_copies:
            self._copy_blocks(v.block_copies)
        meta = AttentionMetadata(
            slot_mapping=v.slot_mapping, cu_seqlens_q=v.cu_seqlens_q, cu_seqlens_k=v.cu_seqlens_k,
            context_lens=v.context_lens, block_tables=v.block_tables, max_seqlen_q=v.max_seqlen_q,
            max_seqlen_k=v.max_seqlen_k, num_prefill_tokens=v.num_prefill_tokens,
            num_decode_tokens=v.num_decode_tokens, block_size=self.block_size,
            # Host copies, so a backend that needs lengths as ints never syncs with the device.
            host=HostSeqLens(cu_seqlens_q=plan.cu_seqlens_q, context_lens=plan.context_lens),
        )
        return v, self.model(v.input_ids, v.positions, meta)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the given hidden-state rows, [rows, vocab]."""
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
        return self.sampler(logits, sampling)

    @torch.inference_mode()
    def execute(self, plan: _C.StepPlan, sampling: SamplingBatch) -> np.ndarray:
        """One plain step: forward, logits at the sampled positions, one token each (int32)."""
        v, hidden = self.forward(plan)
        if v.num_samples == 0:
            return np.empty(0, dtype=np.int32)
        tokens = self.sample(self.logits(hidden[v.sample_indices]), sampling)
        return tokens.to(torch.int32).cpu().numpy()
