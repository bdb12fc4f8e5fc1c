"""The sampler: greedy, temperature, top-k / top-p / min-p masking and per-row seeds, for both
implementations (the C++ CPU kernels and the torch path CUDA takes).

Statistical checks draw from fixed seeds, so they are deterministic: they cannot flake, and the
tolerances are loose enough that a correct sampler passes for any seed.
"""

from __future__ import annotations

import pytest
import torch

from nanovllm.sample import Sampler, make_sampling_batch

BACKENDS = ["cpu", "torch"]


@pytest.fixture(params=BACKENDS)
def sampler(request: pytest.FixtureRequest) -> Sampler:
    return Sampler(request.param)

# probabilities 0.5, 0.3, 0.1, 0.05, 0.05
PROBS = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
LOGITS = PROBS.log()


def draw(sampler: Sampler, logits_row: torch.Tensor, n: int, seed: int = 0, **params: float) -> torch.Tensor:
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


def test_greedy_is_argmax(sampler: Sampler) -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    out = sampler(logits, make_sampling_batch([0.0] * 6))
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(-1))
    # Greedy rows stay greedy inside a mixed batch.
    mixed = sampler(logits, make_sampling_batch([0.0, 1.0, 0.0, 0.7, 0.0, 1.5]))
    assert torch.equal(mixed[[0, 2, 4]], logits.argmax(-1)[[0, 2, 4]])


def test_top_k_one_equals_greedy(sampler: Sampler) -> None:
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    for seed in range(5):
        torch.manual_seed(seed)
        out = sampler(logits, make_sampling_batch([1.3] * 64, top_k=[1] * 64))
        assert torch.equal(out, logits.argmax(-1))


def test_top_k_only_samples_the_k_best(sampler: Sampler) -> None:
    got = set(draw(sampler, LOGITS, 4000, top_k=3).tolist())
    assert got == {0, 1, 2}


def test_top_p_never_picks_outside_nucleus(sampler: Sampler) -> None:
    # Mass before token 1 is 0.5 < 0.7 (kept); before token 2 it is 0.8 >= 0.7 (dropped).
    got = set(draw(sampler, LOGITS, 4000, top_p=0.7).tolist())
    assert got == {0, 1}
    # A tiny top_p keeps only the most likely token.
    assert set(draw(sampler, LOGITS, 500, top_p=1e-6).tolist()) == {0}


def test_min_p_never_picks_below_threshold(sampler: Sampler) -> None:
    # Threshold 0.25 * 0.5 = 0.125: tokens with 0.1 and 0.05 are dropped.
    assert set(draw(sampler, LOGITS, 4000, min_p=0.25).tolist()) == {0, 1}
    assert set(draw(sampler, LOGITS, 4000, min_p=0.15).tolist()) == {0, 1, 2}


def test_filters_compose(sampler: Sampler) -> None:
    # top-k 4 keeps 0..3; top-p 0.85 then keeps 0, 1, 2 (renormalized mass before 3 is ~0.947).
    assert set(draw(sampler, LOGITS, 4000, top_k=4, top_p=0.85).tolist()) == {0, 1, 2}


def test_no_filters_reach_every_token(sampler: Sampler) -> None:
    assert set(draw(sampler, torch.zeros(8), 2000).tolist()) == set(range(8))


def chi_square(samples: torch.Tensor, expected_probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_distribution(sampler: Sampler) -> None:
    n = 20000
    for temperature in (0.5, 1.0, 2.0):
        expected = torch.softmax(LOGITS / temperature, dim=-1)
        stat = chi_square(draw(sampler, LOGITS, n, seed=11, temperature=temperature), expected)
        # 4 degrees of freedom: P(chi2 > 30) < 1e-5 for a correct sampler.
        assert stat < 30.0, (temperature, stat)
    # And a wrong temperature is clearly rejected by the same statistic.
    wrong = chi_square(draw(sampler, LOGITS, n, seed=11, temperature=2.0), torch.softmax(LOGITS, dim=-1))
    assert wrong > 300.0


def test_top_p_distribution_is_renormalized(sampler: Sampler) -> None:
    samples = draw(sampler, LOGITS, 20000, seed=5, top_p=0.7)
    expected = torch.tensor([0.5, 0.3, 0.0, 0.0, 0.0]) / 0.8
    counts = torch.bincount(samples, minlength=5).double() / samples.numel()
    assert torch.allclose(counts, expected.double(), atol=0.02)


def seeded_run(
    sampler: Sampler, rows: list[tuple[float, int | None]], steps: int, logits: torch.Tensor
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


def test_seeded_rows_reproducible_regardless_of_batch(sampler: Sampler) -> None:
    vocab = 512
    row = torch.zeros(vocab)  # uniform: every draw depends on the noise only
    logits = row.expand(8, -1).clone()
    torch.manual_seed(0)
    alone = seeded_run(sampler, [(1.0, 42)], 10, logits)[0]
    torch.manual_seed(123)  # different global RNG state and batch neighbours
    crowd = seeded_run(sampler, [(1.0, None), (0.0, None), (0.8, 7), (1.0, 42), (1.0, None)], 10, logits)
    assert crowd[3] == alone
    other_seed = crowd[2]
    assert other_seed != alone
    # Unseeded rows use the global generator and vary with it.
    torch.manual_seed(999)
    assert seeded_run(sampler, [(1.0, None)], 10, logits)[0] != crowd[0]


def test_full_sort_only_for_top_p_rows_without_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the torch path top-k rows take their candidates from topk; only top-p rows without a k
    pay for a sort, and greedy, plain and min-p rows never do."""
    sampler = Sampler("torch")
    sorted_rows: list[int] = []
    real_sort = torch.Tensor.sort

    def counting_sort(self: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        sorted_rows.append(self.shape[0])
        return real_sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", counting_sort)
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3))
    sampler(logits, make_sampling_batch([0.0, 1.0, 1.0, 0.7, 1.0, 1.0], top_k=[0, 20, 5, 0, 0, 0],
                                        top_p=[1.0, 0.9, 1.0, 1.0, 1.0, 0.5], min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.0]))
    assert sorted_rows == [1]  # row 5 alone
    sorted_rows.clear()
    sampler(logits, make_sampling_batch([1.0] * 6, top_k=[50] * 6, top_p=[0.8] * 6, min_p=[0.05] * 6))
    assert sorted_rows == []


def reference_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                           min_p: float) -> torch.Tensor:
    """The straightforward definition, in float64, in vLLM's order: temperature, drop what is below
    min_p x the best, keep the k best of what is left, keep the smallest most-likely prefix
    reaching top_p of what those weigh."""
    x = logits.double() / temperature
    order = x.argsort(descending=True)
    p = torch.softmax(x, dim=-1)
    if min_p > 0.0:
        p = torch.where(p >= p.max() * min_p, p, 0.0)
        p = p / p.sum()
    keep = p > 0
    k = top_k if top_k > 0 else len(x)
    best_k = torch.zeros_like(keep)
    best_k[order[:k]] = True
    keep &= best_k
    p = torch.where(keep, p, 0.0)
    p = p / p.sum()
    if top_p < 1.0:
        mass = 0.0
        nucleus = torch.zeros_like(keep)
        for t in order.tolist():
            if not keep[t] or mass >= top_p:
                break
            nucleus[t] = True
            mass += float(p[t])
        p = torch.where(nucleus, p, 0.0)
        p = p / p.sum()
    return p


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test over the tokens the reference allows; any draw outside them fails."""
    allowed = expected_probs > 0
    assert counts[~allowed].sum() == 0, f"drew tokens the filters exclude: {torch.nonzero(counts * ~allowed)}"
    n = counts.sum()
    expected = expected_probs[allowed] * n
    stat = float(((counts[allowed] - expected) ** 2 / expected).sum())
    dof = int(allowed.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


FILTERS = [  # (top_k, top_p, min_p): every combination, each filter active
    (k, p, m) for k in (0, 6) for p in (1.0, 0.8) for m in (0.0, 0.08)
]


@pytest.mark.parametrize("top_k,top_p,min_p", FILTERS)
def test_sampled_distribution_matches_reference(sampler: Sampler, top_k: int, top_p: float, min_p: float) -> None:
    """Chi-square of 40,000 draws against the reference distribution, for every filter
    combination, with the rows of one batch mixing the three sampler paths (top-k candidates,
    sorted top-p, plain) so grouping mistakes show up too."""
    vocab = 24
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(11)) * 1.5
    expected = reference_distribution(logits, 0.9, top_k, top_p, min_p)
    rows = 4000
    # The rows under test, interleaved with rows of other kinds (greedy, other filters).
    params = [(0.9, top_k, top_p, min_p) if i % 2 == 0 else
              [(0.0, 0, 1.0, 0.0), (1.3, 12, 1.0, 0.0), (0.7, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.2)][i % 8 // 2]
              for i in range(2 * rows)]
    batch = make_sampling_batch([p[0] for p in params], top_k=[p[1] for p in params],
                                top_p=[p[2] for p in params], min_p=[p[3] for p in params])
    counts = torch.zeros(vocab, dtype=torch.float64)
    torch.manual_seed(top_k * 100 + int(top_p * 10) + int(min_p * 100))
    for _ in range(10):
        tokens = sampler(logits.expand(2 * rows, -1).clone(), batch)
        counts += torch.bincount(tokens[0::2], minlength=vocab).double()
    assert chi_square_p_value(counts, expected) > 1e-4
    # The interleaved greedy rows stayed greedy.
    assert (tokens[1::8] == logits.argmax()).all()
