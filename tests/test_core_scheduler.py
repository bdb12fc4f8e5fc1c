"""Scheduling: chunked prefill, decode-first ordering, caps, preemption, finishing, abort, and
argument validation at the binding boundary."""

import numpy as np
import pytest

from core_helpers import make_scheduler, step
from nanovllm import _C


def test_chunked_prefill_mixed_with_decode() -> None:
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=4)
    s.add(0, [1, 2], max_tokens=10)
    step(s)  # seq 0 prefilled, now decoding
    s.add(1, list(range(10, 20)), max_tokens=2)
    plan, _ = step(s)
    # Decode of seq 0 first, then a 3-token chunk of seq 1 (budget 4); no sample for seq 1 yet.
    assert plan.seq_ids.tolist() == [0, 1]
    assert plan.cu_seqlens_q.tolist() == [0, 1, 4]
    assert plan.positions.tolist() == [2, 0, 1, 2]
    assert plan.context_lens.tolist() == [3, 3]
    assert plan.sample_indices.tolist() == [0]
    assert plan.sampled_seq_ids.tolist() == [0]
    assert (plan.num_decode_tokens, plan.num_prefill_tokens) == (1, 3)
    plan, _ = step(s)
    assert plan.positions.tolist() == [3, 3, 4, 5]
    plan, _ = step(s)
    assert plan.positions.tolist() == [4, 6, 7, 8]
    plan, _ = step(s)
    assert plan.positions.tolist() == [5, 9]
    assert plan.sample_indices.tolist() == [0, 1]
    assert s.num_computed_tokens(1) == 10


def test_several_prompts_admitted_in_one_step_in_arrival_order() -> None:
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=10)
    for i in range(4):
        s.add(i, [i + 1] * 4, max_tokens=1)
    plan = s.schedule()
    # 4 + 4 + 2 tokens: the third prompt gets a partial chunk, the fourth waits.
    assert plan.seq_ids.tolist() == [0, 1, 2]
    assert plan.cu_seqlens_q.tolist() == [0, 4, 8, 10]
    assert plan.sampled_seq_ids.tolist() == [0, 1]
    assert s.num_waiting == 1


def test_decodes_come_before_prefill_chunks() -> None:
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    s.add(0, [1] * 9, max_tokens=20)
    s.add(1, [2] * 3, max_tokens=20)
    step(s)
    s.add(2, [3] * 5, max_tokens=20)
    plan = s.schedule()
    assert plan.seq_ids.tolist() == [0, 1, 2]
    assert plan.num_decode_seqs == 2
    assert plan.cu_seqlens_q.tolist() == [0, 1, 2, 7]


def test_max_num_seqs_caps_running() -> None:
    s = make_scheduler(num_blocks=64, max_num_seqs=2)
    for i in range(3):
        s.add(i, [1, 2, 3], max_tokens=5)
    plan, _ = step(s)
    assert plan.num_seqs == 2 and s.num_running == 2 and s.num_waiting == 1


def test_a_prompt_that_fans_out_takes_a_slot_per_sample() -> None:
    """A prompt with num_samples=n is admitted only when n running slots are free (its first sample
    forks n - 1 children): the sequences, and the rows a step samples, never exceed max_num_seqs."""
    s = make_scheduler(num_blocks=64, max_num_seqs=4)
    s.add(0, [1, 2, 3], max_tokens=5, num_samples=3)
    s.add(1, [4, 5], max_tokens=1, num_samples=2)
    plan = s.schedule()
    assert plan.seq_ids.tolist() == [0] and s.num_waiting == 1  # 3 + 2 slots > 4
    s.postprocess([7], forks=[(0, 10, 8), (0, 11, 9)])
    assert s.num_running == 3
    plan, _ = step(s)
    assert sorted(plan.seq_ids.tolist()) == [0, 10, 11] and s.num_waiting == 1  # 3 slots + 2 > 4
    s.abort(11)
    plan, _ = step(s)
    assert sorted(plan.seq_ids.tolist()) == [0, 1, 10]  # 2 + 2 slots: it fits now
    with pytest.raises(ValueError, match="num_samples"):
        s.add(2, [1], num_samples=5)
    with pytest.raises(ValueError, match="num_samples"):
        s.add(2, [1], num_samples=0)


def test_preemption_of_most_recently_admitted() -> None:
    s = make_scheduler(num_blocks=4, block_size=2, max_model_len=16)
    s.add(0, [1, 2, 3], max_tokens=10)
    s.add(1, [4, 5, 6], max_tokens=10)
    step(s)  # each holds 2 blocks; the pool is full
    assert s.stats()["num_free_blocks"] == 0
    plan, _ = step(s)  # both write position 3 into their own second block
    assert plan.num_seqs == 2
    plan, _ = step(s)  # position 4 needs a third block: seq 1 (newest) is preempted
    assert s.num_preemptions == 1
    assert s.status(1) == "waiting" and s.block_table(1) == []
    assert plan.seq_ids.tolist() == [0]
    assert s.token_ids(1) == [4, 5, 6, 7, 7]  # kept for recompute
    while s.has_unfinished():
        step(s)
    assert s.stats()["num_free_blocks"] == 4


def test_preempted_sequence_recomputes_prompt_and_outputs() -> None:
    s = make_scheduler(num_blocks=4, block_size=2, max_model_len=16, enable_prefix_caching=False)
    s.add(0, [1, 2, 3], max_tokens=3)
    s.add(1, [4, 5, 6], max_tokens=3)
    step(s)
    step(s)
    step(s)  # preempts 1
    plans = []
    while s.has_unfinished():
        plan, _ = step(s)
        plans.append(plan.positions.tolist())
    # Once 0 finished, 1 was re-admitted and prefilled all of its 5 tokens at once.
    assert [0, 1, 2, 3, 4] in plans


def test_finish_reasons() -> None:
    s = make_scheduler(eos_token_ids=(2,), max_model_len=12)
    s.add(0, [5, 5], max_tokens=5)
    s.add(1, [5, 6], max_tokens=5, stop_token_ids=[9])
    s.add(2, [5, 7], max_tokens=5, ignore_eos=True)
    s.add(3, [5, 8], max_tokens=5, min_tokens=2)
    s.add(4, [5] * 10, max_tokens=50)
    s.schedule()
    assert s.postprocess([2, 9, 2, 2, 3]) == [(0, "stop", 2), (1, "stop", 9)]
    s.schedule()
    # min_tokens=2: a stop token cannot finish before two tokens came first.
    assert s.postprocess([2, 2, 3]) == [(4, "length", None)]  # 12 tokens = max_model_len
    s.schedule()
    assert s.postprocess([4, 2]) == [(3, "stop", 2)]
    for _ in range(2):
        s.schedule()
        out = s.postprocess([4])
    assert out == [(2, "length", None)]
    assert not s.has_unfinished()
    assert s.stats()["num_free_blocks"] == 16


def test_abort_in_every_state() -> None:
    s = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    s.add(0, [1] * 6, max_tokens=10)
    s.add(1, [2] * 6, max_tokens=10)
    s.add(2, [3] * 3, max_tokens=10)
    plan = s.schedule()  # 0 fully, 1 partially; 2 waiting
    s.abort(2)  # waiting
    s.abort(1)  # in the step in flight: released by postprocess
    assert s.status(1) == "running"
    s.postprocess([5] * plan.num_samples)
    with pytest.raises(KeyError):
        s.status(1)
    step(s)
    s.abort(0)  # running, not in flight
    assert not s.has_unfinished()
    assert s.stats()["num_free_blocks"] == 16
    with pytest.raises(KeyError, match="unknown sequence id 0"):
        s.abort(0)


def test_plan_buffer_is_one_persistent_array() -> None:
    s = make_scheduler()
    s.add(0, [1, 2, 3], max_tokens=4)
    plan = s.schedule()
    buf = plan.buffer
    offsets = plan.offsets
    assert list(offsets) == ["input_ids", "positions", "slot_mapping", "cu_seqlens_q", "cu_seqlens_k",
                             "context_lens", "sample_indices", "block_copies", "block_tables"]
    n = plan.num_tokens
    assert buf[offsets["input_ids"] : offsets["input_ids"] + n].tolist() == [1, 2, 3]
    assert np.shares_memory(plan.slot_mapping, buf)
    assert plan.used_size == offsets["block_tables"] + plan.num_seqs * plan.max_blocks_per_seq
    s.postprocess([1])
    assert s.schedule().buffer.__array_interface__["data"][0] == buf.__array_interface__["data"][0]


class TestValidation:
    def test_constructor(self) -> None:
        with pytest.raises(ValueError, match="num_blocks"):
            make_scheduler(num_blocks=0)
        with pytest.raises(ValueError, match="block_size"):
            make_scheduler(block_size=-1)
        with pytest.raises(ValueError, match="max_num_seqs"):
            make_scheduler(max_num_seqs=0)
        with pytest.raises(ValueError, match="eos_token_ids"):
            make_scheduler(eos_token_ids=(5,), vocab_size=4)

    def test_add(self) -> None:
        s = make_scheduler(num_blocks=4, block_size=4, max_model_len=32, vocab_size=100)
        with pytest.raises(ValueError, match="empty"):
            s.add(0, [])
        with pytest.raises(ValueError, match="max_model_len=32"):
            s.add(0, [1] * 33)
        with pytest.raises(ValueError, match="holds only 16"):
            s.add(0, [1] * 17)
        with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] = 100 is outside"):
            s.add(0, [1, 100])
        with pytest.raises(ValueError, match="outside"):
            s.add(0, [1, -1])
        with pytest.raises(ValueError, match="must be an int"):
            s.add(0, [1, 2.5])
        with pytest.raises(ValueError, match="must hold integers"):
            s.add(0, np.array([1.0, 2.0]))
        with pytest.raises(ValueError, match="sequence of token ids"):
            s.add(0, "hello")
        with pytest.raises(ValueError, match="max_tokens"):
            s.add(0, [1], max_tokens=0)
        with pytest.raises(ValueError, match="min_tokens"):
            s.add(0, [1], max_tokens=2, min_tokens=3)
        with pytest.raises(ValueError, match="stop_token_ids"):
            s.add(0, [1], stop_token_ids=[1000])
        with pytest.raises(ValueError, match="outside"):
            s.add(0, [1, 2**40])
        with pytest.raises(ValueError, match="outside"):
            s.add(0, np.array([1, 2**40], dtype=np.uint64))
        # Nothing above was added.
        assert not s.has_unfinished()
        s.add(0, np.array([1, 2], dtype=np.int64))
        with pytest.raises(ValueError, match="already in use"):
            s.add(0, [1])

    def test_step_protocol(self) -> None:
        s = make_scheduler(vocab_size=50)
        with pytest.raises(RuntimeError, match="no step in flight"):
            s.postprocess([])
        s.add(0, [1, 2])
        s.add(1, [1, 2])
        plan = s.schedule()
        with pytest.raises(RuntimeError, match="twice"):
            s.schedule()
        with pytest.raises(ValueError, match="fork"):
            s.fork(0, 5)
        with pytest.raises(ValueError, match="expected 2 sampled token ids, got 1"):
            s.postprocess([1])
        with pytest.raises(ValueError, match="outside"):
            s.postprocess([1, 50])
        # The failed calls changed nothing: the step can still complete.
        assert s.postprocess(np.array([3, 4], dtype=np.int32)) == []
        assert s.token_ids(0) == [1, 2, 3] and s.token_ids(1) == [1, 2, 4]
        assert plan.num_samples == 2

    def test_unknown_ids(self) -> None:
        s = make_scheduler()
        with pytest.raises(KeyError):
            s.fork(3, 4)
        with pytest.raises(KeyError):
            s.token_ids(3)
        s.add(1, [1])
        with pytest.raises(ValueError, match="already in use"):
            s.fork(1, 1)
        with pytest.raises(IndexError):
            s.ref_count(16)
