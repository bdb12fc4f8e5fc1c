"""StepPlan -> torch tensors, at a constant cost per step.

The C++ core writes each step's flat arrays (docs/design.md, "The step") into one persistent int32
buffer, every array at a fixed offset sized for the maximum batch and the block tables last. This
module wraps that buffer once with `torch.from_numpy` and, per step, hands out views of it sized
by the step's counts. On CPU those views are the result (no copy at all); for an accelerator the
used part goes over in one copy into a persistent device buffer (everything before the block
tables, then the step's block-table rows cut to the columns its longest context uses) and the same
views are taken there, so the device arrays also sit at fixed addresses (what CUDA graphs need).

Why it is built this way (measured on the 2-core dev machine, torch 2.13 CPU):
- Creating a tensor view from Python costs about 1.2 us (`t[a:b]`; `narrow` is ~1.8 us), reading
  an int property of the pybind StepPlan about 0.1 us, so a step reads only the 7 int scalars it
  needs and takes at most 9 slices: ~10 us. Splitting everything with one `split_with_sizes` call
  is no cheaper (~0.4 us per piece, and the gaps between sections are pieces too).
- A view depends only on its section and its length, and the buffer never moves, so views are
  cached by length: in steady decode the counts repeat step after step and the conversion drops
  to a few dict look-ups. The cache is small and bounded (prefill token counts vary widely).
- The block-copy and block-table sections are reshaped to 2-D once, so their per-step views are a
  single row slice each.
- Right after a large prefill `schedule()` (benchmarks/sched_overhead.py, `prefill` rows) the same
  9 slices take ~25 us instead of ~12: the core's step has displaced torch's code and data from
  the caches, and the first torch op afterwards alone costs ~5 us extra. That is per step, not
  per sequence, and small next to such a step's ~250 us in the core.

Everything returned aliases memory that the next `Scheduler.schedule()` (host) or the next `to()`
(device) overwrites: use a step's views within that step. The cached view tensors are shared
between steps, so callers must not change their shape in place (`resize_`, `unsqueeze_`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nanovllm._C import StepPlan

# Section names as the core reports them in `StepPlan.offsets`, in buffer order.
_SECTIONS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "context_lens",
    "sample_indices",
    "block_copies",
    "block_tables",
)

# Distinct lengths kept per view cache before it is cleared. Decode batch sizes repeat, so a few
# hundred entries cover them; prefill token counts rarely repeat and only churn the cache.
_CACHE_LIMIT = 512


@dataclass(slots=True)
class PlanViews:
    """One step's plan as torch tensors (int32), all views of one buffer, plus its scalars."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens] block_id * block_size + offset
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1]
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1]
    context_lens: torch.Tensor  # [num_seqs]
    sample_indices: torch.Tensor  # [num_samples]
    block_copies: torch.Tensor  # [num_copies, 2] (src, dst), to copy before the forward
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq], -1 padded
    num_tokens: int
    num_seqs: int
    num_samples: int
    num_copies: int
    num_prefill_tokens: int
    num_decode_tokens: int
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_decode_seqs(self) -> int:
        # Decodes have query length 1 and come first, so they are as many as their tokens.
        return self.num_decode_tokens


class _ViewMaker:
    """Cached views of one buffer (the host wrap of the plan buffer, or a device copy of it)."""

    __slots__ = ("_base", "_cache", "_copies2d", "_cpy", "_max_blocks", "_off", "_seq", "_smp", "_tab", "_tables2d",
                 "_tok")

    def __init__(self, base: torch.Tensor, off: dict[str, int], max_seqs: int, max_blocks: int,
                 cache: bool) -> None:
        self._base = base
        self._off = off
        bc, bt = off["block_copies"], off["block_tables"]
        # Reshaped once so that a step's view is a single row slice.
        self._copies2d = base[bc:bt].view(-1, 2)
        self._tables2d = base[bt:bt + max_seqs * max_blocks].view(max_seqs, max_blocks)
        self._max_blocks = max_blocks
        self._cache = cache
        # length -> views, one cache per group of sections that share a length.
        self._tok: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._seq: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._tab: dict[tuple[int, int], torch.Tensor] = {}
        self._smp: dict[int, torch.Tensor] = {}
        self._cpy: dict[int, torch.Tensor] = {}

    def tokens(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        v = self._tok.get(n)
        if v is None:
            b, o = self._base, self._off
            ids, pos, slots = o["input_ids"], o["positions"], o["slot_mapping"]
            v = (b[ids:ids + n], b[pos:pos + n], b[slots:slots + n])
            self._remember(self._tok, n, v)
        return v

    def seqs(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        v = self._seq.get(n)
        if v is None:
            b, o = self._base, self._off
            cq, ck, cl = o["cu_seqlens_q"], o["cu_seqlens_k"], o["context_lens"]
            v = (b[cq:cq + n + 1], b[ck:ck + n + 1], b[cl:cl + n])
            self._remember(self._seq, n, v)
        return v

    def tables(self, n: int, width: int) -> torch.Tensor:
        """Block tables of `n` sequences, `width` columns each: rows of the full width in the host
        buffer; in a device buffer (which receives only the used columns) `n` packed rows."""
        v = self._tab.get((n, width))
        if v is None:
            if width == self._max_blocks:
                v = self._tables2d[:n]
            else:
                bt = self._off["block_tables"]
                v = self._base[bt:bt + n * width].view(n, width)
            self._remember(self._tab, (n, width), v)
        return v

    def samples(self, n: int) -> torch.Tensor:
        v = self._smp.get(n)
        if v is None:
            si = self._off["sample_indices"]
            v = self._base[si:si + n]
            self._remember(self._smp, n, v)
        return v

    def copies(self, n: int) -> torch.Tensor:
        v = self._cpy.get(n)
        if v is None:
            v = self._copies2d[:n]
            self._remember(self._cpy, n, v)
        return v

    def _remember(self, cache: dict[Any, Any], n: Any, v: Any) -> None:
        if not self._cache:
            return
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[n] = v


class _DeviceCopy:
    """The persistent device buffer for one device, and what a copy into it needs."""

    __slots__ = ("buffer", "event", "pinned", "views")

    def __init__(self, buffer: torch.Tensor, views: _ViewMaker) -> None:
        self.buffer = buffer
        self.views = views
        cuda = buffer.device.type == "cuda"
        # The core's buffer is ordinary pageable memory; a non_blocking copy is only asynchronous
        # from page-locked memory, so CUDA copies are staged through a pinned buffer.
        self.pinned = torch.empty(buffer.shape[0], dtype=torch.int32, pin_memory=True) if cuda else None
        # Marks when the staged bytes have left `pinned`, so the next step may overwrite it.
        self.event = torch.cuda.Event() if cuda else None


class PlanTensors:
    """Torch views of a Scheduler's StepPlan; create once per scheduler (its plan buffer).

    `views()` gives the current step on the host (views of the plan buffer, no copy);
    `to(device)` copies the used part of the buffer to `device` in one copy and gives the same
    views there.
    """

    def __init__(self, plan: StepPlan, *, block_size: int | None = None, cache_views: bool = True) -> None:
        """`block_size` (the cache's) lets `to()` copy only the block-table columns a step uses
        (the widest context's blocks); without it every column goes over."""
        self._cache_views = cache_views
        self._block_size = block_size
        # Keyed by the caller's device argument as given, so a step does not build a
        # torch.device; None marks a CPU target (the host views are the result).
        self._devices: dict[torch.device | str, _DeviceCopy | None] = {}
        self._bind(plan)

    def _bind(self, plan: StepPlan) -> None:
        buf = plan.buffer  # numpy view of the core's persistent buffer; never reallocated
        self._plan = plan
        self._address = buf.ctypes.data
        self._host = torch.from_numpy(buf)  # shares memory with the core: no copy
        off = dict(plan.offsets)
        order = sorted(off, key=off.__getitem__)
        if tuple(order) != _SECTIONS:
            raise ValueError(f"unexpected StepPlan layout {off}: expected sections in order {_SECTIONS}")
        self._off = off
        self._bt = off["block_tables"]
        self._max_blocks = plan.max_blocks_per_seq
        # context_lens is sized for the maximum batch (one entry per sequence).
        self._max_seqs = off["sample_indices"] - off["context_lens"]
        if self._bt + self._max_seqs * self._max_blocks != buf.shape[0]:
            raise ValueError("StepPlan buffer size does not match its block-table section")
        self._host_views = self._maker(self._host)
        self._host_tables = self._host[self._bt:].view(self._max_seqs, self._max_blocks)
        self._devices.clear()  # device buffers were sized and sliced for the old layout

    def _maker(self, base: torch.Tensor) -> _ViewMaker:
        return _ViewMaker(base, self._off, self._max_seqs, self._max_blocks, self._cache_views)

    def _new_device(self, device: torch.device) -> _DeviceCopy | None:
        if device.type == "cpu":
            return None
        buffer = torch.empty(self._host.shape[0], dtype=torch.int32, device=device)
        return _DeviceCopy(buffer, self._maker(buffer))

    @property
    def host_buffer(self) -> torch.Tensor:
        """The whole plan buffer as a CPU tensor sharing memory with the core."""
        return self._host

    @property
    def max_blocks_per_seq(self) -> int:
        return self._max_blocks

    def _check_plan(self, plan: StepPlan | None) -> None:
        if plan is None or plan is self._plan:
            return
        # A new Python wrapper (or another scheduler's plan): rewrap only if the memory moved.
        # Holding self._plan keeps the old scheduler alive, so an equal address is the same
        # buffer, never a new one allocated where a freed one was.
        if plan.buffer.ctypes.data != self._address:
            self._bind(plan)
        else:
            self._plan = plan

    def views(self, plan: StepPlan | None = None) -> PlanViews:
        """The current step as views of the host buffer (valid until the next schedule())."""
        self._check_plan(plan)
        return self._views(self._host_views)

    def _views(self, maker: _ViewMaker, width: int | None = None) -> PlanViews:
        p = self._plan
        # The only crossings into the core per step: 7 int reads, ~0.1 us each.
        nt = p.num_tokens
        ns = p.num_seqs
        nsmp = p.num_samples
        ncp = p.num_copies
        ndec = p.num_decode_tokens
        max_k = p.max_seqlen_k
        ids, pos, slots = maker.tokens(nt)
        cu_q, cu_k, ctx = maker.seqs(ns)
        tables = maker.tables(ns, self._max_blocks if width is None else width)
        return PlanViews(
            ids, pos, slots, cu_q, cu_k, ctx, maker.samples(nsmp), maker.copies(ncp), tables,
            nt, ns, nsmp, ncp, nt - ndec, ndec, p.max_seqlen_q, max_k,
        )

    def table_width(self, plan: StepPlan | None = None) -> int:
        """Block-table columns this step uses: the blocks of its longest context (all columns
        without a block size)."""
        self._check_plan(plan)
        if self._block_size is None:
            return self._max_blocks
        return min(self._max_blocks, -(-self._plan.max_seqlen_k // self._block_size))

    def used_size(self, plan: StepPlan | None = None) -> int:
        """Elements of the buffer this step uses (block tables last, one row per sequence)."""
        self._check_plan(plan)
        return self._bt + self._plan.num_seqs * self._max_blocks

    def to(self, device: torch.device | str, plan: StepPlan | None = None) -> PlanViews:
        """The current step on `device`: one copy of the used part of the buffer, then the same
        views. The used part is everything before the block tables plus the step's rows of them,
        each cut to `table_width()` columns (with Qwen3's max_model_len of 40,960 a full row is 2,560
        columns, 2.6 MB per step at batch 256, where a 1,024-token context needs 64).

        On CPU this is `views()` (the host views are the result). On CUDA the copy is staged
        through pinned memory and issued non_blocking on the current stream, so kernels queued
        after it on that stream see the data without a host synchronization.
        """
        self._check_plan(plan)
        try:
            dev = self._devices[device]
        except KeyError:
            dev = self._devices[device] = self._new_device(torch.device(device))
        if dev is None:
            return self._views(self._host_views)
        ns, bt = self._plan.num_seqs, self._bt
        width = self.table_width()
        used = bt + ns * width
        if dev.pinned is not None:
            assert dev.event is not None
            # The previous step's copy has normally finished long ago (reading its sampled
            # tokens synchronized); this only guards the staging buffer against reuse.
            dev.event.synchronize()
            staged = dev.pinned
        else:
            # Other devices: assembled here, then a blocking copy (the core rewrites the source
            # next step).
            staged = torch.empty(used, dtype=torch.int32)
        staged[:bt].copy_(self._host[:bt])
        staged[bt:used].view(ns, width).copy_(self._host_tables[:ns, :width])
        if dev.pinned is not None:
            dev.buffer[:used].copy_(staged[:used], non_blocking=True)
            dev.event.record()
        else:
            dev.buffer[:used].copy_(staged[:used])
        return self._views(dev.views, width)
