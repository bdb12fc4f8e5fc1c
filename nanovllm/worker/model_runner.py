"""ModelRunner: the model and its paged KV cache on one device, one class for every rank.

`execute(scheduler_output)` is rank 0's step: apply the plan's sampling-state changes, copy the
plan to the device (one copy), run copy-on-write block copies and the model over the flattened
batch (`forward`), then the token sampler (worker/token_sampler.py) turns the hidden states into a
RunnerOutput. A tensor-parallel worker (rank > 0) holds its shard of the model and of the KV cache
and runs only `forward` and its share of the LM head (worker/worker.py); it has no token sampler.

On CUDA the attention backend is "cuda" (our kernels, nanovllm._kernels) where it is built and
supports the model's head_dim, else "torch" with a warning; decode-only steps replay CUDA graphs
captured when the KV cache is allocated (see worker/cuda_graph.py), unless enforce_eager.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanovllm import _C
from nanovllm.attention.metadata import AttentionMetadata, HostSeqLens
from nanovllm.config import ResolvedConfig, cpu_kv_cache_bytes
from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.cpu import huge_pages
from nanovllm.layers.attention import attention_layers, bind_kv_cache
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.models.loader import load_model_from_config
from nanovllm.sample import make_sampling_batch
from nanovllm.staging import to_device
from nanovllm.worker.cuda_graph import DecodeGraphs
from nanovllm.worker.draft_proposer import DraftProposer
from nanovllm.worker.inference import inference
from nanovllm.worker.plan_tensors import PlanTensors, PlanViews
from nanovllm.worker.step import RunnerOutput, SchedulerOutput
from nanovllm.worker.token_sampler import TokenSampler

if TYPE_CHECKING:
    from nanovllm.distributed.parallel_state import TPGroup

logger = logging.getLogger(__name__)


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


def choose_attention_backend(head_dim: int, device: torch.device) -> str:
    """On CPU the fast backend (C++ decode kernel). On CUDA "cuda" (our kernels) where they are
    built and fit the model, else the torch reference, with a warning saying why."""
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        return "torch"
    from nanovllm.attention import cuda_ops
    from nanovllm.attention.backend import get_attention_backend

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
    def __init__(self, config: ResolvedConfig, *, device: torch.device | None = None, tp: TPGroup | None = None,
                 eos_token_ids: Sequence[int] = (), attn_backend: str | None = None) -> None:
        """`device`: this rank's (default: the configuration's); `tp` makes this runner one rank of
        a tensor-parallel group (it holds that rank's shard of the model and of the KV cache; only
        rank 0 samples); `eos_token_ids` are what min_tokens masks (besides a request's stop ids);
        `attn_backend` overrides the automatic choice (see choose_attention_backend)."""
        self.config = config
        self.model_config = config.model_config
        self.device = device = config.device if device is None else device
        self.tp = tp
        self.make_device_current()
        backend = attn_backend or choose_attention_backend(self.model_config.head_dim, device)
        self.model = load_model_from_config(self.model_config, config.dtype, device, backend, tp,
                                            config.options.quantization)
        self.attn_backend = backend
        self.model.eval()
        self.dtype = next(self.model.parameters()).dtype
        self.num_prepacked = cpu_gemm.prepack_model(self.model) if device.type == "cpu" else 0
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.token_sampler: TokenSampler | None = None
        # Speculative decoding's draft model runs on rank 0 alone, whole (it is small).
        self.drafter: DraftProposer | None = None
        if tp is None or tp.rank == 0:
            # A head that can give greedy tokens without logits (ours, whole on this rank): asked first
            # in the steps that need nothing else.
            # Through a weak reference: the startup heap is frozen out of the cyclic GC
            # (engine/llm_engine.py), so a runner <-> sampler cycle would keep a dropped engine's
            # model and KV cache for good.
            me = weakref.proxy(self)
            greedy = (lambda hidden, rows: me.greedy(hidden, rows)) if self.model.has_greedy_head() else None
            self.token_sampler = TokenSampler(lambda hidden, rows, host_rows: me.logits(hidden, rows, host_rows),
                                              device, self.model_config.vocab_size, eos_token_ids,
                                              self.max_num_seqs, greedy=greedy)
            if config.draft_model_config is not None:
                self.drafter = DraftProposer(config, device, self.dtype, backend)
        # Under tensor parallelism every rank computes its share of the LM head for the same rows:
        # rank 0's executor tells the workers which, before each logits call (host row indices,
        # None for the step's sample indices).
        self.before_logits: Callable[[np.ndarray | None], None] | None = None
        self.kv_cache: torch.Tensor | None = None
        self._plan_tensors: PlanTensors | None = None
        self.graphs: DecodeGraphs | None = None
        eager = config.options.enforce_eager
        self.use_cuda_graphs = device.type == "cuda" and not eager and backend == "cuda"
        if device.type == "cuda" and not eager and not self.use_cuda_graphs:
            logger.warning("CUDA graphs need the cuda attention backend (have %r): decoding eagerly", backend)
        if self.use_cuda_graphs and any(isinstance(m, FusedMoE) and m.quant is not None for m in self.model.modules()):
            # Quantized experts run one Triton GEMM per chosen expert, chosen on the host.
            logger.warning("quantized mixture-of-experts layers cannot be captured in CUDA graphs: decoding eagerly")
            self.use_cuda_graphs = False

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
        c = self.model_config
        kv_heads = c.num_key_value_heads if self.tp is None else max(1, c.num_key_value_heads // self.tp.world_size)
        return KVCacheSpec(c.num_hidden_layers, kv_heads, c.head_dim, self.block_size, self.dtype)

    def num_kv_blocks(self) -> int:
        """KV blocks for the configuration (num_kvcache_blocks, kv_cache_memory_bytes, or on CUDA the
        profiled memory left); under tensor parallelism the minimum over ranks, so that every rank
        holds the same pool (each rank calls this at the same point of its startup)."""
        per_block = self.kv_spec.bytes_per_block + (self.drafter.bytes_per_block if self.drafter else 0)
        options = self.config.options
        if options.num_kvcache_blocks is not None:
            blocks = options.num_kvcache_blocks
        elif self.device.type == "cuda" and options.kv_cache_memory_bytes is None:
            blocks = self.profile_num_blocks(options.gpu_memory_utilization, self.config.max_num_batched_tokens)
        else:
            blocks = (options.kv_cache_memory_bytes or cpu_kv_cache_bytes()) // per_block
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
        per_block = self.kv_spec.bytes_per_block + (self.drafter.bytes_per_block if self.drafter else 0)
        return max(0, budget // per_block)

    @inference
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
        if self.token_sampler is not None:  # only rank 0 of a tensor-parallel group samples
            # The real sampler on its most memory-hungry path (top-p without top-k: a full sort,
            # masks, the race); on a copy, as a step samples processed logits while keeping the
            # raw ones.
            batch = make_sampling_batch([1.0] * rows, top_p=[0.9] * rows, min_p=[0.05] * rows)
            self.token_sampler.sampler(logits.clone(), batch)
            del logits
        self.release_kv_cache()
        return scratch

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and bind it to the layers; on CUDA (unless enforce_eager) capture the
        decode CUDA graphs, which read this cache. On the CPU a prefill of the step budget runs first
        (as CUDA's memory profile does): the kernels' scratch and torch's buffers grow to a full step
        there, not in the first request's prefill (a Qwen3-MoE-shaped bf16 batch prefill, the first
        of its size: 0.84 s without this, 0.75-0.76 s with it; Intel Xeon with AMX)."""
        if self.device.type == "cpu":
            self._dummy_forward(self.config.max_num_batched_tokens)
        self._allocate_kv(num_blocks)
        if self.use_cuda_graphs:
            self.capture_cuda_graphs()

    def _allocate_kv(self, num_blocks: int) -> None:
        if self.device.type == "cuda" and self.kv_cache is not None:
            self.release_kv_cache()  # never hold two caches at once on a GPU filled to its budget
        s = self.kv_spec
        self.kv_cache = huge_pages.zeros(
            (2, s.num_layers, num_blocks, s.block_size, s.num_kv_heads, s.head_dim), s.dtype, self.device
        )
        bind_kv_cache(self.model, self.kv_cache)
        if self.drafter is not None:
            self.drafter.allocate(num_blocks)

    def release_kv_cache(self) -> None:
        """Drop the cache, the layers' views of it and the graphs that read it."""
        self.graphs = None
        self.kv_cache = None
        if self.drafter is not None:
            self.drafter.release()
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
        graphs = DecodeGraphs(self.model, device=self.device, dtype=self.dtype, hidden_size=self.model_config.hidden_size,
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

    @inference
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        """Rank 0's step: the plan's sampling-state changes, the forward, the tokens."""
        assert self.token_sampler is not None, "only rank 0 samples"
        self.token_sampler.apply(so)
        plan = so.plan
        v = self.plan_views(plan)
        host = HostSeqLens(cu_seqlens_q=plan.cu_seqlens_q, context_lens=plan.context_lens)
        hidden = self.forward(v, host)
        if self.drafter is None:
            return self.token_sampler.sample(plan, hidden, v.sample_indices)
        self.drafter.forward(v.input_ids, v.positions, self._metadata(v, host))
        out = self.token_sampler.sample(plan, hidden, v.sample_indices)
        if len(out.seq_ids) and so.propose_drafts:
            out.drafts, out.draft_offsets, probs = self.drafter.propose(plan, out, self.token_sampler.state)
            self.token_sampler.draft_probs.update(probs)
        return out

    def plan_views(self, plan: _C.StepPlan) -> PlanViews:
        """The plan as tensors on this runner's device (one copy; views on CPU)."""
        if self._plan_tensors is None:
            self._plan_tensors = PlanTensors(plan, block_size=self.block_size)
        if self.device.type == "cpu":
            return self._plan_tensors.views(plan)
        return self._plan_tensors.to(self.device, plan)

    def _copy_blocks(self, copies: torch.Tensor) -> None:
        src, dst = copies[:, 0].long(), copies[:, 1].long()
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        if self.drafter is not None:
            self.drafter.copy_blocks(src, dst)

    @inference
    def forward(self, v: PlanViews, host: HostSeqLens) -> torch.Tensor:
        """Copy-on-write block copies, then the model over the flattened batch: the hidden states.
        `host`: the lengths on the host, so a backend that needs them as ints never syncs."""
        if v.num_copies:
            self._copy_blocks(v.block_copies)
        if self.graphs is not None and self.graphs.can_run(v):
            return self.graphs.run(v)
        return self.model(v.input_ids, v.positions, self._metadata(v, host))

    def _metadata(self, v: PlanViews, host: HostSeqLens) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=v.slot_mapping, cu_seqlens_q=v.cu_seqlens_q, cu_seqlens_k=v.cu_seqlens_k,
            context_lens=v.context_lens, block_tables=v.block_tables, max_seqlen_q=v.max_seqlen_q,
            max_seqlen_k=v.max_seqlen_k, num_prefill_tokens=v.num_prefill_tokens,
            num_decode_tokens=v.num_decode_tokens, block_size=self.block_size, host=host,
        )

    @inference
    def logits(self, hidden: torch.Tensor, rows: torch.Tensor, host_rows: np.ndarray | None = None) -> torch.Tensor:
        """fp32 logits of the hidden-state rows `rows`, [rows, vocab]. `host_rows`: the same on the
        host, None for the step's own sample indices (what the tensor-parallel hook needs)."""
        if self.before_logits is not None:
            self.before_logits(host_rows)
        # Every row (a decode-only step samples every token: rows are 0..n-1): skip the gather.
        logits = self.model.compute_logits(hidden if rows.shape[0] == hidden.shape[0] else hidden[rows])
        assert logits is not None, "logits are gathered on rank 0 only"
        return logits

    @inference
    def greedy(self, hidden: torch.Tensor, rows: torch.Tensor) -> np.ndarray | None:
        """The greedy token of each of the hidden-state rows `rows`, a host int32 array, without the
        logits (compute_greedy; a model whose head has_greedy_head, never sharded, so no rank waits
        on `before_logits`); None where the head does not read the rows: take `logits` then."""
        return self.model.compute_greedy(hidden if rows.shape[0] == hidden.shape[0] else hidden[rows])
