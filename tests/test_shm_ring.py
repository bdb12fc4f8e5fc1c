"""The shared-memory step ring: a real StepPlan published and received (both ends in this process),
header fields, LOGITS and STOP messages, slot reuse past the ring's size, unlinking."""

from __future__ import annotations

import os

import numpy as np
import pytest

from nanovllm import _C
from nanovllm.distributed import shm_ring
from nanovllm.distributed.shm_ring import ShmRing
from nanovllm.distributed.step_message import Kind, PlanLayout


def scheduler() -> _C.Scheduler:
    return _C.Scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
                        enable_prefix_caching=True, eos_token_ids=[0], vocab_size=100)


def test_round_trip_header_wraparound_and_unlink() -> None:
    core = scheduler()
    for sid, n in enumerate([5, 9, 3]):
        core.add(sid, list(range(1, n + 1)), max_tokens=20)
    plan = core.schedule()
    layout = PlanLayout.of(plan, 4)
    writer = ShmRing.create(layout, num_workers=1)
    reader = ShmRing.attach(writer.name, layout, num_workers=1, worker_index=0)
    assert os.path.exists(f"/dev/shm{writer.name}")
    writer.unlink()
    assert not os.path.exists(f"/dev/shm{writer.name}")
    try:
        # More messages than slots: every slot is reused several times, after the reader's ack.
        for step in range(3 * shm_ring.SLOTS):
            writer.publish_step(plan)
            msg = reader.receive()
            assert msg.kind is Kind.STEP and msg.plan is not None
            got = msg.plan
            for field in ("num_tokens", "num_seqs", "num_samples", "num_copies", "num_decode_tokens",
                          "max_seqlen_q", "max_seqlen_k"):
                assert getattr(got, field) == getattr(plan, field), field
            o = layout.offsets
            for name in ("input_ids", "positions", "slot_mapping", "sample_indices"):
                n = len(getattr(plan, name))
                np.testing.assert_array_equal(got.buffer[o[name]:o[name] + n], getattr(plan, name))
            np.testing.assert_array_equal(got.cu_seqlens_q, plan.cu_seqlens_q)
            np.testing.assert_array_equal(got.context_lens, plan.context_lens)
            used = layout.used_size(plan.num_seqs)
            np.testing.assert_array_equal(got.buffer[o["block_tables"]:used], plan.buffer[o["block_tables"]:used])
            reader.ack()
            writer.publish_logits(np.array([2, 0, 1], dtype=np.int32))
            msg = reader.receive()
            assert msg.kind is Kind.LOGITS and msg.rows is not None and msg.rows.tolist() == [2, 0, 1]
            reader.ack()
            core.postprocess(np.full(plan.num_samples, 7, dtype=np.int32))
            plan = core.schedule()  # decodes now: other counts, same buffer
        writer.publish_stop()
        assert reader.receive().kind is Kind.STOP
        reader.ack()
    finally:
        reader.close()
        writer.close()


def test_writer_waits_for_the_slowest_reader_and_checks_liveness() -> None:
    core = scheduler()
    core.add(0, [1, 2, 3], max_tokens=5)
    plan = core.schedule()
    layout = PlanLayout.of(plan, 4)
    writer = ShmRing.create(layout, num_workers=2)
    readers = [ShmRing.attach(writer.name, layout, 2, i) for i in range(2)]
    writer.unlink()
    for _ in range(shm_ring.SLOTS):
        writer.publish_step(plan)
    # Both slots are taken and reader 1 has acked nothing: the next publish waits, asking `alive`.

    class Gone(Exception):
        pass

    def alive() -> None:
        raise Gone

    with pytest.raises(Gone):
        writer.publish_step(plan, alive)
    for r in readers:
        r.receive()
        r.ack()
    writer.publish_step(plan, alive)  # a slot is free again
    for r in [*readers, writer]:
        r.close()


def test_attach_checks_the_segment_size() -> None:
    core = scheduler()
    core.add(0, [1, 2], max_tokens=2)
    layout = PlanLayout.of(core.schedule(), 4)
    writer = ShmRing.create(layout, num_workers=1)
    try:
        with pytest.raises(ValueError, match=r"expected \d+ \(engine options differ"):
            ShmRing.attach(writer.name, layout, num_workers=2, worker_index=1)
    finally:
        writer.close()


def test_block_tables_match_the_plan_as_rows_change_sequences() -> None:
    """Only block-table entries new to a slot are copied (PlanMirror): as sequences finish, get
    preempted (their tables freed and rebuilt) and rows move to other sequences, every used row of
    every slot still reads exactly like the plan's, -1 padding included."""
    core = _C.Scheduler(num_blocks=14, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=64,
                        enable_prefix_caching=False, eos_token_ids=[0], vocab_size=100)
    for sid, (n, out) in enumerate([(5, 12), (9, 3), (3, 20), (7, 8), (11, 15), (2, 6)]):
        core.add(sid, list(range(1, n + 1)), max_tokens=out, ignore_eos=True)
    plan = core.schedule()
    layout = PlanLayout.of(plan, 4)
    writer = ShmRing.create(layout, num_workers=1)
    reader = ShmRing.attach(writer.name, layout, num_workers=1, worker_index=0)
    writer.unlink()
    try:
        steps = 0
        while plan.num_seqs:
            writer.publish_step(plan)
            got = reader.receive().plan
            assert got is not None and got.num_seqs == plan.num_seqs
            off = layout.offsets
            for name in ("input_ids", "positions", "slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens",
                         "sample_indices"):
                want = getattr(plan, name)
                np.testing.assert_array_equal(got.buffer[off[name]:off[name] + len(want)], want, err_msg=name)
            tables = got.buffer[off["block_tables"]:layout.used_size(plan.num_seqs)]
            np.testing.assert_array_equal(tables.reshape(plan.num_seqs, -1), plan.block_tables)
            reader.ack()
            core.postprocess(np.full(plan.num_samples, 7, dtype=np.int32))
            plan = core.schedule()
            steps += 1
        assert core.num_preemptions > 0 and steps > 2 * shm_ring.SLOTS
    finally:
        reader.close()
        writer.close()
