"""The engine's features on a mixture-of-experts model, as on a dense one: beam search against a
reference over transformers' logits, parallel samples sharing their prompt's blocks (copy-on-write),
structured output from Python and through the OpenAI server (tests/moe_models.py's Qwen3-MoE)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from engine_helpers import random_prompts
from moe_models import make_moe_model
from server_process import ServerProcess
from test_sampling_features import assert_pool_whole, reference_beam_search
from test_server_structured import assert_chat_follows_person_schema
from test_structured_output import PERSON

from nanovllm import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")

VOCAB = 512


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_moe_model(tmp_path_factory.mktemp("moe_features"), "qwen3_moe_mixed")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu", num_kvcache_blocks=256, block_size=16, max_model_len=1024)


def test_beam_search_matches_reference(llm: LLM, model_dir: Path) -> None:
    prompts = random_prompts([9, 21], VOCAB, seed=11)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = reference_beam_search(model_dir, prompt, 3, 5, None, 1.0)
        assert [s.tokens for s in out.sequences] == [r[0] for r in ref]
        for s, r in zip(out.sequences, ref):
            assert s.cum_logprob == pytest.approx(r[1], abs=1e-3)
    assert_pool_whole(llm)


def test_parallel_samples_share_the_prompt_and_match_one_sample(llm: LLM) -> None:
    """n = 4 greedy samples of a 40-token prompt (2 full blocks shared, the third copied on write)
    are each the single greedy output; seeded random samples repeat."""
    prompt = random_prompts([40], VOCAB, seed=12)[0]
    one = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    many = llm.generate([prompt], SamplingParams(n=4, temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    assert [c.token_ids for c in many[0].outputs] == [one[0].outputs[0].token_ids] * 4
    seeded = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    first, again = (llm.generate([prompt], seeded, use_tqdm=False)[0].outputs for _ in range(2))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert len({tuple(c.token_ids) for c in first}) > 1
    assert_pool_whole(llm)


def test_structured_output_follows_the_schema(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(json=json.dumps(PERSON)))
    outs = llm.generate(["a person:"], params, use_tqdm=False)[0].outputs
    assert len(outs) == 3
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
    assert_pool_whole(llm)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess(model_dir, tmp_path_factory.mktemp("moe_server"), "--num-kvcache-blocks", "256",
                       "--max-model-len", "512", "--served-model-name", "moe") as srv:
        yield srv


def test_server_json_schema_chat_and_greedy_completion(server: ServerProcess, llm: LLM) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    assert_chat_follows_person_schema(client, "moe", 2)
    greedy = client.completions.create(model="moe", prompt="hello there", max_tokens=8, temperature=0)
    expected = llm.generate("hello there", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert greedy.choices[0].text == expected.outputs[0].text
