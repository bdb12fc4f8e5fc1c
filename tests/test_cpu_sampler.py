"""The sampler's C++ CPU kernels (csrc/cpu_sampler.cpp) against torch: greedy rows, the nucleus on
large vocabularies, logprobs, penalties, batch independence and bad input. The sampled
distributions themselves are checked against a float64 reference in test_models_sampler.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm.cpu import sampler as cpu_sampler
from nanovllm.sample.state import apply_penalties


def params(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0) -> tuple[np.ndarray, ...]:
    return (np.full(rows, temperature, np.float32), np.full(rows, top_k, np.int64), np.full(rows, top_p, np.float32),
            np.full(rows, min_p, np.float32))


def test_greedy_rows_are_torch_argmax() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 1000, generator=g)
    logits[3, [10, 500]] = 100.0  # ties: the first maximum
    logits[4] = float("-inf")  # a fully masked row
    logits[5, ::2] = float("-inf")
    out = cpu_sampler.sample(logits, *params(40, temperature=0.0), np.zeros(40))
    assert np.array_equal(out, logits.argmax(-1).numpy())
    # A strided view of wider rows reads only its own entries.
    wide = torch.randn(8, 700, generator=g)
    out = cpu_sampler.sample(wide[:, :600], *params(8, temperature=0.0), np.zeros(8))
    assert np.array_equal(out, wide[:, :600].argmax(-1).numpy())


def test_masked_tokens_are_never_drawn() -> None:
    logits = torch.zeros(500, 64)
    logits[:, 1::2] = float("-inf")
    u = np.random.default_rng(0).random(500)
    for k, p, m in ((0, 1.0, 0.0), (50, 1.0, 0.0), (0, 0.99, 0.0), (0, 1.0, 0.5), (40, 0.9, 0.1)):
        out = cpu_sampler.sample(logits, *params(500, 1.0, k, p, m), u)
        assert (out % 2 == 0).all(), (k, p, m)
    # u at the top of [0, 1) still lands on a kept token.
    out = cpu_sampler.sample(logits[:1], *params(1), np.array([np.nextafter(1.0, 0.0)]))
    assert out[0] % 2 == 0


def test_top_p_nucleus_beyond_the_first_candidates() -> None:
    """A flat row puts top_p's mass in thousands of tokens: the candidate set must widen to hold
    the nucleus (ties rank by id, so the nucleus of 0.5 over 5000 equal tokens is ids < 2500)."""
    logits = torch.zeros(400, 5000)
    u = np.random.default_rng(1).random(400)
    out = cpu_sampler.sample(logits, *params(400, top_p=0.5), u)
    assert out.max() < 2500 and out.max() > 2000 and out.min() < 500
    # A peaked row closes its nucleus among the first candidates.
    peaked = torch.randn(400, 151_936, generator=torch.Generator().manual_seed(2)) * 0.5
    peaked[:, 7] = 20.0
    out = cpu_sampler.sample(peaked, *params(400, top_p=0.9), u)
    assert (out == 7).all()


def test_a_row_depends_only_on_its_logits_and_draw() -> None:
    """Batch invariance: the same row and uniform give the same token alone, among other rows, and
    with more threads."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 3000, generator=g) * 2
    u = np.random.default_rng(4).random(64)
    modes = [(0.8, 0, 1.0, 0.0), (1.0, 20, 0.9, 0.0), (0.7, 0, 0.8, 0.05), (1.2, 0, 1.0, 0.1)]
    cols = [np.array([modes[i % 4][j] for i in range(64)], dtype=d)
            for j, d in enumerate((np.float32, np.int64, np.float32, np.float32))]
    together = cpu_sampler.sample(logits, *cols, u)
    alone = [cpu_sampler.sample(logits[i:i + 1], *(c[i:i + 1] for c in cols), u[i:i + 1])[0] for i in range(64)]
    assert together.tolist() == alone
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cpu_sampler.sample(logits, *cols, u).tolist() == alone
    finally:
        torch.set_num_threads(threads)


def test_logprobs_match_log_softmax() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(30, 4096, generator=g) * 3
    logits[2, :100] = float("-inf")
    chosen = torch.randint(100, 4096, (30,), generator=g)
    lp, rank, top_ids, top_lp = cpu_sampler.logprobs(logits, chosen.numpy(), 5)
    ref = torch.log_softmax(logits.double(), dim=-1)
    ref_chosen = ref.gather(1, chosen[:, None]).squeeze(1)
    assert np.allclose(lp, ref_chosen.numpy(), atol=1e-5)
    assert np.array_equal(rank, ((ref > ref_chosen[:, None]).sum(1) + 1).numpy())
    ref_top_lp, ref_top_ids = ref.topk(5, dim=1)
    assert np.array_equal(top_ids, ref_top_ids.numpy())
    assert np.allclose(top_lp, ref_top_lp.numpy(), atol=1e-5)
    # k = 0: only the chosen token's.
    lp0, rank0, ids0, _ = cpu_sampler.logprobs(logits, chosen.numpy(), 0)
    assert ids0.shape == (30, 0) and np.array_equal(lp0, lp) and np.array_equal(rank0, rank)


def test_penalties_match_the_torch_definition() -> None:
    g = torch.Generator().manual_seed(6)
    vocab = 300
    logits = torch.randn(10, vocab, generator=g) * 4
    seen = torch.zeros(6, 2, vocab)
    seen[:, 0] = (torch.rand(6, vocab, generator=g) < 0.1).float()
    seen[:, 1] = torch.randint(0, 3, (6, vocab), generator=g).float() * (torch.rand(6, vocab, generator=g) < 0.2)
    rows, slots = np.array([0, 3, 4, 9]), np.array([5, 0, 2, 2])
    rep = np.array([1.3, 1.0, 0.7, 1.1], np.float32)
    freq = np.array([0.5, 0.0, -0.4, 0.2], np.float32)
    pres = np.array([0.0, 1.5, 0.3, -0.2], np.float32)
    expected = logits.clone()
    apply_penalties(expected, torch.from_numpy(rows), seen[torch.from_numpy(slots)], rep, freq, pres)
    got = logits.clone()
    cpu_sampler.apply_penalties(got, rows, seen, slots, rep, freq, pres)
    assert torch.allclose(got, expected, atol=1e-6)
    untouched = [i for i in range(10) if i not in rows]
    assert torch.equal(got[untouched], logits[untouched])


def test_bad_input_is_refused() -> None:
    logits = torch.zeros(4, 10)
    p = params(4)
    with pytest.raises(ValueError, match="fp32 CPU rows"):
        cpu_sampler.sample(logits.double(), *p, np.zeros(4))
    with pytest.raises(ValueError, match="fp32 CPU rows"):
        cpu_sampler.sample(logits.t(), *params(10), np.zeros(10))
    with pytest.raises(ValueError, match="one entry per row"):
        cpu_sampler.sample(logits, *p, np.zeros(3))
    with pytest.raises(ValueError, match="chosen token ids"):
        cpu_sampler.logprobs(logits, np.array([0, 1, 2, 10]), 2)
    with pytest.raises(ValueError, match="k must be"):
        cpu_sampler.logprobs(logits, np.zeros(4, np.int64), 11)
    with pytest.raises(ValueError, match="out of range"):
        cpu_sampler.apply_penalties(logits, np.array([0]), torch.zeros(2, 2, 10), np.array([2]), np.ones(1),
                                    np.zeros(1), np.zeros(1))
    with pytest.raises(ValueError, match="seen must be"):
        cpu_sampler.apply_penalties(logits, np.array([0]), torch.zeros(2, 2, 9), np.array([0]), np.ones(1),
                                    np.zeros(1), np.zeros(1))


def test_feature_users_follow_add_fork_remove() -> None:
    """The counts that let a greedy step skip every column gather rise and fall with the rows
    (a fork counts as a new sequence), and return to zero."""
    from nanovllm.sample import SamplingState
    from nanovllm.sampling_params import SamplingParams

    state = SamplingState(torch.device("cpu"), 64, [0])
    state.add(0, SamplingParams(temperature=0.0), [1, 2])
    assert (state.users.sampled, state.users.logprobs, state.users.processed) == (0, 0, 0)
    assert state.batch(np.array([0])) is None
    state.add(1, SamplingParams(temperature=0.7, logprobs=2, presence_penalty=0.5), [3])
    state.fork(1, 2, index=1)
    assert (state.users.sampled, state.users.logprobs, state.users.processed) == (2, 2, 2)
    assert state.batch(np.array([0, 2])) is not None
    state.add(3, SamplingParams(temperature=0.0, min_tokens=2), [4])
    assert state.users.processed == 3
    for sid in (1, 2, 3, 0):
        state.remove(sid)
    assert (state.users.sampled, state.users.logprobs, state.users.processed) == (0, 0, 0)
    state.remove(0)  # removing twice (an aborted, then released sequence) does not go negative
    assert state.users.sampled == 0 and state.users.processed == 0
