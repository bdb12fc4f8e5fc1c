"""Structured output (xgrammar) offline, on a tiny random model that would never write JSON by
itself: every choice / regex / grammar output matches, every JSON output that finished with "stop"
parses and validates, greedy and sampled and n > 1, through preemption; unconstrained rows of the
same batch are untouched; bad specs are ValueErrors that leave the engine clean."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from engine_helpers import apply_pending_changes, random_prompts
from tiny_models import make_tiny_model

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.builtin_model import TinyModelSpec, create_model_dir
from nanovllm.sample import grammar as grammar_module
from nanovllm.sample.grammar import GrammarCacheFull, GrammarCompiler, GrammarTooLarge
from nanovllm.sample.utf8 import ACCEPT, NUM_STATES, REJECT, Utf8Tokens

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
    grammars = llm.engine.executor.runner.token_sampler.state.grammars  # None until a grammar is admitted
    assert grammars is None or not grammars.matchers


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


def test_a_grammar_finished_before_min_tokens_aborts(llm: LLM) -> None:
    """min_tokens masks the EOS a finished grammar needs: the row has no token left, so the
    sequence ends with "abort" (design.md), greedy or sampled, even where the draw then lands on
    the masked EOS itself (id 0 here, which the grammar would accept as its end)."""
    so = StructuredOutputsParams(choice=["alpha", "beta"])
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        outs = llm.generate(PROMPTS, params(so, max_tokens=30, min_tokens=20, **extra), use_tqdm=False)
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason == "abort" and len(c.token_ids) < 20, (extra, c)
            assert c.text in ("alpha", "beta")
    assert_clean(llm)


def test_logprobs_are_of_the_masked_distribution(llm: LLM) -> None:
    """As vLLM's (its grammar bitmask applies before the sampler takes logprobs): a greedy
    constrained token is the masked distribution's first, a token the grammar forces has logprob 0,
    and the alternatives listed share the masked distribution's mass (as vLLM, those past what
    the grammar allows are listed at -inf)."""
    prompt = "the answer is"
    so = StructuredOutputsParams(choice=["yes yes", "no no no"])
    out = llm.generate(prompt, params(so, temperature=0.0, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and out.text in so.choice
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry[token].rank == 1
        assert sum(np.exp(lp.logprob) for lp in entry.values()) <= 1 + 1e-5
    assert out.logprobs[-1][out.token_ids[-1]].logprob == 0.0  # the end is forced once the choice is whole
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))
    # Above the unconstrained model's logprob of the same first token: the mask renormalizes.
    raw = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=20), use_tqdm=False)
    top = raw[0].outputs[0].logprobs[0]  # type: ignore[index]
    first = out.token_ids[0]
    at_most = top[first].logprob if first in top else min(lp.logprob for lp in top.values())
    assert out.logprobs[0][first].logprob > at_most
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


def test_compiled_once_per_spec_in_a_bounded_cache_that_evicts_only_unheld_grammars(llm: LLM) -> None:
    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    a_spec, b_spec = StructuredOutputsParams(regex="[ab]+"), StructuredOutputsParams(choice=["x", "y"])
    a = compiler.compile(a_spec)
    again = compiler.compile(StructuredOutputsParams(regex="[ab]+"))
    assert again.compiled is a.compiled and compiler.num_cached == 1
    again.release()
    compiler.cache_bytes = a.nbytes + 1  # room for one grammar
    with pytest.raises(GrammarCacheFull, match="retry"):
        compiler.compile(b_spec)  # `a` is held: it stays, and `b` does not fit beside it
    assert compiler.held_bytes == a.nbytes
    a.release()
    a.release()  # idempotent
    b = compiler.compile(b_spec)  # `a` is held by nobody now: evicted
    assert compiler.num_cached == 1 and compiler.held_bytes == b.nbytes
    assert compiler.compile(b_spec).compiled is b.compiled
    compiler.cache_bytes = 1
    with pytest.raises(GrammarTooLarge, match="more than the whole grammar cache"):
        compiler.compile(a_spec)


def test_admission_never_compiles(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grammar is compiled before admission and handed to add_request; the engine (whose
    thread steps every other request) never compiles, even when the cache evicted the spec, and
    refuses a constrained request that comes without its grammar."""
    engine = llm.engine
    spec = StructuredOutputsParams(regex="[0-9]{4}")
    held = engine.grammars.compile(spec)
    monkeypatch.setattr(engine.grammars, "cache_bytes", held.nbytes)  # every other grammar is evicted

    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("a grammar was compiled at admission")

    monkeypatch.setattr(grammar_module, "compile_spec", no_compile)
    monkeypatch.setattr(engine.grammars, "compile", no_compile)
    engine.add_request("held", "hi", params(spec, temperature=0), grammar=held)
    with pytest.raises(ValueError, match="compiled before admission"):
        engine.add_request("bare", "hi", params(spec, temperature=0))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["held"] and re.fullmatch("[0-9]{4}", outs[0].outputs[0].text)
    assert engine.grammars.held_bytes == 0  # released when the request finished
    assert_clean(llm)


def _random_regex(rng: random.Random) -> str:
    atoms = ["[a-z]", "[^a-c]", ".", "[0-9]", "(ab|c.)", "[^\\x00-\\x7f]", "[A-Z]", "x"]
    return "".join(rng.choice(atoms) + rng.choice(["", "{1,3}", "{0,2}", "+", "?"]) for _ in range(rng.randint(1, 3)))


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    choice = rng.randrange(7 if depth < 2 else 4)
    if choice == 0:
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 8)}
    if choice == 1:
        return {"type": "string", "pattern": f"^{_random_regex(rng)}$"}
    if choice == 2:
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if choice == 3:
        return {"enum": rng.sample(["a", "b\"c", "\u00e9t\u00e9", "tab\t", "\U0001f600", "x" * 5], 3)}
    if choice == 4:
        return {"type": "array", "items": _random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    if choice == 5:
        names = rng.sample(["a", "b", "c", "d"], rng.randint(1, 3))
        return {"type": "object", "properties": {n: _random_schema(rng, depth + 1) for n in names},
                "required": rng.sample(names, rng.randint(0, len(names))), "additionalProperties": False}
    return {"anyOf": [{"type": "boolean"}, {"type": "null"}, _random_schema(rng, depth + 1)]}


def test_fuzz_constrained_outputs_are_valid_text_that_validates(llm: LLM) -> None:
    """Random schemas with length-bounded strings, patterns, enums with escapes and non-ASCII,
    nested arrays and objects; random regexes. Sampled hot (temperature 1.5) so that the model,
    random as it is, tries whatever the grammar lets through: every output that finished parses,
    validates, holds only whole UTF-8 characters (no U+FFFD) and no raw control character."""
    rng = random.Random(26)
    checked = 0
    for trial in range(24):
        schema = _random_schema(rng)
        so = StructuredOutputsParams(json=schema) if trial % 3 else StructuredOutputsParams(
            regex=_random_regex(rng))
        outs = llm.generate(["a", "b"], params(so, temperature=1.5, seed=trial, n=4, max_tokens=80), use_tqdm=False)
        for c in (c for o in outs for c in o.outputs):
            assert "\ufffd" not in c.text, (so, c.text)
            if c.finish_reason != "stop":
                assert c.finish_reason == "length", (so, c)
                continue
            checked += 1
            if so.regex is not None:
                assert re.fullmatch(so.regex, c.text, re.DOTALL), (so.regex, c.text)
            else:
                jsonschema.validate(json.loads(c.text), schema)
    assert checked >= 100
    assert_clean(llm)


def test_utf8_tables_agree_with_pythons_decoder() -> None:
    """A token is allowed after others exactly when Python's incremental UTF-8 decoder accepts
    their bytes; a stop token only between characters; surrogates and overlong forms never."""
    rng = random.Random(5)
    tokens = [bytes(rng.randrange(256) for _ in range(rng.randint(1, 5))) for _ in range(3000)]
    tokens += [b"\xc3\xa9", b"\xe2\x82", b"\xac", b"\xed\xa0\x80", b"\xed\x9f\xbf", b"\xc0\x80", b"\xf4\x90\x80\x80",
               b"\xf0\x9f\x98\x80", b"", b"stop"]
    stop = len(tokens) - 1
    tables = Utf8Tokens(tokens, len(tokens) + 3, [], [stop])  # 3 ids past the tokenizer: never allowed

    def valid(data: bytes) -> bool:
        """Some continuation bytes (none, or up to 3) make `data` whole UTF-8."""
        for tail in completions:
            try:
                (data + tail).decode("utf-8")
            except UnicodeDecodeError:
                continue
            return True
        return False

    continuation = [b"\x80", b"\x90", b"\xa0", b"\xbf"]
    completions = [b""] + [b"".join(t) for k in (1, 2, 3) for t in itertools.product(continuation, repeat=k)]

    for _ in range(4000):
        first, second = rng.randrange(stop), rng.randrange(stop)
        state = tables.advance(ACCEPT, first)
        assert (state != REJECT) == valid(tokens[first]), tokens[first]
        if state != REJECT:
            assert (tables.advance(state, second) != REJECT) == valid(tokens[first] + tokens[second])
            pending = not valid(tokens[first] + b"a")  # in the middle of a character
            assert (tables.advance(state, stop) != REJECT) == (not pending)
    allowed = np.unpackbits(tables.allowed_bitmask.view(np.uint8), bitorder="little").reshape(NUM_STATES, -1)
    assert not allowed[:, stop + 1:len(tokens) + 3].any() and not allowed[REJECT].any()
    assert (allowed[:, :len(tokens) + 3].astype(bool) == (tables.next_state != REJECT)).all()


def test_vllms_structured_output_options() -> None:
    """vLLM's StructuredOutputsParams options: taken where they ask for what xgrammar does here (JSON
    without free whitespace, only the schema's properties), refused by name otherwise."""
    ok = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True,
                                 disable_additional_properties=True)
    assert ok.kind == "json" and ok.key == ("json", '{"type": "object"}')
    for kwargs, match in (({"disable_any_whitespace": False}, "disable_any_whitespace=False is not supported"),
                          ({"whitespace_pattern": " *"}, "whitespace_pattern is not supported"),
                          ({"structural_tag": "{}"}, "structural_tag is not supported")):
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(json_object=True, **kwargs)
