"""The native pieces of the tensor-parallel step ring on plain numpy memory (so that
scripts/sanitize_core.sh runs them under ASan/UBSan): StepPlan.copy_used with a PlanMirror
writes a copy whose used part reads exactly like the plan as rows change sequences;
StepRingWriter's slots, counter, and refusal to reuse a slot a worker has not acked;
StepRingReader's poll and ack against it."""

from __future__ import annotations

import numpy as np
import pytest

from nanovllm import _C

HEADER, LINE = 16, 8  # int32 header fields per slot; int64 words per control line (shm_ring.py)
SECTIONS = ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens", "sample_indices")


def scheduler() -> _C.Scheduler:
    return _C.Scheduler(num_blocks=14, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=64,
                        enable_prefix_caching=False, eos_token_ids=[0], vocab_size=100)


def assert_copy_reads_like(plan: _C.StepPlan, counts: np.ndarray, dst: np.ndarray) -> None:
    assert counts[:7].tolist() == [plan.num_tokens, plan.num_seqs, plan.num_samples, plan.num_copies,
                                   plan.num_decode_tokens, plan.max_seqlen_q, plan.max_seqlen_k]
    off = plan.offsets
    for name in SECTIONS:
        want = getattr(plan, name)
        np.testing.assert_array_equal(dst[off[name]:off[name] + len(want)], want, err_msg=name)
    start = off["block_tables"]
    rows = dst[start:start + plan.num_seqs * plan.max_blocks_per_seq].reshape(plan.num_seqs, -1)
    np.testing.assert_array_equal(rows, plan.block_tables)


def test_copy_used_with_a_mirror_follows_rows_through_preemption_and_finishing() -> None:
    core = scheduler()
    for sid, (n, out) in enumerate([(5, 12), (9, 3), (3, 20), (7, 8), (11, 15), (2, 6)]):
        core.add(sid, list(range(1, n + 1)), max_tokens=out, ignore_eos=True)
    plan = core.schedule()
    dst = np.full(len(plan.buffer), -1, dtype=np.int32)
    counts = np.zeros(7, dtype=np.int32)
    mirror = _C.PlanMirror(6)
    assert mirror.rows == 6 and plan.num_seqs > 1
    with pytest.raises(ValueError, match="fewer rows"):
        plan.copy_used(counts.ctypes.data, dst.ctypes.data, len(dst), _C.PlanMirror(1))
    with pytest.raises(ValueError, match="smaller than the plan"):
        plan.copy_used(counts.ctypes.data, dst.ctypes.data, len(dst) - 1, mirror)
    steps = 0
    while plan.num_seqs:
        plan.copy_used(counts.ctypes.data, dst.ctypes.data, len(dst), mirror)
        assert_copy_reads_like(plan, counts, dst)
        core.postprocess(np.full(plan.num_samples, 7, dtype=np.int32))
        plan = core.schedule()
        steps += 1
    assert core.num_preemptions > 0 and steps > 4


def test_ring_writer_fills_slots_in_turn_and_waits_for_every_ack() -> None:
    core = scheduler()
    core.add(0, [1, 2, 3, 4, 5], max_tokens=4)
    plan = core.schedule()
    workers, slots = 2, 2
    slot_ints = HEADER + len(plan.buffer)
    control = np.zeros(LINE * (1 + workers), dtype=np.int64)
    ring = np.full((slots, slot_ints), -1, dtype=np.int32)
    w = _C.StepRingWriter(control.ctypes.data, workers, ring.ctypes.data, slots, slot_ints, 6, ring)
    assert w.try_publish_step(plan) and w.next == 2 and control[0] == 1
    slot = ring[1]
    assert slot[:2].tolist() == [1, 1]  # message number 1, STEP
    assert_copy_reads_like(plan, slot[2:], slot[HEADER:])
    assert w.try_publish_rows(np.array([0, 3], dtype=np.int32)) and control[0] == 2
    assert ring[0, :2].tolist() == [2, 2] and ring[0, 9] == 2 and ring[0, HEADER:HEADER + 2].tolist() == [0, 3]
    # Message 3 needs slot 1 back: worker 0 acked message 1, worker 1 did not yet.
    control[LINE] = 2
    assert not w.try_publish_stop() and control[0] == 2 and w.next == 3
    control[2 * LINE] = 1
    assert w.try_publish_stop() and control[0] == 3
    assert ring[1, :2].tolist() == [3, 3]
    with pytest.raises(ValueError, match="too many rows"):
        w.try_publish_rows(np.zeros(slot_ints, dtype=np.int32))


def test_ring_reader_polls_the_writer_and_acks() -> None:
    core = scheduler()
    core.add(0, [1, 2, 3, 4, 5], max_tokens=4)
    plan = core.schedule()
    slot_ints = HEADER + len(plan.buffer)
    control = np.zeros(LINE * 2, dtype=np.int64)
    ring = np.full((2, slot_ints), -1, dtype=np.int32)
    w = _C.StepRingWriter(control.ctypes.data, 1, ring.ctypes.data, 2, slot_ints, 6, ring)
    r = _C.StepRingReader(control.ctypes.data, 1, 0, ring.ctypes.data, 2, slot_ints, ring)
    assert r.poll() is None and not r.ready()
    assert w.try_publish_step(plan)
    counts = (plan.num_tokens, plan.num_seqs, plan.num_samples, plan.num_copies, plan.num_decode_tokens,
              plan.max_seqlen_q, plan.max_seqlen_k)
    h = r.poll()
    assert r.ready() and h is not None and h[:2] == (1, 1) and h[2:9] == counts
    r.ack()
    assert control[LINE] == 1 and r.poll() is None
    assert w.try_publish_rows(np.array([4], dtype=np.int32))
    h = r.poll()
    assert h is not None and h[:2] == (0, 2) and h[9] == 1 and ring[0, HEADER] == 4
    r.ack()
    assert w.try_publish_stop() and w.try_publish_stop()  # messages 3 and 4: both slots were acked
    assert not w.try_publish_stop()  # message 5 needs message 3's slot back
    h = r.poll()
    assert h is not None and h[:2] == (1, 3)
    r.ack()
    assert w.try_publish_stop()
    ring[0, 0] = 99  # message 4's slot now claims another number
    with pytest.raises(RuntimeError, match="out of step"):
        r.poll()
