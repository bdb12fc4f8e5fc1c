"""PlanTensors: torch views of the StepPlan buffer equal the plan's numpy arrays, without copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm import _C
from nanovllm.worker.plan_tensors import PlanTensors, PlanViews

ARRAYS = ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens",
          "sample_indices", "block_copies", "block_tables")
SCALARS = ("num_tokens", "num_seqs", "num_samples", "num_copies", "num_prefill_tokens",
           "num_decode_tokens", "num_decode_seqs", "max_seqlen_q", "max_seqlen_k")


def make_scheduler() -> _C.Scheduler:
    # A small token budget forces chunked prefill, so steps mix decodes and prefill chunks.
    return _C.Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=24,
                        max_model_len=64, vocab_size=1000)


def assert_matches(views: PlanViews, plan: _C.StepPlan) -> None:
    """The views hold the plan's arrays; block tables may be cut to the columns the step uses
    (what a device copy takes), and then every column cut off is padding (-1)."""
    for name in ARRAYS:
        t = getattr(views, name)
        a = getattr(plan, name)
        if name == "block_tables" and t.shape[1] < a.shape[1]:
            assert (a[:, t.shape[1]:] == -1).all()
            a = a[:, :t.shape[1]]
        assert t.dtype == torch.int32, name
        assert tuple(t.shape) == a.shape, name
        np.testing.assert_array_equal(t.cpu().numpy(), a, err_msg=name)
    for name in SCALARS:
        assert getattr(views, name) == getattr(plan, name), name


def assert_aliases(views: PlanViews, plan: _C.StepPlan) -> None:
    """Every view lies in the core's buffer at its section's offset: no copy was made."""
    base = plan.buffer.ctypes.data
    for name in ARRAYS:
        t = getattr(views, name)
        assert t.device.type == "cpu"
        # Storage and offset rather than data_ptr(), which is 0 for an empty tensor.
        assert t.untyped_storage().data_ptr() == base, name
        assert t.storage_offset() == plan.offsets[name], name
        if t.numel():
            assert np.shares_memory(t.numpy(), plan.buffer), name


def run_steps(sched: _C.Scheduler, pts: list[PlanTensors] | None) -> tuple[list[PlanTensors], int, int]:
    """Steps until done, checking each plan; returns the converters, steps and copies seen."""
    rng = np.random.default_rng(0)
    first = sched.schedule()
    if pts is None:
        pts = [PlanTensors(first), PlanTensors(first, cache_views=False)]
    plan, address, steps, copies = first, first.buffer.ctypes.data, 0, 0
    while True:
        # The core reuses one StepPlan over one buffer; PlanTensors wraps it once on that basis.
        assert plan is first
        assert plan.buffer.ctypes.data == address
        for pt in pts:
            views = pt.views(plan)
            assert_matches(views, plan)
            assert_aliases(views, plan)
            assert_matches(pt.to("cpu"), plan)
        steps += 1
        copies += plan.num_copies
        sched.postprocess(rng.integers(1, 1000, plan.num_samples).astype(np.int32))
        if not sched.has_unfinished():
            return pts, steps, copies
        plan = sched.schedule()


def test_views_equal_plan_arrays_over_chunked_prefill_and_decode() -> None:
    sched = make_scheduler()
    for i, n in enumerate((3, 9, 17, 30)):
        sched.add(i, list(range(1, n + 1)), max_tokens=5 + i, ignore_eos=True)
    _, steps, _ = run_steps(sched, None)
    assert steps > 5


def test_views_after_fork_include_copy_on_write_copy() -> None:
    sched = make_scheduler()
    # 10 prompt tokens in blocks of 4: after the prompt step the last block is partly filled.
    sched.add(0, list(range(1, 11)), max_tokens=8, ignore_eos=True)
    plan = sched.schedule()
    pts = [PlanTensors(plan), PlanTensors(plan, cache_views=False)]
    for pt in pts:
        assert_matches(pt.views(plan), plan)
    sched.postprocess(np.array([5], dtype=np.int32))
    # Fork, and more children after the first decode, so shared partly filled blocks are appended to.
    sched.fork(0, 1)
    plan = sched.schedule()
    for pt in pts:
        assert_matches(pt.views(plan), plan)
    seen_copies = plan.num_copies
    sched.postprocess(np.array([6, 7], dtype=np.int32))
    sched.fork(1, 2)
    sched.add(3, list(range(20, 27)), max_tokens=4, ignore_eos=True)
    _, _, copies = run_steps(sched, pts)
    # Siblings share the partly filled last block; their diverging appends must be copied.
    assert seen_copies + copies > 0


def test_views_are_cached_by_length_and_still_track_the_buffer() -> None:
    sched = make_scheduler()
    for i in range(3):
        sched.add(i, list(range(1, 6)), max_tokens=6, ignore_eos=True)
    plan = sched.schedule()
    pt = PlanTensors(plan)
    sched.postprocess(np.ones(plan.num_samples, dtype=np.int32))
    plan = sched.schedule()  # all decode: 3 tokens
    a = pt.views(plan)
    sched.postprocess(np.full(3, 2, dtype=np.int32))
    plan = sched.schedule()  # same shape: the same view objects, now showing this step
    b = pt.views(plan)
    assert b.input_ids is a.input_ids and b.block_tables is a.block_tables
    assert_matches(b, plan)
    assert b.input_ids.tolist() == [2, 2, 2]


def test_views_of_empty_plan() -> None:
    sched = make_scheduler()
    plan = sched.schedule()
    views = PlanTensors(plan).views(plan)
    assert_matches(views, plan)
    assert views.num_tokens == 0 and tuple(views.block_tables.shape) == (0, plan.max_blocks_per_seq)
    sched.postprocess([])


def test_used_size_matches_plan() -> None:
    sched = make_scheduler()
    sched.add(0, list(range(1, 8)), max_tokens=2)
    plan = sched.schedule()
    pt = PlanTensors(plan)
    assert pt.used_size(plan) == plan.used_size
    assert pt.host_buffer.data_ptr() == plan.buffer.ctypes.data
    sched.postprocess([1])


@pytest.mark.parametrize("block_size", [None, 4])
def test_copy_path_takes_the_same_views_of_a_second_buffer(block_size: int | None) -> None:
    """The one-copy path of to(), run into a second CPU buffer (no accelerator needed).

    Registers a device entry by hand (private API): everything but the CUDA staging is shared
    with a real device. With the cache's block size, only the block-table columns of the step's
    longest context go over."""
    from nanovllm.worker.plan_tensors import _DeviceCopy

    sched = make_scheduler()
    for i, n in enumerate((3, 9, 17)):
        sched.add(i, list(range(1, n + 1)), max_tokens=4, ignore_eos=True)
    plan = sched.schedule()
    pt = PlanTensors(plan, block_size=block_size)
    copy = torch.full_like(pt.host_buffer, -7)
    pt._devices["second"] = _DeviceCopy(copy, pt._maker(copy))
    views = pt.to("second", plan)
    # Only the used prefix is copied (later steps may leave stale rows past their own prefix).
    assert (copy[pt.used_size(plan):] == -7).all()
    rng = np.random.default_rng(0)
    widths = set()
    while True:
        views = pt.to("second", plan)
        assert_matches(views, plan)
        assert views.input_ids.untyped_storage().data_ptr() == copy.data_ptr()
        assert views.block_tables.is_contiguous()
        widths.add(views.block_tables.shape[1])
        expect = plan.max_blocks_per_seq if block_size is None else -(-plan.max_seqlen_k // block_size)
        assert views.block_tables.shape[1] == expect
        sched.postprocess(rng.integers(1, 1000, plan.num_samples).astype(np.int32))
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
    assert len(widths) > 1 or block_size is None  # contexts grew: the width followed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_cuda_copies_once_and_takes_the_same_views() -> None:
    sched = make_scheduler()
    for i, n in enumerate((3, 9, 17)):
        sched.add(i, list(range(1, n + 1)), max_tokens=4, ignore_eos=True)
    plan = sched.schedule()
    pt = PlanTensors(plan, block_size=4)
    rng = np.random.default_rng(0)
    while True:
        views = pt.to("cuda", plan)
        torch.cuda.synchronize()
        assert views.input_ids.device.type == "cuda"
        assert_matches(views, plan)
        sched.postprocess(rng.integers(1, 1000, plan.num_samples).astype(np.int32))
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
