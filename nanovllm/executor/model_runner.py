"""ModelRunner: owns the model and the paged KV cache, and turns one StepPlan into sampled tokens.

Per step: the plan's arrays become tensors (one copy of the plan buffer), copy-on-write block
copies run before the forward, the model runs over the flattened batch (`forward`), logits are
computed only at the sampled positions and the sampling package picks one token per sampled row
(`sample`), from the persistent per-sequence state the runner owns (`sampling`).

On CUDA the attention backend is "cuda" (our kernels, nanovllm._kernels) where it is built and
supports the model's head_dim, else "torch" with a warning; decode-only steps replay CUDA graphs
captured when the KV cache is allocated (see executor/cuda_graph.py), unless enforce_eager.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanovllm import _C
from nanovllm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from nanovllm.attention.metadata import AttentionMetadata, HostSeqLens
from nanovllm.executor.plan_tensors import PlanTensors, PlanViews
from nanovllm.executor.cuda_graph import DecodeGraphs
from nanovllm.layers import cpu_gemm
from nanovllm.layers.attention import attention_layers, bind_kv_cache
from nanovllm.model_config import ModelConfig, load_model_config
from nanovllm.models.loader import load_model
from nanovllm.sample import LogprobBlock, Sampler, SamplingState, gather_logprobs, make_sampling_batch
from nanovllm.sample.logprobs import logprob_columns, unpack_logprobs
from nanovllm.staging import to_device, to_host

if TYPE_CHECKING:
    from nanovllm.distributed.parallel_state import TPGroup

logger = logging.getLogger(__name__)

_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_ROWS.flags.writeable = False


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


def choose_attention_backend(model_dir: str, device: torch.device) -> str:
    """On CPU the fast backend (C++ decode kernel). On CUDA "cuda" (our kernels) where they are
    built and fit the model, else the torch reference, with a warning saying why."""
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        return "torch"
    from nanovllm.attention import cuda_ops
    from nanovllm.attention.backend import get_attention_backend

    head_dim = load_model_config(model_dir).head_dim
    reason = None
    if head_dim not in cuda_ops.SUPPORTED_HEAD_DIMS:
        reason = f"head_dim {head_dim} is not one the decode kernel is built for {cuda_ops.SUPPORTED_HEAD_DIMS}"
    else:
        try:
            get_attention_backend("cuda")
        except ImportError as e:
            reason = str(e)
        else:
            with torch.cuda.device(device):
                reason = cuda_ops.probe()
    if reason is not None:
        logger.warning("CUDA attention kernels unavailable (%s): using the torch reference backend, "
                       "without CUDA graphs (slow)", reason)
        return "torch"
    return "cuda"


class ModelRunner:
    def __init__(self, model_dir: str, dtype: str | torch.dtype, device: torch.device, block_size: int, *,
                 max_num_seqs: int = 256, max_model_len: int | None = None, enforce_eager: bool = False,
                 attn_backend: str | None = None, eos_token_ids: Sequence[int] = (), tp: TPGroup | None = None,
                 quantization: str | None = None) -> None:
        """`max_num_seqs` and `max_model_len` (default: the model's max_position_embeddings) size the
        CUDA graphs' static buffers; `enforce_eager` turns graphs off; `attn_backend` overrides the
        automatic choice (see choose_attention_backend); `eos_token_ids` are what min_tokens masks
        (besides a request's stop ids); `tp` makes this runner one rank of a tensor-parallel group
        (it holds that rank's shard of the model and of the KV cache); `quantization` as
        EngineConfig's."""
        self.device = device
        self.tp = tp
        self.make_device_current()
        backend = attn_backend or choose_attention_backend(model_dir, device)
        self.model, self.config = load_model(model_dir, dtype=dtype, device=device, attn_backend=backend, tp=tp,
                                             quantization=quantization)
        self.attn_backend = backend
        self.model.eval()
        self.dtype = next(self.model.parameters()).dtype
        self.num_prepacked = cpu_gemm.prepack_model(self.model) if device.type == "cpu" else 0
        self.block_size = block_size
        self.sampler = Sampler()
        self.sampling = SamplingState(device, self.config.vocab_size, list(eos_token_ids))
        self.kv_cache: torch.Tensor | None = None
        self._plan_tensors: PlanTensors | None = None
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.enforce_eager = enforce_eager
        self.graphs: DecodeGraphs | None = None
        self.use_cuda_graphs = device.type == "cuda" and not enforce_eager and backend == "cuda"
        if device.type == "cuda" and not enforce_eager and not self.use_cuda_graphs:
            logger.warning("CUDA graphs need the cuda attention backend (have %r): decoding eagerly", backend)

    def shutdown(self) -> None:
        """Release processes this runner started (none on one device; see TensorParallelRunner)."""

    def make_device_current(self) -> None:
        """Make this runner's GPU the calling thread's current CUDA device. Our kernels launch on the
        runtime's current device, not the tensors' (cuda:1 would otherwise get cuda:0's launches on
        cuda:1's stream), and the current device is per thread: a thread that drives the runner
        (the server's engine thread) calls this first. A bare "cuda" already means the current one."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    @property
    def kv_spec(self) -> KVCacheSpec:
        """This rank's cache: its KV heads only under tensor parallelism."""
        c: ModelConfig = self.config
        kv_heads = c.num_key_value_heads if self.tp is None else max(1, c.num_key_value_heads // self.tp.world_size)
        return KVCacheSpec(c.num_hidden_layers, kv_heads, c.head_dim, self.block_size, self.dtype)

    def num_kv_blocks(self, config: EngineConfig, budget: int) -> int:
        """KV blocks for `config` (num_kvcache_blocks, kv_cache_memory_bytes, or on CUDA the profiled
        memory left); under tensor parallelism the minimum over ranks, so that every rank holds the
        same pool (each rank calls this at the same point of its startup)."""
        per_block = self.kv_spec.bytes_per_block
        if config.num_kvcache_blocks is not None:
            blocks = config.num_kvcache_blocks
        elif self.device.type == "cuda" and config.kv_cache_memory_bytes is None:
            blocks = self.profile_num_blocks(config.gpu_memory_utilization, budget)
        else:
            blocks = (config.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES) // per_block
        if self.tp is not None:
            blocks = self.tp.all_reduce_min(blocks)
        if blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache (one block needs {per_block} bytes); "
                "raise gpu_memory_utilization or kv_cache_memory_bytes"
            )
        return int(blocks)

    def profile_num_blocks(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        """Blocks that fit in `gpu_memory_utilization` of the GPU after a forward at the maximum batch.

        budget = total * utilization - (memory outside torch's allocator: CUDA context, cuBLAS
        workspaces, other processes) - (torch's peak during the forward: weights + activations,
        minus the scratch cache the forward itself needed). Runs with the selected attention
        backend, so its workspaces (and Triton's first compilation) are part of the measurement.
        """
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        scratch = self._dummy_forward(max_num_batched_tokens)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - scratch
        torch.cuda.empty_cache()  # what stays reserved now is what stays allocated (the weights)
        free, total = torch.cuda.mem_get_info(dev)
        outside_torch = (total - free) - torch.cuda.memory_reserved(dev)
        budget = int(total * gpu_memory_utilization) - outside_torch - peak
        return max(0, budget // self.kv_spec.bytes_per_block)

    @torch.inference_mode()
    def _dummy_forward(self, num_tokens: int) -> int:
        """A prefill of `num_tokens` that writes no KV (every slot -1), for memory profiling, with
        logits and a sampling pass for as many rows as a step can sample.
        Returns the bytes of the scratch KV cache it allocated (and released)."""
        dev = self.device
        num_blocks = -(-num_tokens // self.block_size)
        self._allocate_kv(num_blocks)
        scratch = self.kv_cache.numel() * self.kv_cache.element_size()
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int32, device=dev),
            cu_seqlens_q=to_device([0, num_tokens], dev, np.int32),
            cu_seqlens_k=to_device([0, num_tokens], dev, np.int32),
            context_lens=to_device([num_tokens], dev, np.int32),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None],
            max_seqlen_q=num_tokens, max_seqlen_k=num_tokens,
            num_prefill_tokens=num_tokens, num_decode_tokens=0, block_size=self.block_size,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int32, device=dev)
        positions = torch.arange(num_tokens, dtype=torch.int32, device=dev)
        hidden = self.model(ids, positions, meta)
        rows = min(num_tokens, self.max_num_seqs)
        logits = self.model.compute_logits(hidden[-rows:])
        del hidden
        if logits is not None:  # only rank 0 of a tensor-parallel group gets logits and samples
            # The real sampler on its most memory-hungry path (top-p without top-k: a full sort,
            # masks, the race); on a copy, as the engine samples processed logits while keeping the
            # raw ones.
            batch = make_sampling_batch([1.0] * rows, top_p=[0.9] * rows, min_p=[0.05] * rows)
            self.sampler(logits.clone(), batch)
            del logits
        self.release_kv_cache()
        return scratch

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and bind it to the layers; on CUDA (unless enforce_eager) capture the
        decode CUDA graphs, which read this cache."""
        self._allocate_kv(num_blocks)
        if self.use_cuda_graphs:
            self.capture_cuda_graphs()

    def _allocate_kv(self, num_blocks: int) -> None:
        if self.device.type == "cuda" and self.kv_cache is not None:
            self.release_kv_cache()  # never hold two caches at once on a GPU filled to its budget
        s = self.kv_spec
        self.kv_cache = torch.zeros(
            (2, s.num_layers, num_blocks, s.block_size, s.num_kv_heads, s.head_dim), dtype=s.dtype, device=self.device
        )
        bind_kv_cache(self.model, self.kv_cache)

    def release_kv_cache(self) -> None:
        """Drop the cache, the layers' views of it and the graphs that read it."""
        self.graphs = None
        self.kv_cache = None
        for layer in attention_layers(self.model):
            layer.k_cache = torch.empty(0)
            layer.v_cache = torch.empty(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def capture_cuda_graphs(self) -> None:
        """(Re)capture the decode graphs for the current KV cache. A capture that fails (an op that
        cannot be captured) leaves the runner decoding eagerly, with a warning; under tensor
        parallelism every rank then does (the ranks agree after each graph: capture_buckets)."""
        if self.kv_cache is None:
            raise RuntimeError("allocate the KV cache before capturing CUDA graphs")
        self.graphs = None
        graphs = DecodeGraphs(self.model, device=self.device, dtype=self.dtype, hidden_size=self.config.hidden_size,
                              max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                              block_size=self.block_size)
        tp = self.tp
        agree = None if tp is None else (lambda captured: tp.all_reduce_min(int(captured)) == 1)
        try:
            graphs.capture(agree)
        except Exception as e:  # noqa: BLE001  (any capture failure: fall back, never crash the engine)
            logger.warning("CUDA graph capture failed (%s: %s): decoding eagerly", type(e).__name__, e)
            torch.cuda.synchronize(self.device)
            return
        self.graphs = graphs

    def _views(self, plan: _C.StepPlan) -> PlanViews:
        if self._plan_tensors is None:
            self._plan_tensors = PlanTensors(plan, block_size=self.block_size)
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
        return v, self.execute(v, HostSeqLens(cu_seqlens_q=plan.cu_seqlens_q, context_lens=plan.context_lens))

    @torch.inference_mode()
    def execute(self, v: PlanViews, host: HostSeqLens) -> torch.Tensor:
        """`forward` from the plan's tensors and host lengths (a tensor-parallel worker's entry: its
        plan arrives through the step channel). Returns the hidden states."""
        if v.num_copies:
            self._copy_blocks(v.block_copies)
        if self.graphs is not None and self.graphs.can_run(v):
            return self.graphs.run(v)
        meta = AttentionMetadata(
            slot_mapping=v.slot_mapping, cu_seqlens_q=v.cu_seqlens_q, cu_seqlens_k=v.cu_seqlens_k,
            context_lens=v.context_lens, block_tables=v.block_tables, max_seqlen_q=v.max_seqlen_q,
            max_seqlen_k=v.max_seqlen_k, num_prefill_tokens=v.num_prefill_tokens,
            num_decode_tokens=v.num_decode_tokens, block_size=self.block_size,
            # Host copies, so a backend that needs lengths as ints never syncs with the device.
            host=host,
        )
        return self.model(v.input_ids, v.positions, meta)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the hidden-state rows `rows` (indices into this step's hidden states),
        [rows, vocab]."""
        # Every row (a decode-only step samples every token: rows are 0..n-1): skip the gather.
        logits = self.model.compute_logits(hidden if len(rows) == hidden.shape[0] else hidden[rows])
        assert logits is not None, "logits are gathered on rank 0 only"
        return logits

    @torch.inference_mode()
    def sample(self, hidden: torch.Tensor, sample_indices: torch.Tensor, row_sids: np.ndarray,
               repeats: np.ndarray | None = None) -> SampleOutput:
        """One token per row: row i samples sequence row_sids[i] from the logits at its sampled
        position. `repeats[j]` rows come from sample position j (a prompt fanning out into n
        samples); without it, one row per position. Penalties, bias and min_tokens apply where the
        rows' sequences ask; logprobs are computed from the raw logits of the rows that ask."""
        raw = self.logits(hidden, sample_indices)
        if repeats is not None:
            # Row i of the fan-out is sample position fan_rows[i]; an index gather with a host-built
            # index (repeat_interleave would read the repeats' sum back from the device).
            fan_rows = np.repeat(np.arange(len(repeats)), repeats)
            raw = raw.index_select(0, to_device(fan_rows, raw.device))
        lp_rows = _NO_ROWS
        if self.sampling.users.logprobs:
            wanted = self.sampling.rows.logprobs[row_sids]
            lp_rows = np.flatnonzero(wanted >= 0)
        processed = self.sampling.process(raw, row_sids, keep_input=len(lp_rows) > 0)
        tokens = self.sampler(processed, self.sampling.batch(row_sids))
        if not len(lp_rows):
            host, = to_host(tokens)
            return SampleOutput(host.astype(np.int32), tokens, None, lp_rows)
        lp_raw, lp_tokens = raw, tokens
        if len(lp_rows) < len(row_sids):  # gather only when some rows did not ask
            idx = to_device(lp_rows, raw.device)
            lp_raw, lp_tokens, wanted = raw[idx], tokens[idx], wanted[lp_rows]
        if lp_raw.device.type == "cpu":
            logprobs = gather_logprobs(lp_raw, lp_tokens, wanted)
            host, = to_host(tokens)
        else:  # the step's one wait, for the tokens and their logprobs together
            k = int(wanted.max())
            host, columns = to_host(tokens, logprob_columns(lp_raw, lp_tokens, k))
            logprobs = unpack_logprobs(columns, wanted)
        return SampleOutput(host.astype(np.int32), tokens, logprobs, lp_rows)


@dataclass
class SampleOutput:
    tokens: np.ndarray  # int32 [rows], on the host
    token_tensor: torch.Tensor  # int64 [rows], on the device
    logprobs: LogprobBlock | None  # for the rows in logprob_rows, in that order
    logprob_rows: np.ndarray  # int64

