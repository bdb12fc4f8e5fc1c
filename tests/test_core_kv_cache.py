"""KV cache manager behaviour through the scheduler: block tables, slots, prefix hits, fork and
copy-on-write, freeing order. Hand-worked examples with exact expected values."""

import numpy as np
import pytest

from core_helpers import make_scheduler, step


def test_seven_token_prompt_block_size_four() -> None:
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add(0, [11, 12, 13, 14, 15, 16, 17], max_tokens=4)
    plan = s.schedule()
    assert plan.input_ids.tolist() == [11, 12, 13, 14, 15, 16, 17]
    assert plan.positions.tolist() == list(range(7))
    assert plan.slot_mapping.tolist() == list(range(7))
    assert plan.block_tables[0, :3].tolist() == [0, 1, -1]
    assert (plan.block_tables[0, 2:] == -1).all()
    assert plan.cu_seqlens_q.tolist() == [0, 7]
    assert plan.cu_seqlens_k.tolist() == [0, 7]
    assert plan.context_lens.tolist() == [7]
    assert plan.sample_indices.tolist() == [6]
    assert (plan.num_prefill_tokens, plan.num_decode_tokens) == (7, 0)
    assert (plan.max_seqlen_q, plan.max_seqlen_k) == (7, 7)
    assert s.postprocess([18]) == []
    assert s.token_ids(0) == [11, 12, 13, 14, 15, 16, 17, 18]
    assert s.num_computed_tokens(0) == 7

    plan = s.schedule()  # decode: token 18 at position 7 fills block 1
    assert plan.input_ids.tolist() == [18]
    assert plan.positions.tolist() == [7]
    assert plan.slot_mapping.tolist() == [1 * 4 + 3]
    assert plan.context_lens.tolist() == [8]
    assert (plan.num_prefill_tokens, plan.num_decode_tokens, plan.num_decode_seqs) == (0, 1, 1)
    s.postprocess([19])
    plan = s.schedule()  # position 8 needs a new block
    assert s.block_table(0) == [0, 1, 2]
    assert plan.slot_mapping.tolist() == [8]
    assert plan.block_tables[0, :4].tolist() == [0, 1, 2, -1]


def test_fork_then_diverging_writes_copy_once() -> None:
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add(0, [1, 2, 3, 4, 5, 6, 7], max_tokens=8)
    step(s, token=8)
    s.fork(0, 1)
    assert s.block_table(1) == s.block_table(0) == [0, 1]
    assert s.ref_count(0) == 2 and s.ref_count(1) == 2
    assert s.stats()["num_used_blocks"] == 2

    plan = s.schedule()
    # Both write position 7 into shared, partly filled block 1: the first writer copies it.
    assert plan.block_copies.tolist() == [[1, 2]]
    assert s.block_table(0) == [0, 2]
    assert s.block_table(1) == [0, 1]
    assert s.ref_count(1) == 1 and s.ref_count(2) == 1
    assert s.ref_count(0) == 2  # full block 0 stays shared
    assert plan.slot_mapping.tolist() == [2 * 4 + 3, 1 * 4 + 3]
    assert plan.block_tables[:, :2].tolist() == [[0, 2], [0, 1]]
    s.postprocess([100, 200])
    assert s.token_ids(0)[-1] == 100 and s.token_ids(1)[-1] == 200

    plan = s.schedule()
    assert plan.num_copies == 0  # nothing shared is written any more
    s.postprocess([101, 201])
    s.abort(0)
    s.abort(1)
    assert s.stats()["num_free_blocks"] == 8


def test_fork_at_block_boundary_needs_no_copy() -> None:
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add(0, [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=8)
    step(s)
    s.fork(0, 1)
    plan = s.schedule()
    assert plan.num_copies == 0
    assert s.block_table(0)[:2] == s.block_table(1)[:2] == [0, 1]
    assert s.block_table(0)[2] != s.block_table(1)[2]


def test_prefix_hit_reuses_full_blocks_and_computes_last_token() -> None:
    s = make_scheduler(num_blocks=8, block_size=4)
    prompt = list(range(100, 109))  # 9 tokens: two full blocks + 1
    s.add(0, prompt, max_tokens=1)
    _, finished = step(s)
    assert finished == [(0, "length", None)]
    assert s.stats()["num_cached_blocks"] == 2
    s.add(1, prompt, max_tokens=1)
    plan = s.schedule()
    assert s.block_table(1)[:2] == [0, 1]
    assert plan.input_ids.tolist() == [108]
    assert plan.positions.tolist() == [8]
    assert plan.context_lens.tolist() == [9]
    assert plan.cu_seqlens_k.tolist() == [0, 9]
    stats = s.stats()
    assert stats["prefix_cache_queries"] == 18
    assert stats["prefix_cache_hits"] == 8


def test_prompt_of_whole_blocks_recomputes_its_last_block() -> None:
    s = make_scheduler(num_blocks=8, block_size=4)
    prompt = list(range(8))
    s.add(0, prompt, max_tokens=1)
    step(s)
    s.add(1, prompt, max_tokens=1)
    plan = s.schedule()
    assert plan.positions.tolist() == [4, 5, 6, 7]
    assert s.stats()["prefix_cache_hits"] == 4


def test_generated_tokens_are_cached_for_the_next_turn() -> None:
    s = make_scheduler(num_blocks=16, block_size=4)
    s.add(0, [1, 2, 3], max_tokens=6)
    tokens = iter(range(50, 60))
    while s.has_unfinished():
        plan = s.schedule()
        s.postprocess([next(tokens) for _ in range(plan.num_samples)])
    history = [1, 2, 3, 50, 51, 52, 53, 54, 55]  # 8 computed + the last, never computed
    s.add(1, history + [9, 9], max_tokens=1)
    plan = s.schedule()
    assert plan.positions.tolist()[0] == 8
    assert s.stats()["prefix_cache_hits"] == 8


def test_hash_collision_is_not_trusted() -> None:
    # Different content never hits, even in a pool full of cached blocks.
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add(0, [1, 2, 3, 4, 5], max_tokens=1)
    step(s)
    s.add(1, [1, 2, 3, 5, 5], max_tokens=1)
    s.schedule()
    assert s.stats()["prefix_cache_hits"] == 0


def test_free_in_reverse_order_evicts_tail_first() -> None:
    s = make_scheduler(num_blocks=6, block_size=2)
    s.add(0, [1, 2, 3, 4, 5, 6, 7], max_tokens=1)  # blocks 0..3, block 3 partial
    step(s)
    # Unhashed partial block 3 goes to the head; hashed blocks 2, 1, 0 to the tail in that order.
    assert s.free_queue() == [3, 4, 5, 2, 1, 0]


def test_prefix_caching_off_never_hits_or_caches() -> None:
    s = make_scheduler(num_blocks=8, block_size=4, enable_prefix_caching=False)
    s.add(0, list(range(9)), max_tokens=1)
    step(s)
    s.add(1, list(range(9)), max_tokens=1)
    plan = s.schedule()
    assert plan.num_tokens == 9
    assert s.stats()["num_cached_blocks"] == 0


def test_block_table_rows_stay_correct_when_batch_shifts() -> None:
    s = make_scheduler(num_blocks=32, block_size=2, max_model_len=32)
    for i in range(3):
        s.add(i, [10 * i + j for j in range(5 + 2 * i)], max_tokens=3 + i)
    while s.has_unfinished():
        plan = s.schedule()
        for row, sid in enumerate(plan.seq_ids.tolist()):
            table = s.block_table(sid)
            expected = table + [-1] * (plan.max_blocks_per_seq - len(table))
            assert plan.block_tables[row].tolist() == expected
        s.postprocess(np.full(plan.num_samples, 1, dtype=np.int64))


def test_parallel_samples_fork_in_postprocess_and_copy_on_first_write() -> None:
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add(0, [1, 2, 3, 4, 5, 6, 7], max_tokens=8)
    s.schedule()
    # The prompt is prefilled once; its one logits row gave three samples.
    assert s.postprocess([8], forks=[(0, 1, 9), (0, 2, 10)]) == []
    assert [s.token_ids(i)[-1] for i in range(3)] == [8, 9, 10]
    assert s.block_table(0) == s.block_table(1) == s.block_table(2) == [0, 1]
    assert (s.ref_count(0), s.ref_count(1)) == (3, 3)
    plan = s.schedule()
    # Each writes position 7 into shared block 1: two private copies, the last writer keeps it.
    assert plan.block_copies.tolist() == [[1, 2], [1, 3]]
    assert plan.slot_mapping.tolist() == [2 * 4 + 3, 3 * 4 + 3, 1 * 4 + 3]
    assert (s.ref_count(0), s.ref_count(1)) == (3, 1)


def test_fork_child_that_finishes_at_once_never_runs() -> None:
    s = make_scheduler(num_blocks=8, block_size=4, eos_token_ids=(2,))
    s.add(0, [5, 6, 7], max_tokens=4)
    s.schedule()
    assert s.postprocess([8], forks=[(0, 1, 2)]) == [(1, "stop", 2)]
    assert s.num_running == 1 and s.ref_count(0) == 1


def test_postprocess_fork_validation() -> None:
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4, vocab_size=50)
    s.add(0, [1, 2], max_tokens=8)
    s.add(1, [1, 2, 3, 4, 5], max_tokens=8)  # only partly prefilled: not sampled
    s.schedule()
    with pytest.raises(ValueError, match="not sampled"):
        s.postprocess([3], forks=[(1, 9, 3)])
    with pytest.raises(KeyError):
        s.postprocess([3], forks=[(7, 9, 3)])
    with pytest.raises(ValueError, match="already in use"):
        s.postprocess([3], forks=[(0, 1, 3)])
    with pytest.raises(ValueError, match="already in use"):
        s.postprocess([3], forks=[(0, 9, 3), (0, 9, 4)])
    with pytest.raises(ValueError, match="outside"):
        s.postprocess([3], forks=[(0, 9, 50)])
    with pytest.raises(ValueError, match="parent_id, child_id, token"):
        s.postprocess([3], forks=[(0, 9)])
    assert s.postprocess([3], forks=[(0, 9, 4)]) == []
    assert s.token_ids(9) == [1, 2, 4]


def test_sequence_can_opt_out_of_prefix_cache_reads() -> None:
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add(0, list(range(9)), max_tokens=1)
    step(s)
    s.add(1, list(range(9)), max_tokens=1, use_prefix_cache=False)
    plan = s.schedule()
    assert plan.positions.tolist() == list(range(9))
    assert s.stats()["prefix_cache_hits"] == 0
