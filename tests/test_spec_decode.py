"""Speculative decoding end to end: greedy output equal to transformers' (and to the engine without
speculation) for every k, n-gram and draft model, on the three architectures; sampled output with
every sampling feature unchanged for a seeded request, and the same distribution for unseeded ones;
stops inside a row of drafts; streaming, structured output, n > 1, beam search, preemption, prefix
caching and chunked prefill; the configuration's errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import hf_greedy
from tiny_models import make_tiny_model

from nanovllm import LLM, SamplingParams
from nanovllm.builtin_model import create_model_dir
from nanovllm.config import EngineConfig, SpeculativeConfig

VOCAB = 512
MAX_NEW = 32


def ngram(k: int, **extra: object) -> dict[str, object]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **extra}


def make_llm(path: Path, spec: dict[str, object] | None = None, **kwargs: object) -> LLM:
    kwargs.setdefault("num_kvcache_blocks", 256)
    kwargs.setdefault("block_size", 16)
    kwargs.setdefault("max_model_len", 512)
    return LLM(str(path), device="cpu", speculative_config=spec, **kwargs)


def repetitive_prompts(seed: int = 0, count: int = 4) -> list[list[int]]:
    """Prompts that repeat a pattern (what n-gram drafts feed on), of several lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        pattern = [rng.randrange(VOCAB) for _ in range(3 + i)]
        out.append(pattern * (2 + i) + [rng.randrange(VOCAB) for _ in range(i)])
    return out


def token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_no_leak(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def arch_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec"), request.param)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("spec"), "qwen3")


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer draft with the same tokenizer and vocabulary as make_tiny_model's qwen3, other weights."""
    return create_model_dir(tmp_path_factory.mktemp("spec") / "draft", "Qwen3ForCausalLM", num_hidden_layers=1, seed=7)


# Greedy: identical for every k -------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_ngram_greedy_equals_transformers(arch_dir: Path, k: int) -> None:
    llm = make_llm(arch_dir, ngram(k, adaptive=False))
    eos = llm.get_tokenizer().eos_token_id
    prompts = repetitive_prompts(k)
    outs = token_ids(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    for prompt, out in zip(prompts, outs):
        assert out[0] == hf_greedy(arch_dir, prompt, MAX_NEW, eos)
    stats = llm.stats()
    assert stats["spec_num_draft_tokens"] > 0, "nothing was drafted: the test proves nothing"
    assert len(stats["spec_num_accepted_tokens_per_pos"]) == k
    assert sum(stats["spec_num_accepted_tokens_per_pos"]) == stats["spec_num_accepted_tokens"]
    assert_no_leak(llm)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_model_greedy_equals_transformers(arch_dir: Path, k: int) -> None:
    # The model as its own draft: every greedy draft is accepted, so the rows are as long as they get.
    llm = make_llm(arch_dir, {"method": "draft_model", "model": str(arch_dir), "num_speculative_tokens": k})
    prompts = repetitive_prompts(k + 10)
    outs = token_ids(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out[0] == hf_greedy(arch_dir, prompt, MAX_NEW, None)
    stats = llm.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"], "a model's own greedy drafts all pass"
    assert_no_leak(llm)


def test_other_draft_model_greedy_unchanged(qwen3_dir: Path, other_draft_dir: Path) -> None:
    spec = {"method": "draft_model", "model": str(other_draft_dir), "num_speculative_tokens": 4}
    llm = make_llm(qwen3_dir, spec)
    prompts = repetitive_prompts(3)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    assert token_ids(llm, prompts, params) == token_ids(make_llm(qwen3_dir), prompts, params)
    assert llm.stats()["spec_num_draft_tokens"] > 0  # random weights: few or none accepted
    assert_no_leak(llm)


# Sampling: the same draws, the same distribution -------------------------------------------------

SAMPLED = [
    SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_NEW, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, max_tokens=MAX_NEW, logprobs=2,
                   presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1),
    SamplingParams(temperature=0.6, min_p=0.1, seed=9, max_tokens=MAX_NEW, min_tokens=12, logit_bias={5: 3.0}),
    SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=1, min_tokens=10, logit_bias={5: 2.0},
                   repetition_penalty=1.3),
    SamplingParams(temperature=0.9, seed=11, n=3, max_tokens=MAX_NEW),
]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_sampling_and_processors_unchanged(qwen3_dir: Path, method: str) -> None:
    """Point-mass drafts (n-gram; a greedy request's draft-model drafts): every emitted token is
    drawn as without drafts, with the same draw, so a seeded request's tokens, logprobs and finish
    are the same. (A sampled request's draft-model drafts are drawn from the draft's distribution:
    test_draft_model_sampled_drafts.)"""
    spec = ngram(4, adaptive=False) if method == "ngram" else \
        {"method": "draft_model", "model": str(qwen3_dir), "num_speculative_tokens": 3}
    llm, base = make_llm(qwen3_dir, spec), make_llm(qwen3_dir)
    prompts = repetitive_prompts(1)
    for params in SAMPLED if method == "ngram" else [p for p in SAMPLED if p.temperature == 0]:
        for a, b in zip(base.generate(prompts, params, use_tqdm=False), llm.generate(prompts, params, use_tqdm=False)):
            for x, y in zip(a.outputs, b.outputs):
                assert (y.token_ids, y.text, y.finish_reason) == (x.token_ids, x.text, x.finish_reason)
                if x.logprobs is not None:
                    assert len(y.logprobs) == len(x.logprobs) == len(x.token_ids)
                    for p, q in zip(x.logprobs, y.logprobs):
                        assert set(p) == set(q)
                        assert all(abs(p[t].logprob - q[t].logprob) < 1e-4 for t in p)
                    assert y.cumulative_logprob == pytest.approx(x.cumulative_logprob, abs=1e-3)
    assert llm.stats()["spec_num_accepted_tokens"] > 0
    assert_no_leak(llm)


def test_draft_model_sampled_drafts(qwen3_dir: Path) -> None:
    """A sampled request's drafts come from the draft's distribution under its temperature, top-k,
    top-p and min-p: a model drafting for itself has nearly all accepted (q = p up to rounding);
    logprobs cover every token; nothing leaks. A seeded sampled request does not draft (a draft
    takes draws from its generator, and how many a step takes depends on the batch): its tokens are
    those of the engine without speculation, alone or beside others."""
    spec = {"method": "draft_model", "model": str(qwen3_dir), "num_speculative_tokens": 3}
    llm, base = make_llm(qwen3_dir, spec, max_num_seqs=16), make_llm(qwen3_dir)
    prompts = repetitive_prompts(11)
    for params in (SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1),
                   SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.02, max_tokens=MAX_NEW)):
        for o in llm.generate(prompts, params, use_tqdm=False):
            if params.logprobs is not None:
                assert len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids)
    stats = llm.stats()
    assert stats["spec_num_accepted_tokens"] >= 0.95 * stats["spec_num_draft_tokens"] > 0
    seeded = SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_NEW, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in base.generate(prompts, seeded, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)] == expected
    crowd = repetitive_prompts(12, count=8)  # 8 greedy rows beside it: speculation off for the batch
    beside = llm.generate(prompts[:1] + crowd, [seeded] + [greedy] * len(crowd), use_tqdm=False)
    assert beside[0].outputs[0].token_ids == expected[0]
    assert_no_leak(llm)


def chi_square_agrees(table: np.ndarray, alpha_z: float = 3.09) -> bool:
    """Pearson's chi-square test of homogeneity on a 2 x C table of counts, at the level whose
    one-sided normal quantile is alpha_z (3.09: 0.001): the statistic against the Wilson-Hilferty
    approximation of the chi-square quantile."""
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    critical = df * (1 - 2 / (9 * df) + alpha_z * (2 / (9 * df)) ** 0.5) ** 3
    return stat <= critical


def test_chi_square_check_rejects_a_different_distribution() -> None:
    rng = np.random.default_rng(0)
    a = rng.choice(4, 600, p=[0.4, 0.3, 0.2, 0.1])
    b = rng.choice(4, 600, p=[0.4, 0.3, 0.2, 0.1])
    c = rng.choice(4, 600, p=[0.25, 0.25, 0.25, 0.25])
    count = lambda x: np.bincount(x, minlength=4)  # noqa: E731
    assert chi_square_agrees(np.array([count(a), count(b)]))
    assert not chi_square_agrees(np.array([count(a), count(c)]))


@pytest.mark.parametrize("draft", ["itself", "another model"])
def test_unseeded_distribution_matches(qwen3_dir: Path, other_draft_dir: Path, draft: str) -> None:
    """Chi-square: the tokens at output positions 1..3 (verified after accepted drafts) of unseeded
    requests have the distribution of the engine without speculation, for top-k / top-p / min-p,
    with drafts the rejection rule mostly keeps (the model drafting for itself) and mostly replaces
    from the residual (another model)."""
    model = qwen3_dir if draft == "itself" else other_draft_dir
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    prompt = repetitive_prompts(2)[1]
    for params in (SamplingParams(temperature=0.6, top_k=4, max_tokens=4, ignore_eos=True),
                   SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, max_tokens=4, ignore_eos=True)):
        samples = {}
        for name, llm in (("spec", make_llm(qwen3_dir, spec, seed=1)), ("base", make_llm(qwen3_dir, seed=2))):
            samples[name] = np.array(token_ids(llm, [prompt] * 600, params))[:, 0, 1:]
        for pos in range(3):
            a, b = samples["spec"][:, pos], samples["base"][:, pos]
            cats = np.union1d(a, b)
            table = np.array([[np.sum(a == c) for c in cats], [np.sum(b == c) for c in cats]])
            table = table[:, table.sum(axis=0) >= 10]  # chi-square needs expected counts
            if table.shape[1] < 2:
                continue
            assert chi_square_agrees(table), f"position {pos + 1}: {table}"


# Stops inside a row of drafts ----------------------------------------------------------------------


def test_stops_inside_a_row(qwen3_dir: Path) -> None:
    """A stop token id, a stop string spanning tokens, and max_tokens met inside a row of accepted
    drafts end the sequence there, with the tokens, text, reasons and logprobs of the engine
    without speculation."""
    base = make_llm(qwen3_dir)
    llm = make_llm(qwen3_dir, {"method": "draft_model", "model": str(qwen3_dir), "num_speculative_tokens": 6})
    prompts = repetitive_prompts(4)
    free = token_ids(base, prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    tok = base.get_tokenizer()
    for prompt, out in zip(prompts, free):
        text = tok.decode(out[0])
        cases = [SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[out[0][9]], logprobs=1),
                 SamplingParams(temperature=0, max_tokens=7, logprobs=0),
                 SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[text[len(text) // 2:len(text) // 2 + 3]],
                                logprobs=1),
                 SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[text[len(text) // 3:len(text) // 3 + 2]],
                                include_stop_str_in_output=True)]
        for params in cases:
            a, b = base.generate([prompt], params, use_tqdm=False)[0].outputs[0], \
                llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
                (a.token_ids, a.text, a.finish_reason, a.stop_reason)
            if a.logprobs is not None:
                assert len(b.logprobs) == len(a.logprobs)
                assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)
    assert llm.stats()["spec_num_accepted_tokens"] > 0
    assert_no_leak(llm)


def test_streaming_deltas_add_up(qwen3_dir: Path) -> None:
    llm = make_llm(qwen3_dir, {"method": "draft_model", "model": str(qwen3_dir), "num_speculative_tokens": 4})
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    prompt = repetitive_prompts(5)[2]
    engine.add_request("r", prompt, params, stream=True)
    text, ids, sizes = "", [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                text += c.text
                ids += c.token_ids
                sizes.append(len(c.token_ids))
    whole = make_llm(qwen3_dir).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (ids, text) == (whole.token_ids, whole.text)
    assert max(sizes) > 1, "no step streamed several tokens"


# The engine's other features with drafts -----------------------------------------------------------


def test_structured_output_with_drafts(qwen3_dir: Path) -> None:
    from nanovllm.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
              "required": ["a", "b"]}
    cases = [StructuredOutputsParams(json=schema), StructuredOutputsParams(regex="(ab|cd){3,6}x"),
             StructuredOutputsParams(choice=["yes yes yes", "no no no"])]
    base = make_llm(qwen3_dir)
    llm = make_llm(qwen3_dir, ngram(4, adaptive=False))
    for so in cases:
        for temperature, seed in ((0.0, None), (0.8, 3)):
            params = SamplingParams(temperature=temperature, seed=seed, max_tokens=64, structured_outputs=so,
                                    logprobs=2)
            a = base.generate(["{} {} {}"], params, use_tqdm=False)[0].outputs[0]
            b = llm.generate(["{} {} {}"], params, use_tqdm=False)[0].outputs[0]
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
            # Logprobs of the grammar's masked distribution, with or without drafts.
            assert a.logprobs is not None and b.logprobs is not None
            for t, ea, eb in zip(a.token_ids, a.logprobs, b.logprobs, strict=True):
                assert eb[t].logprob == pytest.approx(ea[t].logprob, abs=1e-4) and eb[t].rank == ea[t].rank
            if so.json is not None and a.finish_reason == "stop":
                json.loads(b.text)
    assert llm.stats()["spec_num_draft_tokens"] > 0
    assert_no_leak(llm)


def test_preemption_prefix_caching_chunked_prefill(qwen3_dir: Path) -> None:
    """A pool too small for the batch (preemption and recompute), shared prefixes (cache hits) and a
    small token budget (chunked prefill, drafts competing for it): outputs unchanged."""
    prefix = repetitive_prompts(6)[3] * 3
    prompts = [prefix + p for p in repetitive_prompts(7, count=4)] + repetitive_prompts(8)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = token_ids(make_llm(qwen3_dir), prompts, params)
    for spec in (ngram(4, adaptive=False), {"method": "draft_model", "model": str(qwen3_dir),
                                            "num_speculative_tokens": 4}):
        llm = make_llm(qwen3_dir, spec, num_kvcache_blocks=14, max_model_len=224, max_num_batched_tokens=40,
                       max_num_seqs=8)
        assert token_ids(llm, prompts, params) == expected
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["spec_num_draft_tokens"] > 0
        assert_no_leak(llm)


def test_beam_search_runs_without_drafts(qwen3_dir: Path) -> None:
    from nanovllm.sampling_params import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=12)
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts(9, count=2)]
    a = make_llm(qwen3_dir).beam_search(prompts, params)
    llm = make_llm(qwen3_dir, ngram(4))
    b = llm.beam_search(prompts, params)
    assert [[s.tokens for s in o.sequences] for o in a] == [[s.tokens for s in o.sequences] for o in b]
    assert llm.stats()["spec_num_draft_tokens"] == 0
    assert_no_leak(llm)


def test_disable_by_batch_size(qwen3_dir: Path) -> None:
    prompts = repetitive_prompts(10)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    llm = make_llm(qwen3_dir, ngram(4, disable_by_batch_size=len(prompts)))
    assert token_ids(llm, prompts, params) == token_ids(make_llm(qwen3_dir), prompts, params)
    drafted = llm.stats()["spec_num_draft_tokens"]
    # All running at once: no drafts until one finishes (they all finish together here).
    assert drafted == 0
    llm = make_llm(qwen3_dir, ngram(4, disable_by_batch_size=len(prompts) + 1))
    token_ids(llm, prompts, params)
    assert llm.stats()["spec_num_draft_tokens"] > 0


# Configuration -----------------------------------------------------------------------------------


@pytest.mark.parametrize("config, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size"),
    ("{not json", "JSON"),
])
def test_bad_config_names_the_field(config: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(config)  # type: ignore[arg-type]


def test_vllm_defaults_and_json() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.parse({"model": "/x", "num_speculative_tokens": 2})
    assert c.method == "draft_model"


def test_draft_with_another_vocabulary_is_refused(qwen3_dir: Path, tmp_path: Path) -> None:
    other = create_model_dir(tmp_path / "v", "Qwen3ForCausalLM", vocab_size=640)
    options = EngineConfig(model=str(qwen3_dir), device="cpu",
                           speculative_config={"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config.model has a vocabulary of 640"):
        options.resolve()


def test_builtin_code_with_its_draft() -> None:
    """The shipped pair by name: `builtin-code` with `builtin-code-draft` (and n-gram drafts) gives
    the greedy output of `builtin-code` alone, with drafts accepted."""
    prompt = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\ndef "
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    expected = LLM("builtin-code", device="cpu").generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    for spec in ({"method": "draft_model", "model": "builtin-code-draft", "num_speculative_tokens": 3},
                 {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}):
        llm = LLM("builtin-code", device="cpu", speculative_config=spec)
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == expected
        stats = llm.stats()
        assert 0 < stats["spec_num_accepted_tokens"] <= stats["spec_num_draft_tokens"]
