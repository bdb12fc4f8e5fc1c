"""Structured output (xgrammar) offline, on a tiny random model that would never write JSON by
itself: every choice / regex / grammar output matches, every JSON output that finished with "stop"
parses and validates, greedy and sampled and n > 1, through preemption; unconstrained rows of the
same batch are untouched; bad specs are ValueErrors that leave the engine clean."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from engine_helpers import apply_pending_changes, random_prompts
from tiny_models import make_tiny_model

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.builtin_model import TinyModelSpec, create_model_dir
from nanovllm.sample.grammar import GrammarCompiler

VOCAB = 512

# Finite: every output ends within a bounded number of tokens, so greedy decoding finishes too.
# (Strings are bounded with a pattern: xgrammar 0.2.9 turns maxLength into a character class that
# lets raw control characters into the string, which JSON forbids.)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-zA-Z ]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{0,3}$"}, "maxItems": 2},
    },
    "required": ["name", "age", "member", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("structured"), "qwen3")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu", num_kvcache_blocks=256, max_model_len=512)


def assert_clean(llm: LLM) -> None:
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"] and s["num_requests"] == 0
    apply_pending_changes(llm)
    assert not llm.engine.executor.runner.token_sampler.state.grammars.matchers


def params(so: StructuredOutputsParams, **kw: object) -> SamplingParams:
    return SamplingParams(structured_outputs=so, **{"max_tokens": 200, **kw})  # type: ignore[arg-type]


SAMPLINGS = [dict(temperature=0.0), dict(temperature=1.0, seed=7, n=3), dict(temperature=0.8, top_k=20, top_p=0.9, n=2)]
PROMPTS = ["hello there", "the answer is", "x"]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_choice_regex_grammar_outputs_match(llm: LLM, sampling: dict) -> None:
    choices = ["yes", "no", "maybe so", 'a "quoted"\nline']
    cases = [
        (StructuredOutputsParams(choice=choices), lambda t: t in choices),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        (StructuredOutputsParams(grammar='root ::= "id" ("-" [a-c])+ | "none"'),
         lambda t: re.fullmatch(r"id(-[a-c])+|none", t)),
    ]
    for so, ok in cases:
        outs = llm.generate(PROMPTS, params(so, max_tokens=40, **sampling), use_tqdm=False)
        comps = [c for o in outs for c in o.outputs]
        assert len(comps) == len(PROMPTS) * sampling.get("n", 1)
        for c in comps:
            if c.finish_reason == "stop":
                assert ok(c.text), (so.kind, c.text)
            else:  # the grammar "id(-[a-c])+" is unbounded
                assert so.kind == "grammar" and c.finish_reason == "length"
        assert sum(c.finish_reason == "stop" for c in comps) >= len(comps) // 2
    assert_clean(llm)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_json_schema_outputs_validate(llm: LLM, sampling: dict) -> None:
    for schema in (PERSON, json.dumps(PERSON)):  # a dict or a JSON string
        outs = llm.generate(PROMPTS, params(StructuredOutputsParams(json=schema), **sampling), use_tqdm=False)
        for c in (c for o in outs for c in o.outputs):
            assert c.finish_reason == "stop", c.text  # the schema is finite
            jsonschema.validate(json.loads(c.text), PERSON)
    assert_clean(llm)


def test_json_object_outputs_parse(llm: LLM) -> None:
    so = StructuredOutputsParams(json_object=True)
    outs = llm.generate(PROMPTS, params(so, temperature=1.0, seed=3, n=4, max_tokens=60), use_tqdm=False)
    done = [c.text for o in outs for c in o.outputs if c.finish_reason == "stop"]
    assert done
    for text in done:
        assert isinstance(json.loads(text), dict)
    for c in (c for o in outs for c in o.outputs if c.finish_reason != "stop"):
        assert c.text.startswith("{") and c.finish_reason == "length"


def test_grammar_end_stops_even_without_eos(llm: LLM) -> None:
    """With ignore_eos the core never ends on EOS: the grammar's end aborts the sequence ("stop"),
    as a stop string does; max_tokens still ends it first with "length"."""
    so = StructuredOutputsParams(choice=["alpha", "beta"])
    out = llm.generate(PROMPTS, params(so, temperature=0, ignore_eos=True), use_tqdm=False)
    for o in out:
        assert o.outputs[0].text in ("alpha", "beta") and o.outputs[0].finish_reason == "stop"
    out = llm.generate("x", params(StructuredOutputsParams(regex="[a-z]{30}"), temperature=0, max_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and re.fullmatch("[a-z]+", out.text) and len(out.token_ids) == 3
    assert_clean(llm)


def test_stop_strings_still_cut(llm: LLM) -> None:
    so = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")
    out = llm.generate("hi", params(so, temperature=0, stop="-"), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{3}", out.text) and out.finish_reason == "stop" and out.stop_reason == "-"
    assert_clean(llm)


def test_unconstrained_rows_untouched(llm: LLM) -> None:
    """Greedy and seeded rows give the same tokens with or without constrained rows beside them."""
    prompts = random_prompts([9, 14, 6], VOCAB, seed=5)
    plain = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.7, top_k=30, seed=12, max_tokens=12, ignore_eos=True)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    constrained = [params(StructuredOutputsParams(json=PERSON), temperature=1.0, n=2),
                   params(StructuredOutputsParams(regex="[a-z]{20}"), temperature=0)]
    mixed = llm.generate(prompts + PROMPTS[:2], plain + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    assert_clean(llm)


def test_preemption_keeps_grammar_state(model_dir: Path, llm: LLM) -> None:
    """A preempted sequence is recomputed from its kept tokens; its matcher stays where it was, so
    greedy outputs equal those of an engine that never preempts."""
    prompts = random_prompts([40, 50, 45, 55], VOCAB, seed=21)
    p = params(StructuredOutputsParams(regex="[0-9a-f]{40}"), temperature=0, n=2)
    small = LLM(str(model_dir), device="cpu", num_kvcache_blocks=20, max_model_len=128, max_num_seqs=8)
    outs = small.generate(prompts, p, use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    assert_clean(small)
    expected = llm.generate(prompts, p, use_tqdm=False)
    for out, ref in zip(outs, expected):
        assert [c.text for c in out.outputs] == [c.text for c in ref.outputs]
        assert all(re.fullmatch("[0-9a-f]{40}", c.text) for c in out.outputs)


@pytest.mark.parametrize("so, kind", [
    (dict(json={"type": "nonsense"}), "json"),
    (dict(json="{not json"), "json"),
    (dict(regex="[0-9"), "regex"),
    (dict(grammar="root ::= undefined_rule"), "grammar"),
])
def test_invalid_spec_is_value_error(llm: LLM, so: dict, kind: str) -> None:
    bad = params(StructuredOutputsParams(**so))
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{kind} is not a valid"):
        llm.generate(["fine", "also fine"], [SamplingParams(max_tokens=2), bad], use_tqdm=False)
    assert_clean(llm)
    assert llm.generate("ok", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


@pytest.mark.parametrize("kwargs", [{}, dict(regex="a", choice=["a"]), dict(choice=[]), dict(choice="ab"),
                                    dict(regex=""), dict(json=3), dict(json_object=False), dict(grammar=5)])
def test_params_need_exactly_one_valid_kind(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)


def test_lm_head_padding_is_never_allowed(tmp_path: Path) -> None:
    """A tokenizer smaller than the LM head: ids past it have random logits but no text; a
    constrained row never samples them."""
    path = create_model_dir(tmp_path / "padded", spec=TinyModelSpec(seed=9), tokenizer_vocab=300)
    padded = LLM(str(path), device="cpu", num_kvcache_blocks=64, max_model_len=256)
    outs = padded.generate(PROMPTS, params(StructuredOutputsParams(json_object=True), temperature=1.5, seed=1,
                                           n=4, max_tokens=30), use_tqdm=False)
    tokens = [t for o in outs for c in o.outputs for t in c.token_ids]
    assert tokens and max(tokens) < len(padded.get_tokenizer())


def test_compiled_once_per_spec_in_a_bounded_cache(llm: LLM) -> None:
    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    a = StructuredOutputsParams(regex="[ab]+")
    assert compiler.compile(a) is compiler.compile(StructuredOutputsParams(regex="[ab]+"))
    compiler.cache_bytes = 1  # every new grammar evicts the least recently used ones
    b = compiler.compile(StructuredOutputsParams(choice=["x", "y"]))
    assert compiler.num_cached == 1 and compiler.compile(StructuredOutputsParams(choice=["x", "y"])) is b
    assert compiler.compile(a) is not None and compiler.num_cached == 1
