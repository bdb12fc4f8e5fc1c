"""Edge cases a vLLM user hits: beam search under a tight token budget / max_num_seqs / KV pool,
parallel sampling (n > 1) with EOS on the first token, max_tokens=1, streaming with stop strings,
and prompt logprobs under chunked prefill and preemption. Every scenario ends with no leaks."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import apply_pending_changes
from tiny_models import make_tiny_model

from nanovllm import LLM, BeamSearchParams, SamplingParams

PROMPTS = [list(range(5, 25)), list(range(100, 103)), list(range(200, 221))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("edge"), "qwen3")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu", num_kvcache_blocks=256, max_model_len=256, block_size=4)


def assert_idle(llm: LLM) -> None:
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]
    assert len(llm.engine.detokenizer) == 0
    assert llm.engine.num_requests == 0
    engine = llm.engine
    assert not engine._by_seq and not engine.scheduler._reserved and not engine.scheduler._admitted
    apply_pending_changes(llm)  # then no sampling row, penalty / bias slot or generator may be left behind
    sampler = engine.executor.runner.token_sampler
    rows = sampler.state.rows
    assert not sampler.state.generators and (rows.penalty_slot < 0).all() and (rows.bias_slot < 0).all()
    assert (rows.stop_row < 0).all() and (rows.num_output == 0).all() and (rows.logprobs < 0).all()
    assert not sampler._children and not sampler._prompt_logprobs


def beams(outs) -> list:  # noqa: ANN001
    return [[(s.tokens, round(s.cum_logprob, 4), s.finish_reason) for s in o.sequences] for o in outs]


# A tiny pool comes with a max_model_len it can hold (the engine refuses a smaller pool).
@pytest.mark.parametrize("kwargs", [dict(max_num_batched_tokens=8), dict(max_num_seqs=4),
                                    dict(num_kvcache_blocks=14, max_model_len=56)],
                         ids=["token-budget", "max-num-seqs", "tiny-kv-pool"])
def test_beam_search_beams_advance_in_lockstep(llm: LLM, model_dir: Path, kwargs: dict) -> None:
    # 3 prompts x 3 beams do not all fit one step: a group used to decide on a subset of its beams
    # and keep the rest, so it grew past beam_width and its result depended on scheduling.
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    ref = beams(llm.beam_search(PROMPTS, params))
    assert_idle(llm)
    tight = LLM(str(model_dir), device="cpu", block_size=4, **{"num_kvcache_blocks": 256, "max_model_len": 256, **kwargs})
    assert beams(tight.beam_search(PROMPTS, params)) == ref
    assert_idle(tight)
    # max_tokens=1 under the same limits
    one = BeamSearchParams(beam_width=3, max_tokens=1)
    assert beams(tight.beam_search(PROMPTS, one)) == beams(llm.beam_search(PROMPTS, one))
    assert_idle(tight)


def test_parallel_sampling_max_tokens_one_and_eos_first(llm: LLM) -> None:
    out = llm.generate(PROMPTS[:2], SamplingParams(n=3, max_tokens=1, temperature=1.0, seed=1, logprobs=1),
                       use_tqdm=False)
    for r in out:
        assert [len(c.token_ids) for c in r.outputs] == [1, 1, 1]
        assert all(c.finish_reason == "length" and len(c.logprobs) == 1 for c in r.outputs)
    assert_idle(llm)
    # EOS pushed up: some completions (the parent included, for some seeds) end at their first token.
    for seed in range(6):
        out = llm.generate(PROMPTS[:2], SamplingParams(n=4, max_tokens=5, temperature=1.0, seed=seed,
                                                       logit_bias={0: 4.5}), use_tqdm=False)
        for r in out:
            assert len(r.outputs) == 4 and r.finished
            for c in r.outputs:
                assert (c.finish_reason == "stop") == (c.token_ids[-1] == 0)
        assert_idle(llm)


def test_streamed_n_with_stop_strings_matches_non_streamed(llm: LLM) -> None:
    eng = llm.engine
    for seed in range(3):
        params = SamplingParams(n=3, max_tokens=7, temperature=1.0, seed=seed, stop=["e ", "th", "s."],
                                logit_bias={0: 4.0})
        acc: dict = {}
        for i, p in enumerate(PROMPTS[:2]):
            eng.add_request(f"edge-s{i}", p, params, stream=True)
        while eng.has_unfinished_requests():
            for out in eng.step():
                for c in out.outputs:
                    a = acc.setdefault((out.request_id, c.index), ["", [], None])
                    a[0] += c.text
                    a[1] += c.token_ids
                    a[2] = c.finish_reason or a[2]
        assert_idle(llm)
        full = llm.generate(PROMPTS[:2], params, use_tqdm=False)
        for i, r in enumerate(full):
            for c in r.outputs:
                assert acc[(f"edge-s{i}", c.index)] == [c.text, c.token_ids, c.finish_reason]
        assert_idle(llm)


@pytest.mark.parametrize("kwargs", [dict(max_num_batched_tokens=5), dict(num_kvcache_blocks=12, max_model_len=48),
                                    dict(max_num_seqs=3)],
                         ids=["chunked", "preempted", "sliced"])  # sliced: more prompt rows than max_num_seqs
def test_prompt_logprobs_chunked_and_preempted(llm: LLM, model_dir: Path, kwargs: dict) -> None:
    params = SamplingParams(n=2, max_tokens=10, temperature=0, prompt_logprobs=2, logprobs=1, ignore_eos=True)
    ref = llm.generate(PROMPTS, params, use_tqdm=False)
    tight = LLM(str(model_dir), device="cpu", block_size=4, **{"num_kvcache_blocks": 256, "max_model_len": 256, **kwargs})
    out = tight.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(ref, out):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-3 and x[t].rank == y[t].rank for t in x)
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert_idle(tight)
    assert_idle(llm)
