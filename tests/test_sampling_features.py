"""Full sampling on a tiny fp32 model, checked against references computed from transformers'
logits: penalties, logit bias, min_tokens, logprobs, prompt logprobs, stop strings, streaming
deltas, parallel sampling with copy-on-write, and beam search."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from engine_helpers import hf_model, random_prompts
from tiny_models import make_tiny_model
from test_detokenizer import vllm_corrected, vllm_token_string

from nanovllm import LLM, BeamSearchParams, SamplingParams

VOCAB = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sampling"), "qwen3")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu", num_kvcache_blocks=512, max_model_len=1024)


def hf_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(str(model_dir))(torch.tensor([tokens])).logits[0].float()


def reference_greedy(model_dir: Path, prompt: list[int], steps: int, process) -> list[int]:  # noqa: ANN001
    """Greedy decoding with full recomputation; `process(logits, output_so_far)` adjusts logits."""
    out: list[int] = []
    for _ in range(steps):
        logits = hf_logits(model_dir, prompt + out)[-1]
        out.append(int(process(logits.clone(), out).argmax()))
    return out


def assert_pool_whole(llm: LLM) -> None:
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]


def test_repetition_presence_frequency_penalties(llm: LLM, model_dir: Path) -> None:
    prompt = random_prompts([12], VOCAB, seed=1)[0]
    rep, pres, freq = 1.7, 0.6, 0.4

    expected = reference_greedy(model_dir, prompt, 20, penalty_process(prompt, rep, pres, freq))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=rep,
                            presence_penalty=pres, frequency_penalty=freq)
    # Batched with a plain request, which must stay unpenalized.
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([prompt, prompt], [params, plain], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected
    assert outs[1].outputs[0].token_ids == reference_greedy(model_dir, prompt, 20, lambda lg, _: lg)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def penalty_process(prompt: list[int], rep: float, pres: float, freq: float):  # noqa: ANN201
    def process(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        for t in set(prompt) | set(out):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= pres + freq * out.count(t)
        return logits
    return process


def test_penalties_survive_preemption_and_forks(model_dir: Path) -> None:
    """Output counts live in the persistent sampling state, updated once per step: a sequence that
    is preempted and recomputed keeps them, and each of n samples counts only its own tokens
    (greedy, so every sample must equal the one-sequence reference)."""
    prompts = random_prompts([40, 50, 45, 55], VOCAB, seed=21)
    rep, pres, freq = 1.5, 0.5, 0.3
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2, repetition_penalty=rep,
                            presence_penalty=pres, frequency_penalty=freq)
    small = LLM(str(model_dir), device="cpu", num_kvcache_blocks=20, max_model_len=128, max_num_seqs=8)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    assert_pool_whole(small)
    for prompt, out in zip(prompts, outs):
        expected = reference_greedy(model_dir, prompt, 24, penalty_process(prompt, rep, pres, freq))
        assert [c.token_ids for c in out.outputs] == [expected, expected]


def test_logit_bias_and_min_tokens(llm: LLM) -> None:
    eos = llm.get_tokenizer().eos_token_id
    prompt = random_prompts([8], VOCAB, seed=2)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logit_bias={77: 100.0}),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [77] * 5
    # EOS pushed to the top: it still cannot come before min_tokens tokens.
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, min_tokens=6,
                                                logit_bias={eos: 100.0}), use_tqdm=False)[0]
    assert out.outputs[0].token_ids[-1] == eos and len(out.outputs[0].token_ids) == 7
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", None)  # EOS: None, as vLLM
    assert_pool_whole(llm)


def test_logit_bias_comes_before_penalties(llm: LLM, model_dir: Path) -> None:
    """vLLM's order (v1/sample/sampler.py apply_logits_processors): the bias, then the penalties, so
    a repetition penalty scales the biased logit, (l + b) / r, not l / r + b."""
    prompt = random_prompts([12], VOCAB, seed=6)[0]
    bias = {t: 0.3 for t in prompt[:6]} | {t: -0.2 for t in prompt[6:]}

    def biased(logits: torch.Tensor) -> torch.Tensor:
        for t, b in bias.items():
            logits[t] += b
        return logits

    for rep in (0.5, 1.8):
        penalize = penalty_process(prompt, rep, 0.0, 0.0)
        expected = reference_greedy(model_dir, prompt, 12, lambda lg, out: penalize(biased(lg), out))
        assert expected != reference_greedy(model_dir, prompt, 12, lambda lg, out: biased(penalize(lg, out)))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=rep,
                                logit_bias=bias)
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == expected, rep


def test_logprobs_match_transformers(llm: LLM, model_dir: Path) -> None:
    prompt = random_prompts([9], VOCAB, seed=3)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.9, seed=7, max_tokens=6, logprobs=3,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for i, tok in enumerate(out.token_ids):
        ref = torch.log_softmax(hf_logits(model_dir, prompt + out.token_ids[:i])[-1], dim=-1)
        entry = out.logprobs[i]
        assert tok in entry and len(entry) in (3, 4)
        assert entry[tok].logprob == pytest.approx(ref[tok].item(), abs=1e-4)
        assert entry[tok].rank == int((ref > ref[tok]).sum()) + 1
        top = ref.topk(3)
        for rank, (val, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert entry[tid].logprob == pytest.approx(val, abs=1e-4)
            assert entry[tid].rank == rank
        # vLLM's string: the token's decode, or, for part of a character, what it makes with the tokens before
        text = vllm_token_string(llm.get_tokenizer(), tok)
        if text.endswith("\ufffd"):
            text = vllm_corrected(llm.get_tokenizer(), tok, out.token_ids[max(0, i - 4):i])
        assert entry[tok].decoded_token == text
        total += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_prompt_logprobs_match_transformers(llm: LLM, model_dir: Path) -> None:
    prompt = random_prompts([40], VOCAB, seed=4)[0]
    # Cached first, so the request must opt out of prefix-cache reads to see every position.
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ref = torch.log_softmax(hf_logits(model_dir, prompt), dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert len(entry) in (2, 3)


def test_stop_strings_cut_text_and_free_blocks(llm: LLM) -> None:
    prompt = random_prompts([10], VOCAB, seed=5)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = free.text
    assert len(text) > 12
    stop = text[6:9]
    first = text.index(stop)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop, "\x00"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:first]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < 30
    inc = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop,
                                                include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert inc.text == text[: first + len(stop)]
    assert_pool_whole(llm)


def test_streaming_deltas_add_up(llm: LLM) -> None:
    engine = llm.engine
    prompts = random_prompts([5, 17, 33], VOCAB, seed=6)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=25, ignore_eos=True)
    finals = llm.generate(prompts, params, use_tqdm=False)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params, stream=True)
    texts = {f"s{i}": "" for i in range(3)}
    tokens: dict[str, list[int]] = {f"s{i}": [] for i in range(3)}
    done = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                texts[out.request_id] += c.text
                tokens[out.request_id] += c.token_ids
            if out.finished:
                done.add(out.request_id)
    assert done == set(texts)
    for i, final in enumerate(finals):
        assert tokens[f"s{i}"] == final.outputs[0].token_ids
        assert texts[f"s{i}"] == final.outputs[0].text


def test_parallel_sampling_shares_the_prompt(model_dir: Path) -> None:
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=512, max_model_len=1024, block_size=16)
    prompt = random_prompts([200], VOCAB, seed=8)[0]
    greedy_one = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.scheduler.core.stats()  # noqa: B018 - the pool is idle and whole here
    many = llm.generate([prompt], SamplingParams(n=8, temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0]
    assert [c.index for c in many.outputs] == list(range(8))
    assert all(c.token_ids == greedy_one for c in many.outputs)

    # Peak blocks in use: one prompt's full blocks plus each sample's own blocks.
    llm2 = LLM(str(model_dir), device="cpu", num_kvcache_blocks=512, max_model_len=1024, block_size=16,
               enable_prefix_caching=False)
    engine = llm2.engine
    max_new = 40
    engine.add_request("p", prompt, SamplingParams(n=8, temperature=1.0, seed=1, max_tokens=max_new, ignore_eos=True))
    peak = 0
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        peak = max(peak, engine.stats()["num_used_blocks"])
    # Peak after the step before the last: each sample has computed prompt + max_new - 2 tokens.
    blocks_per_sample = math.ceil((len(prompt) + max_new - 2) / 16)
    shared = len(prompt) // 16
    assert peak == shared + 8 * (blocks_per_sample - shared)
    assert peak < 8 * blocks_per_sample
    samples = [c.token_ids for c in outs[0].outputs]
    assert len(samples) == 8 and all(len(s) == max_new for s in samples)
    assert len({tuple(s) for s in samples}) > 1  # sampled, so they differ
    assert_pool_whole(llm2)


def reference_beam_search(model_dir: Path, prompt: list[int], width: int, steps: int, eos: int | None,
                          length_penalty: float) -> list[tuple[list[int], float]]:
    """The same algorithm as the engine's, by full recomputation over transformers' logits."""
    live = [(list(prompt), 0.0)]
    done: list[tuple[list[int], float]] = []
    for _ in range(steps):
        cands = []
        for tokens, cum in live:
            lp = torch.log_softmax(hf_logits(model_dir, tokens)[-1], dim=-1)
            top = lp.topk(2 * width)
            for v, t in zip(top.values.tolist(), top.indices.tolist()):
                cands.append((tokens + [t], cum + v))
        cands.sort(key=lambda c: c[1], reverse=True)
        live = []
        for tokens, cum in cands[:width]:
            (done if eos is not None and tokens[-1] == eos else live).append((tokens, cum))
        if not live:
            break
    done += live

    def score(c: tuple[list[int], float]) -> float:
        n = len(c[0]) - (1 if eos is not None and c[0][-1] == eos else 0)
        return c[1] / n ** length_penalty

    return sorted(done, key=score, reverse=True)[:width]


def test_beam_search_matches_reference(llm: LLM, model_dir: Path) -> None:
    prompts = random_prompts([7, 20], VOCAB, seed=9)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        ref = reference_beam_search(model_dir, prompt, 3, 6, None, 1.0)
        assert [s.tokens for s in out.sequences] == [r[0] for r in ref]
        for s, r in zip(out.sequences, ref):
            assert s.cum_logprob == pytest.approx(r[1], abs=1e-3)
    assert_pool_whole(llm)


def test_beam_search_matches_transformers_generate(llm: LLM, model_dir: Path) -> None:
    prompt = random_prompts([11], VOCAB, seed=10)[0]
    hf = hf_model(str(model_dir))
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([prompt]), num_beams=2, num_return_sequences=2, max_new_tokens=5,
                             do_sample=False, early_stopping=True, length_penalty=1.0, eos_token_id=None,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    ours = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=5,
                                                                             ignore_eos=True))[0]
    assert [s.tokens for s in ours.sequences] == hf_out.sequences.tolist()


def test_beam_memory_follows_live_beams(model_dir: Path) -> None:
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=512, max_model_len=1024, block_size=16,
              enable_prefix_caching=False)
    engine = llm.engine
    prompt = random_prompts([100], VOCAB, seed=12)[0]
    width, max_new = 4, 40
    peak = 0
    original_step = engine.scheduler.core.postprocess

    def watching(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        nonlocal peak
        result = original_step(*args, **kwargs)
        peak = max(peak, engine.scheduler.core.stats()["num_used_blocks"])
        return result

    engine.scheduler.core = _Spy(engine.scheduler.core, watching)
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=width, max_tokens=max_new,
                                                                         ignore_eos=True))
    assert len(out[0].sequences) == width
    shared = len(prompt) // 16
    bound = shared + width * (math.ceil((len(prompt) + max_new) / 16) - shared)
    assert 0 < peak <= bound
    assert_pool_whole(llm)


class _Spy:
    """Wraps the core so the test can watch the pool after every postprocess."""

    def __init__(self, core, postprocess) -> None:  # noqa: ANN001
        self._core = core
        self.postprocess = postprocess

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._core, name)


def test_seeded_parallel_samples_do_not_depend_on_the_batch(model_dir: Path) -> None:
    """Each of a seeded request's n samples draws from its own generator, so preemption (which runs
    the siblings in another order) and batch neighbours do not change its tokens."""
    prompt = random_prompts([45], VOCAB, seed=31)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = LLM(str(model_dir), device="cpu", num_kvcache_blocks=256, max_model_len=128, max_num_seqs=8)
    expected = [c.token_ids for c in alone.generate([prompt], params, use_tqdm=False)[0].outputs]
    assert len({tuple(t) for t in expected}) == 3
    # Room for all 9 samples at once (max_num_seqs), not for their blocks: preemption.
    small = LLM(str(model_dir), device="cpu", num_kvcache_blocks=20, max_model_len=128, max_num_seqs=9)
    others = random_prompts([50, 55, 40], VOCAB, seed=32)
    outs = small.generate(others + [prompt], [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)] * 3
                          + [params], use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    assert [c.token_ids for c in outs[-1].outputs] == expected
    assert_pool_whole(small)


def test_fan_out_never_runs_or_samples_more_than_max_num_seqs(model_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """4 prompts x n=8 on an engine of max_num_seqs=8: each prompt is admitted only when its 8
    samples fit, so no step samples more rows than the memory profile reserved (max_num_seqs)
    and no more sequences run; the seeded samples equal those of an engine with room for all."""
    prompts = random_prompts([9, 14, 6, 11], VOCAB, seed=41)
    params = SamplingParams(n=8, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    roomy = LLM(str(model_dir), device="cpu", num_kvcache_blocks=256, max_model_len=128)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(str(model_dir), device="cpu", num_kvcache_blocks=256, max_model_len=128, max_num_seqs=8)
    engine = tight.engine
    rows: list[int] = []
    running: list[int] = []
    token_sampler = engine.executor.runner.token_sampler
    sampler = token_sampler.sampler

    def spy(logits, batch):  # noqa: ANN001, ANN202
        rows.append(logits.shape[0])
        running.append(engine.scheduler.core.num_running)
        return sampler(logits, batch)

    monkeypatch.setattr(token_sampler, "sampler", spy)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == expected
    assert max(rows) <= 8 and max(running) <= 8, (max(rows), max(running))
    assert_pool_whole(tight)
    with pytest.raises(ValueError, match=r"^n = 9 .*max_num_seqs = 8"):
        tight.generate(prompts[0], SamplingParams(n=9), use_tqdm=False)
    assert_pool_whole(tight)
