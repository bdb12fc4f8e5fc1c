"""The sampler: greedy, temperature, top-k / top-p / min-p masking and per-row seeds.

Statistical checks draw from fixed seeds, so they are deterministic: they cannot flake, and the
tolerances are loose enough that a correct sampler passes for any seed.
"""

from __future__ import annotations

import torch

from nanovllm.layers.sampler import Sampler, make_sampling_batch

sampler = Sampler()

# probabilities 0.5, 0.3, 0.1, 0.05, 0.05
PROBS = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
LOGITS = PROBS.log()


def draw(logits_row: torch.Tensor, n: int, seed: int = 0, **params: float) -> torch.Tensor:
    """n samples from one distribution, as n identical rows of one batch."""
    torch.manual_seed(seed)
    logits = logits_row.expand(n, -1).clone()
    batch = make_sampling_batch(
        [params.get("temperature", 1.0)] * n,
        top_k=[int(params.get("top_k", 0))] * n,
        top_p=[params.get("top_p", 1.0)] * n,
        min_p=[params.get("min_p", 0.0)] * n,
    )
    return sampler(logits, batch)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    out = sampler(logits, make_sampling_batch([0.0] * 6))
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(-1))
    # Greedy rows stay greedy inside a mixed batch.
    mixed = sampler(logits, make_sampling_batch([0.0, 1.0, 0.0, 0.7, 0.0, 1.5]))
    assert torch.equal(mixed[[0, 2, 4]], logits.argmax(-1)[[0, 2, 4]])


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    for seed in range(5):
        torch.manual_seed(seed)
        out = sampler(logits, make_sampling_batch([1.3] * 64, top_k=[1] * 64))
        assert torch.equal(out, logits.argmax(-1))


def test_top_k_only_samples_the_k_best() -> None:
    got = set(draw(LOGITS, 4000, top_k=3).tolist())
    assert got == {0, 1, 2}


def test_top_p_never_picks_outside_nucleus() -> None:
    # Mass before token 1 is 0.5 < 0.7 (kept); before token 2 it is 0.8 >= 0.7 (dropped).
    got = set(draw(LOGITS, 4000, top_p=0.7).tolist())
    assert got == {0, 1}
    # A tiny top_p keeps only the most likely token.
    assert set(draw(LOGITS, 500, top_p=1e-6).tolist()) == {0}


def test_min_p_never_picks_below_threshold() -> None:
    # Threshold 0.25 * 0.5 = 0.125: tokens with 0.1 and 0.05 are dropped.
    assert set(draw(LOGITS, 4000, min_p=0.25).tolist()) == {0, 1}
    assert set(draw(LOGITS, 4000, min_p=0.15).tolist()) == {0, 1, 2}


def test_filters_compose() -> None:
    # top-k 4 keeps 0..3; top-p 0.85 then keeps 0, 1, 2 (renormalized mass before 3 is ~0.947).
    assert set(draw(LOGITS, 4000, top_k=4, top_p=0.85).tolist()) == {0, 1, 2}


def test_no_filters_reach_every_token() -> None:
    assert set(draw(torch.zeros(8), 2000).tolist()) == set(range(8))


def chi_square(samples: torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_distribution() -> None:
    n = 20000
    for temperature in (0.5, 1.0, 2.0):
        expected = torch.softmax(LOGITS / temperature, dim=-1)
        stat = chi_square(draw(LOGITS, n, seed=11, temperature=temperature), expected)
        # 4 degrees of freedom: P(chi2 > 30) < 1e-5 for a correct sampler.
        assert stat < 30.0, (temperature, stat)
    # And a wrong temperature is clearly rejected by the same statistic.
    wrong = chi_square(draw(LOGITS, n, seed=11, temperature=2.0), torch.softmax(LOGITS, dim=-1))
    assert wrong > 300.0


def test_top_p_distribution_is_renormalized() -> None:
    samples = draw(LOGITS, 20000, seed=5, top_p=0.7)
    expected = torch.tensor([0.5, 0.3, 0.0, 0.0, 0.0]) / 0.8
    counts = torch.bincount(samples, minlength=5).double() / samples.numel()
    assert torch.allclose(counts, expected.double(), atol=0.02)


def seeded_run(
    rows: list[tuple[float, int | None]], steps: int, logits: torch.Tensor
) -> list[list[int]]:
    """Sample `steps` times for rows given as (temperature, seed or None); tokens per row."""
    gens = [torch.Generator().manual_seed(s) if s is not None else None for _, s in rows]
    out: list[list[int]] = [[] for _ in rows]
    for _ in range(steps):
        batch = make_sampling_batch([t for t, _ in rows], generators=gens)
        tokens = sampler(logits[: len(rows)], batch).tolist()
        for i, tok in enumerate(tokens):
            out[i].append(tok)
    return out


def test_seeded_rows_reproducible_regardless_of_batch() -> None:
    vocab = 512
    row = torch.zeros(vocab)  # uniform: every draw depends on the noise only
    logits = row.expand(8, -1).clone()
    torch.manual_seed(0)
    alone = seeded_run([(1.0, 42)], 10, logits)[0]
    torch.manual_seed(123)  # different global RNG state and batch neighbours
    crowd = seeded_run([(1.0, None), (0.0, None), (0.8, 7), (1.0, 42), (1.0, None)], 10, logits)
    assert crowd[3] == alone
    other_seed = crowd[2]
    assert other_seed != alone
    # Unseeded rows use the global generator and vary with it.
    torch.manual_seed(999)
    assert seeded_run([(1.0, None)], 10, logits)[0] != crowd[0]


def test_sampling_batch_flags() -> None:
    b = make_sampling_batch([0.0, 0.0], top_k=[5, 0], top_p=[0.5, 1.0], min_p=[0.1, 0.0])
    assert b.all_greedy and not (b.any_top_k or b.any_top_p or b.any_min_p)
    b = make_sampling_batch([0.0, 1.0], top_k=[5, 0], top_p=[1.0, 0.9], min_p=[0.0, 0.0])
    assert not b.all_greedy and not b.any_top_k and b.any_top_p and not b.any_min_p
