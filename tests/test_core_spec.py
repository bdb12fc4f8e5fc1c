"""Speculative decoding in the core, through its bindings: the n-gram proposer's choice, the
checks on a step's tokens, rollback of rejected drafts (blocks freed, nothing hashed past the
accepted tokens), stops inside a row, per-sequence adaptation and the draft model's lookahead."""

from __future__ import annotations

import numpy as np
import pytest

from nanovllm import _C


def make(method: str = "ngram", k: int = 4, lookup: tuple[int, int] = (1, 3), **kwargs: object) -> _C.Scheduler:
    args = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                vocab_size=100, eos_token_ids=[99], spec_method=method, num_speculative_tokens=k,
                prompt_lookup_min=lookup[0], prompt_lookup_max=lookup[1])
    args.update(kwargs)
    return _C.Scheduler(**args)


def prefill(s: _C.Scheduler, sid: int, prompt: list[int], first: int, **kwargs: object) -> None:
    s.add(sid, prompt, **kwargs)
    plan = s.schedule()
    assert plan.num_draft_tokens == 0  # a prompt never has drafts
    s.postprocess([first])


def drafts_of(s: _C.Scheduler) -> list[int]:
    plan = s.schedule()
    n = int(plan.num_drafts[0])
    return plan.input_ids[len(plan.input_ids) - n:].tolist()


@pytest.mark.parametrize("tokens, lookup, expected", [
    ([1, 2, 3, 9, 8, 1, 2], (1, 3), [3, 9, 8, 1]),        # the suffix [1, 2] seen before: what followed
    ([5, 6, 7, 5, 6, 8, 5], (1, 1), [6, 7, 5, 6]),        # the latest [5] has 3 after it: the first
    ([5, 6, 7, 5, 6, 8, 9, 1, 5], (1, 1), [6, 8, 9, 1]),  # the latest [5], with 4 after it
    ([1, 2, 3, 4, 9, 2, 3, 4, 7, 1, 2, 3], (2, 4), [4, 9, 2, 3]),  # the longest suffix wins ([1, 2, 3])
    ([1, 2, 3, 4, 5, 6], (1, 3), []),                     # nothing repeats
    ([4, 4], (1, 2), [4]),                                # drafts stop at the sequence's end
])
def test_ngram_proposals(tokens: list[int], lookup: tuple[int, int], expected: list[int]) -> None:
    s = make(lookup=lookup)
    prefill(s, 0, tokens[:-1], tokens[-1], max_tokens=50)
    assert drafts_of(s) == expected


def test_step_tokens_are_checked() -> None:
    s = make()
    prefill(s, 0, [1, 2, 3, 1, 2], 3, max_tokens=50)
    plan = s.schedule()
    assert plan.num_drafts.tolist() == [3]  # all that follows the earlier [1, 2, 3]
    with pytest.raises(ValueError, match="takes 1 to 4"):
        s.postprocess_spec([1, 2, 3, 4, 5], [0, 5])
    with pytest.raises(ValueError, match="takes 1 to 4"):
        s.postprocess_spec([], [0, 0])
    with pytest.raises(ValueError, match="token_offsets must be 2 prefix sums"):
        s.postprocess_spec([1, 2], [0, 1])
    with pytest.raises(ValueError, match="drafts are handed in only"):
        s.postprocess_spec([1], [0, 1], drafts=[1], draft_offsets=[0, 1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.postprocess_spec([100], [0, 1])
    finished, kept = s.postprocess_spec([1, 50], [0, 2])  # nothing changed by the refusals above
    assert finished == [] and kept.tolist() == [2]
    assert s.token_ids(0) == [1, 2, 3, 1, 2, 3, 1, 50]


def test_rejected_drafts_roll_back() -> None:
    s = make(k=8, lookup=(1, 1), block_size=2)
    prefill(s, 0, [7, 1, 2, 3, 4, 5, 6, 8, 9], 7, max_tokens=50)
    plan = s.schedule()
    drafts = plan.input_ids[1:].tolist()
    assert drafts == [1, 2, 3, 4, 5, 6, 8, 9]
    used = s.stats()["num_used_blocks"]
    finished, kept = s.postprocess_spec([1, 2, 42], [0, 3])  # two accepted, then another token
    assert kept.tolist() == [3] and not finished
    assert s.token_ids(0) == [7, 1, 2, 3, 4, 5, 6, 8, 9, 7, 1, 2, 42]
    assert s.num_computed_tokens(0) == 12
    # Blocks that held only rejected drafts are free again; every full block of accepted tokens is cached.
    assert len(s.block_table(0)) == 6 and s.stats()["num_used_blocks"] == 6 < used
    assert s.stats()["num_cached_blocks"] == 6
    stats = s.stats()
    assert (stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]) == (8, 2)
    assert stats["spec_num_accepted_tokens_per_pos"][:3] == [1, 1, 0]


def test_stop_inside_a_row() -> None:
    s = make()
    prefill(s, 0, [5, 6, 5, 99, 6, 5], 6, max_tokens=50)  # EOS (99) among the drafts
    assert drafts_of(s) == [5, 99, 6, 5]
    finished, kept = s.postprocess_spec([5, 99, 6, 5, 7], [0, 5])
    assert finished == [(0, "stop", 99)] and kept.tolist() == [2]
    assert s.stats()["num_used_blocks"] == 0
    s = make()
    prefill(s, 0, [5, 6, 5], 6, max_tokens=3)
    plan = s.schedule()
    assert plan.num_drafts.tolist() == [1]  # max_tokens 3: one draft, then one more token at most
    finished, kept = s.postprocess_spec([5, 6], [0, 2])
    assert finished == [(0, "length", None)] and kept.tolist() == [2]


def test_adaptive_drafting_backs_off() -> None:
    s = make(k=4, lookup=(1, 1))
    prefill(s, 0, list(range(3, 13)) * 3, 3, max_tokens=200)
    seen = []
    for _ in range(12):
        plan = s.schedule()
        seen.append(int(plan.num_drafts[0]))
        s.postprocess_spec([3], [0, 1])  # reject every draft (there is always one: what followed the last 3)
    # Stops drafting for a while after two empty verifications (cooldowns that double).
    assert seen[0] == 4 and 0 in seen, seen
    assert seen[seen.index(0):].count(0) < len(seen) - seen.index(0), "never drafts again"
    # A partly accepted n-gram row keeps its k (its drafts cost only their verification).
    partial = make(k=4, lookup=(1, 1))
    prefill(partial, 0, list(range(3, 13)) * 3, 3, max_tokens=200)
    assert partial.schedule().num_drafts.tolist() == [4]  # 4 5 6 7, after the first 3
    partial.postprocess_spec([4, 5, 3], [0, 3])  # two accepted, then 3 where 6 was drafted
    assert partial.schedule().num_drafts.tolist() == [4]
    # Without adaptation the same rejections never pause drafting.
    fixed = make(k=4, lookup=(1, 1), adaptive_speculation=False)
    prefill(fixed, 0, list(range(3, 13)) * 3, 3, max_tokens=200)
    seen_fixed = []
    for _ in range(12):
        seen_fixed.append(int(fixed.schedule().num_drafts[0]))
        fixed.postprocess_spec([3], [0, 1])
    assert seen_fixed == [4] * 12, seen_fixed


def test_draft_model_k_adapts_as_assisted_generation() -> None:
    """Handed-in drafts (a draft model's): one fewer after a rejection, two more after a fully
    accepted row, never above num_speculative_tokens."""
    s = make("external", k=4, block_size=2)
    s.add(0, [1, 2, 3], max_tokens=100)
    s.schedule()
    s.postprocess_spec([4], [0, 1], drafts=[5, 6, 7, 8], draft_offsets=[0, 4])
    assert s.schedule().num_drafts.tolist() == [4]
    s.postprocess_spec([5, 9], [0, 2], drafts=[1, 2, 3, 4], draft_offsets=[0, 4])  # 5 accepted, 9 rejects 6
    assert s.schedule().num_drafts.tolist() == [3]  # the row holds the first 3 of the 4 handed in
    s.postprocess_spec([1, 2, 3, 7], [0, 4], drafts=[1, 2, 3, 4], draft_offsets=[0, 4])  # all 3 accepted
    assert s.schedule().num_drafts.tolist() == [4]  # min(3 + 2, k)


def test_draft_model_lookahead() -> None:
    s = make("external", k=3, block_size=2)
    s.add(0, [1, 2, 3], max_tokens=50)
    s.schedule()
    # The prompt row holds 3 lookahead slots past its tokens for the draft model's passes.
    assert len(s.block_table(0)) == 3
    s.postprocess_spec([4], [0, 1], drafts=[5, 6, 7], draft_offsets=[0, 3])
    assert len(s.block_table(0)) == 2  # trimmed back to the computed tokens
    plan = s.schedule()
    assert plan.input_ids.tolist() == [4, 5, 6, 7] and plan.num_drafts.tolist() == [3]
    assert len(s.block_table(0)) == 5  # (3 + 1 + 3 drafts) tokens + 3 lookahead slots
    finished, kept = s.postprocess_spec([5, 9], [0, 2], drafts=[1], draft_offsets=[0, 1])
    assert s.token_ids(0) == [1, 2, 3, 4, 5, 9] and s.num_computed_tokens(0) == 5
    assert len(s.block_table(0)) == 3


def test_beam_rows_never_draft() -> None:
    s = make(k=4, lookup=(1, 1))
    s.add(0, [3, 4, 3, 4, 3], max_tokens=20)
    s.disable_spec(0)
    s.schedule()
    s.postprocess([4])
    assert s.schedule().num_draft_tokens == 0
    with pytest.raises(ValueError, match="before the sequence first runs"):
        s.disable_spec(0)


def test_bad_spec_arguments() -> None:
    with pytest.raises(ValueError, match="spec_method"):
        make("eagle")
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        make(lookup=(3, 2))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make(k=0)
    assert np.array_equal(make("none", k=0).schedule().num_drafts, np.zeros(0))


def reference_rows(num_drafts: np.ndarray, sample_indices: np.ndarray, input_ids: np.ndarray) -> tuple[list, list]:
    positions, drafts = [], []
    for d, last in zip(num_drafts.tolist(), sample_indices.tolist()):
        for p in range(last - d, last + 1):
            positions.append(p)
            drafts.append(int(input_ids[p + 1]) if p < last else -1)
    return positions, drafts


def reference_accept(tokens: list[int], drafts: list[int], num_drafts: np.ndarray) -> tuple[list, list, list]:
    emitted, offsets, rows, row = [], [0], [], 0
    for d in num_drafts.tolist():
        for j in range(row, row + d + 1):
            emitted.append(tokens[j])
            rows.append(j)
            if tokens[j] != drafts[j]:
                break
        offsets.append(len(emitted))
        row += d + 1
    return emitted, offsets, rows


@pytest.mark.parametrize("seed", range(20))
def test_verification_rows_and_greedy_acceptance_match_a_reference(seed: int) -> None:
    """The verification step's host bookkeeping in C++ against a loop written from its definition,
    on random plans (samples without drafts among them) and target tokens that agree with the
    drafts for a random stretch."""
    rng = np.random.default_rng(seed)
    samples = int(rng.integers(1, 7))
    num_drafts = rng.integers(0, 6, size=samples).astype(np.int32)
    lengths = num_drafts + 1 + rng.integers(0, 3, size=samples)  # a row may carry tokens before its drafts
    sample_indices = (np.cumsum(lengths) - 1).astype(np.int32)
    input_ids = rng.integers(0, 50, size=int(lengths.sum())).astype(np.int32)
    positions, drafts = _C.verification_rows(num_drafts, sample_indices, input_ids)
    assert (positions.tolist(), drafts.tolist()) == reference_rows(num_drafts, sample_indices, input_ids)
    assert positions.dtype == np.int64 and drafts.dtype == np.int64

    tokens = drafts.copy()
    row = 0
    for d in num_drafts.tolist():  # agree up to a random row, then differ (or agree all the way)
        cut = int(rng.integers(0, d + 2))
        tokens[row + cut:row + d + 1] = rng.integers(50, 60, size=d + 1 - cut)
        row += d + 1
    tokens[drafts < 0] = rng.integers(0, 50, size=int((drafts < 0).sum()))
    emitted, offsets, rows = _C.accept_greedy(tokens, drafts, num_drafts)
    assert (emitted.tolist(), offsets.tolist(), rows.tolist()) == reference_accept(tokens.tolist(), drafts.tolist(),
                                                                                   num_drafts)
    assert emitted.dtype == np.int32 and offsets.dtype == np.int32
    assert ((np.diff(offsets) >= 1) & (np.diff(offsets) <= num_drafts + 1)).all()


@pytest.mark.parametrize("call, message", [
    (lambda: _C.verification_rows(np.array([-1], np.int32), np.array([3], np.int32), np.zeros(4, np.int32)),
     "num_drafts\\[0\\] = -1 is negative"),
    (lambda: _C.verification_rows(np.array([2], np.int32), np.array([1], np.int32), np.zeros(4, np.int32)),
     "outside the step's 4 tokens"),
    (lambda: _C.verification_rows(np.array([0], np.int32), np.array([4], np.int32), np.zeros(4, np.int32)),
     "outside the step's 4 tokens"),
    (lambda: _C.verification_rows(np.array([0, 1], np.int32), np.array([3], np.int32), np.zeros(4, np.int32)),
     "one entry per sample"),
    (lambda: _C.accept_greedy(np.zeros(3, np.int64), np.zeros(3, np.int64), np.array([1], np.int32)),
     "one entry per verification row \\(2\\)"),
    (lambda: _C.verification_rows(np.array([0]), np.array([2**32 + 1]), np.zeros(4, np.int32)),
     "sample_indices\\[0\\] = 4294967297 does not fit int32"),
    (lambda: _C.accept_greedy(np.array([1.7, 2.2]), np.array([1, -1]), np.array([1], np.int32)),
     "tokens must hold integers"),
    (lambda: _C.accept_greedy(np.zeros(2, np.int64), np.zeros(2, np.int64), [1]), "numpy integer array"),
])
def test_verification_helpers_reject_bad_input(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
