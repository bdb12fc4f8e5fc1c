"""CUDA graphs for decode steps.

A decode step launches a few hundred small kernels (every layer's norms, projections, rotary,
cache write, attention, MLP); at small and medium batch sizes launching them from Python costs
more than running them. A CUDA graph replays the whole forward with one launch.

A graph freezes kernel arguments, so every input lives in a static buffer here: per step the
runner's plan tensors (already on the device) are copied into rows `:n` of these buffers, and the
graph captured for the smallest bucket >= n is replayed. Rows `n:bucket` are padding: slot -1 (the
cache write skips them) and context length 0 (the decode kernel reads nothing for them and writes a
zero row); their token ids and positions are whatever valid values were there before. Buckets are
1, 2, 4, 8, then multiples of 16 up to max_num_seqs (and max_num_seqs itself).

The decode kernel's split-KV choice depends on the batch's longest context, which a graph cannot
see per step: the graphs are captured with `max_seqlen_k = max_model_len`, and the kernel sizes each
sequence's partitions from its own (device-side) context length, so one graph serves every step.

Only decode-only steps (no prefill tokens) of at most the largest bucket replay a graph; prefill and
mixed steps run eagerly. Logits and sampling run outside the graph (the engine selects
`sample_indices`, which for a pure decode step are 0..n-1).

Requires the `cuda` attention backend: the torch reference reads host copies of the lengths, which a
captured graph would freeze.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.worker.plan_tensors import PlanViews

logger = logging.getLogger(__name__)


class CaptureAbandoned(RuntimeError):
    """Another tensor-parallel rank failed to capture a graph: every rank decodes eagerly."""


def capture_buckets(buckets: Iterable[int], capture_one: Callable[[int], torch.cuda.CUDAGraph],
                    agree: Callable[[bool], bool] | None = None) -> dict[int, torch.cuda.CUDAGraph]:
    """`capture_one(bs)` for each bucket in turn. Under tensor parallelism every rank captures
    the same buckets, and a captured forward holds the ranks' all-reduces: a rank that replays
    graphs while another decodes eagerly would wait in a collective the other never starts. So
    after each bucket `agree(captured)` (a MIN over the ranks) tells every rank whether all of
    them captured it, and all stop at the same bucket: the failing rank with its own error,
    the others with CaptureAbandoned. The agreement runs outside any capture, and a failed
    capture runs none of the model's collectives (a captured collective is only recorded)."""
    graphs = {}
    for bs in buckets:
        error: Exception | None = None
        try:
            graphs[bs] = capture_one(bs)
        except Exception as e:  # noqa: BLE001  (re-raised below, after the ranks agreed)
            error = e
        everyone = agree(error is None) if agree is not None else error is None
        if error is not None:
            raise error
        if not everyone:
            raise CaptureAbandoned(f"another tensor-parallel rank failed to capture the batch-{bs} decode graph")
    return graphs


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then steps of 16, always including max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {b for b in (1, 2, 4, 8) if b <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class DecodeGraphs:
    """Static input buffers plus one captured decode forward per bucket."""

    def __init__(self, model: nn.Module, *, device: torch.device, dtype: torch.dtype, hidden_size: int,
                 max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = decode_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        # bucket_of[n]: the graph that serves a batch of n sequences.
        self.bucket_of = [0] * (self.max_batch + 1)
        b = 0
        for n in range(1, self.max_batch + 1):
            while self.buckets[b] < n:
                b += 1
            self.bucket_of[n] = self.buckets[b]
        B, dev, i32 = self.max_batch, device, torch.int32
        self.input_ids = torch.zeros(B, dtype=i32, device=dev)
        self.positions = torch.zeros(B, dtype=i32, device=dev)
        self.slot_mapping = torch.full((B,), -1, dtype=i32, device=dev)
        self.context_lens = torch.zeros(B, dtype=i32, device=dev)
        # Block 0 exists in every cache; rows of padding never read it anyway (context 0).
        self.block_tables = torch.zeros(B, self.max_blocks, dtype=i32, device=dev)
        self.cu_seqlens_q = torch.arange(B + 1, dtype=i32, device=dev)  # decode: one token each
        # Not read by the cuda backend's decode path; kept so the metadata is well formed.
        self.cu_seqlens_k = torch.zeros(B + 1, dtype=i32, device=dev)
        self.hidden = torch.zeros(B, hidden_size, dtype=dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._dirty = 0  # rows :_dirty may hold a previous step's data (must be re-padded)
        self._rows: dict[int, tuple[torch.Tensor, ...]] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            cu_seqlens_k=self.cu_seqlens_k[:bs + 1], context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs], max_seqlen_q=1, max_seqlen_k=self.max_model_len,
            num_prefill_tokens=0, num_decode_tokens=bs, block_size=self.block_size,
            host=None,  # anything that needs host lengths cannot run inside a graph: fail the capture
        )

    @torch.inference_mode()
    def capture(self, agree: Callable[[bool], bool] | None = None) -> None:
        """Capture every bucket, largest first, all sharing one memory pool (they never run at
        once). `agree`: see capture_buckets (tensor parallelism)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()

        def capture_one(bs: int) -> torch.cuda.CUDAGraph:
            meta = self._meta(bs)
            ids, pos = self.input_ids[:bs], self.positions[:bs]
            # Warm-up outside the graph: allocator blocks, cuBLAS handles, kernel attributes.
            self.hidden[:bs] = self.model(ids, pos, meta)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:bs] = self.model(ids, pos, meta)
            return graph

        self.graphs = capture_buckets(reversed(self.buckets), capture_one, agree)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s", len(self.graphs), self.buckets[0],
                    self.max_batch, time.perf_counter() - start)

    def can_run(self, v: PlanViews) -> bool:
        return (v.num_prefill_tokens == 0 and 0 < v.num_seqs <= self.max_batch
                and v.num_tokens == v.num_seqs and v.block_tables.shape[1] <= self.max_blocks)

    def run(self, v: PlanViews) -> torch.Tensor:
        """Replay the decode forward for `v` (see can_run): hidden states `[num_seqs, hidden]`, a view
        of the static output buffer, valid until the next replay."""
        n = v.num_seqs
        rows = self._rows.get(n)
        if rows is None:
            rows = self._rows[n] = (self.input_ids[:n], self.positions[:n], self.slot_mapping[:n],
                                    self.context_lens[:n], self.block_tables[:n, :v.block_tables.shape[1]],
                                    self.hidden[:n])
        ids, pos, slots, ctx, tables, hidden = rows
        if tables.shape[1] != v.block_tables.shape[1]:
            tables = self.block_tables[:n, :v.block_tables.shape[1]]
        # Device-to-device copies, queued on the current stream after the plan's host-to-device copy.
        ids.copy_(v.input_ids)
        pos.copy_(v.positions)
        slots.copy_(v.slot_mapping)
        ctx.copy_(v.context_lens)
        tables.copy_(v.block_tables)
        if self._dirty > n:
            # Rows a larger earlier batch filled become padding again.
            self.slot_mapping[n:self._dirty].fill_(-1)
            self.context_lens[n:self._dirty].fill_(0)
        self._dirty = n
        self.graphs[self.bucket_of[n]].replay()
        return hidden
