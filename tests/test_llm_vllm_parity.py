"""The offline API where a vLLM user would notice a difference: the text of a token that ended the
request (EOS, a stop token id) left out of `text` (vLLM's detokenizer.update(stop_terminated)),
generation_config.json's end tokens, LLM.chat's template options, max_tokens=None, seed=-1 and
LLM(seed=None), each logprobs dict starting with the chosen token, temperature's bounds,
detokenize=False, the sampling
defaults generation_config.json sets (vLLM's generation_config), beam search's choice of
beams (vLLM's LLM.beam_search, written out here over transformers' logits), and bad_words: each word
tokenized as vLLM's update_from_tokenizer does, and a token masked where it would complete one of
the word's token sequences after the output's last tokens (vLLM's apply_bad_words; the prompt does
not count), against a greedy loop over transformers' logits that masks by that rule."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from engine_helpers import hf_model
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from nanovllm import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams

ENGINE = dict(device="cpu", num_kvcache_blocks=256, max_model_len=512, block_size=16)
PROMPT = "hello world, this is"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("parity"), "qwen3")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), **ENGINE)


def greedy(llm: LLM, **kw: object):  # noqa: ANN201
    return llm.generate(PROMPT, SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]


def plain_token_at(llm: LLM, ids: list[int]) -> int:
    """The index of the first token after the second that did not come before and decodes to letters."""
    tok = llm.get_tokenizer()
    return next(k for k, t in enumerate(ids) if k >= 2 and t not in ids[:k] and tok.decode([t]).strip().isalpha())


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_id_keeps_its_token_but_not_its_text(llm: LLM, stream: bool) -> None:
    base = greedy(llm, max_tokens=20, ignore_eos=True)
    k = plain_token_at(llm, base.token_ids)
    stop_id = base.token_ids[k]
    def decode(ids: list[int]) -> str:  # vLLM's text: no U+FFFD at its end
        return llm.get_tokenizer().decode(ids).rstrip("\ufffd")

    for include, expected in ((False, decode(base.token_ids[:k])), (True, decode(base.token_ids[:k + 1]))):
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id],
                                include_stop_str_in_output=include)
        if stream:  # the text as the engine hands it out step by step
            engine = llm.engine
            engine.add_request("s", PROMPT, params)
            text, out = "", None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    text = out.outputs[0].text
            assert out is not None and text == expected
            continue
        out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base.token_ids[:k + 1] and (out.finish_reason, out.stop_reason) == ("stop", stop_id)
        assert out.text == expected


def test_eos_text_is_left_out_with_special_tokens_kept(llm: LLM) -> None:
    eos = llm.get_tokenizer().eos_token_id
    out = greedy(llm, max_tokens=5, logit_bias={eos: 100.0}, skip_special_tokens=False)
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""


def test_temperature_bounds_as_vllm(llm: LLM) -> None:
    """vLLM's SamplingParams: a temperature above 2 is an error; a positive one below 0.01 becomes
    0.01 (sampled, not greedy), so its seeded tokens are those of 0.01."""
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\]"):
        SamplingParams(temperature=2.5)
    assert SamplingParams(temperature=1e-7).temperature == SamplingParams(temperature=0.001).temperature == 0.01
    low, at_min = (llm.generate(PROMPT, SamplingParams(temperature=t, seed=1, max_tokens=8), use_tqdm=False)[0]
                   .outputs[0].token_ids for t in (1e-7, 0.01))
    assert low == at_min


def test_detokenize_false_gives_token_ids_only(llm: LLM) -> None:
    """vLLM's detokenize=False: the same tokens and logprobs, no text, no decoded strings."""
    kw = dict(temperature=0.8, seed=5, max_tokens=10, logprobs=2, prompt_logprobs=1)
    full = llm.generate(PROMPT, SamplingParams(**kw), use_tqdm=False)[0]
    bare = llm.generate(PROMPT, SamplingParams(detokenize=False, **kw), use_tqdm=False)[0]
    out, ref = bare.outputs[0], full.outputs[0]
    assert out.token_ids == ref.token_ids and out.text == "" and ref.text
    assert out.logprobs is not None and ref.logprobs is not None
    for got, want in zip(out.logprobs, ref.logprobs):
        assert {t: (lp.logprob, lp.rank) for t, lp in got.items()} == {t: (lp.logprob, lp.rank) for t, lp in want.items()}
        assert all(lp.decoded_token is None for lp in got.values())
    assert any(lp.decoded_token for e in ref.logprobs for lp in e.values())  # the strings were only left out
    assert bare.prompt_logprobs is not None and bare.prompt_logprobs[0] is None
    assert all(lp.decoded_token is None for e in bare.prompt_logprobs[1:] for lp in e.values())
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=False, stop=["x"])


def with_generation_config(model_dir: Path, where: Path, **fields: object) -> Path:
    shutil.copytree(model_dir, where)
    config = json.loads((where / "generation_config.json").read_text())
    (where / "generation_config.json").write_text(json.dumps({**config, **fields}))
    return where


def test_generation_config_gives_the_default_sampling_params(llm: LLM, model_dir: Path, tmp_path: Path) -> None:
    """vLLM's generation_config="auto": the sampling fields generation_config.json sets are what
    generate() uses without sampling_params (max_new_tokens as max_tokens); "vllm" ignores them,
    override_generation_config goes over them, a directory gives its own file's."""
    path = with_generation_config(model_dir, tmp_path / "gen", temperature=0.0, top_p=0.9, top_k=7,
                                  repetition_penalty=1.2, max_new_tokens=6, do_sample=True)
    gen = LLM(str(path), **ENGINE)
    params = gen.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.max_tokens) == \
        (0.0, 0.9, 7, 1.2, 6)
    out = gen.generate(PROMPT, use_tqdm=False)[0].outputs[0]
    expected = greedy(llm, max_tokens=6, top_p=0.9, top_k=7, repetition_penalty=1.2)
    assert out.token_ids == expected.token_ids
    assert LLM(str(path), generation_config="vllm", **ENGINE).get_default_sampling_params() == SamplingParams()
    over = LLM(str(path), override_generation_config={"top_p": 0.5, "max_new_tokens": 3}, **ENGINE)
    assert (over.get_default_sampling_params().top_p, over.get_default_sampling_params().max_tokens) == (0.5, 3)
    elsewhere = LLM(str(model_dir), generation_config=str(path), **ENGINE).get_default_sampling_params()
    assert elsewhere.max_tokens == 6 and llm.get_default_sampling_params() == SamplingParams()


def test_bad_generation_config_is_named(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="generation_config.json"):
        LLM(str(model_dir), generation_config=str(tmp_path / "missing"), **ENGINE)
    with pytest.raises(ValueError, match="override_generation_config"):
        LLM(str(model_dir), override_generation_config="{not json", **ENGINE)


def test_generation_config_end_tokens_stop_generation(llm: LLM, model_dir: Path, tmp_path: Path) -> None:
    base = greedy(llm, max_tokens=12, ignore_eos=True).token_ids
    k = next(i for i, t in enumerate(base) if i >= 3 and t not in base[:i] and t != 0)
    path = tmp_path / "gen_eos"
    shutil.copytree(model_dir, path)
    config = json.loads((path / "generation_config.json").read_text())
    config["eos_token_id"] = [0, base[k]]
    (path / "generation_config.json").write_text(json.dumps(config))
    out = greedy(LLM(str(path), **ENGINE), max_tokens=12)
    assert out.token_ids == base[:k + 1] and out.finish_reason == "stop"
    # vLLM makes the generation config's other end tokens stop tokens: stop_reason names them; the
    # model's own EOS (the tokenizer's) has none.
    assert out.stop_reason == base[k]
    assert greedy(LLM(str(path), **ENGINE), max_tokens=12, ignore_eos=True).token_ids == base
    eos = greedy(llm, max_tokens=4, logit_bias={0: 100.0})
    assert eos.token_ids == [0] and eos.finish_reason == "stop" and eos.stop_reason is None


def test_chat_template_options(llm: LLM) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False,
                    chat_template=template)[0].prompt == "[user] hi there\n"
    tokenizer = llm.get_tokenizer()
    thinking_off = llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False,
                            chat_template_kwargs={"enable_thinking": False})[0]
    assert thinking_off.prompt == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                                enable_thinking=False)
    conversation = [*messages, {"role": "assistant", "content": "Sure, "}]
    continued = llm.chat(conversation, SamplingParams(max_tokens=2), use_tqdm=False, add_generation_prompt=False,
                         continue_final_message=True)[0]
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False,
                                             continue_final_message=True)
    assert continued.prompt == expected and expected.endswith("Sure, ")
    assert continued.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message"):
        llm.chat(conversation, continue_final_message=True)


def test_chat_takes_vllms_arguments_and_content_parts(llm: LLM, model_dir: Path, tmp_path: Path) -> None:
    """LLM.chat's parameters in vLLM's order (the 4th is lora_request, not add_generation_prompt);
    OpenAI content parts joined by newlines (vLLM's "string" format) or passed as they are
    ("openai"); LLM(chat_template=...) as chat()'s default, a file or the template itself."""
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    positional = llm.chat(messages, SamplingParams(max_tokens=1), False, None)[0]
    assert positional.prompt == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    joined = llm.chat(parts, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert joined.prompt == tokenizer.apply_chat_template([{"role": "user", "content": "hi\nthere"}], tokenize=False,
                                                          add_generation_prompt=True)
    listing = "{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endfor %}"
    as_given = llm.chat(parts, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=listing,
                        chat_template_content_format="openai")[0]
    assert as_given.prompt == "<hi><there>"
    with pytest.raises(ValueError, match="only text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match="lora_request"):
        llm.chat(messages, None, False, object())
    with pytest.raises(TypeError, match="pass add_generation_prompt=... by name"):
        llm.chat(messages, None, False, False)
    with pytest.raises(ValueError, match="priority"):
        llm.generate(PROMPT, priority=[1])
    assert llm.generate(PROMPT, SamplingParams(max_tokens=1), priority=0, use_tqdm=False)[0].outputs
    (tmp_path / "t.jinja").write_text("{% for m in messages %}({{ m['content'] }}){% endfor %}")
    templated = LLM(str(model_dir), chat_template=str(tmp_path / "t.jinja"), **ENGINE)
    assert templated.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt == "(hi)"
    assert templated.llm_engine is templated.engine


def test_tokenization_kwargs_truncate_as_vllm(llm: LLM) -> None:
    """vLLM 0.32 truncates through tokenization_kwargs: the last k tokens, or the first with
    truncation_side "right"; -1 keeps max_model_len - 1; more than max_model_len is an error."""
    ids = list(range(1, 41))
    params = SamplingParams(temperature=0, max_tokens=2)
    last = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False,
                        tokenization_kwargs={"truncate_prompt_tokens": 8})[0]
    first = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False,
                         tokenization_kwargs={"truncate_prompt_tokens": 8, "truncation_side": "right"})[0]
    assert last.prompt_token_ids == ids[-8:] and first.prompt_token_ids == ids[:8]
    long = llm.generate({"prompt_token_ids": [5] * 600}, params, use_tqdm=False,
                        tokenization_kwargs={"truncate_prompt_tokens": -1})[0]
    assert len(long.prompt_token_ids) == 511 and len(long.outputs[0].token_ids) == 1
    with pytest.raises(ValueError, match="cannot be greater than max_model_len"):
        llm.generate(ids, SamplingParams(truncate_prompt_tokens=513), use_tqdm=False)
    plain = llm.generate(PROMPT, params, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False,
                                                                              "padding": True})[0]
    assert plain.prompt == PROMPT
    assert plain.prompt_token_ids == llm.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate([ids, ids], params, priority=[0])


def test_vllm_sampling_param_forms(llm: LLM) -> None:
    """logprobs=True is 1 (vLLM's); a -inf logit_bias bans a token, and any finite bias is taken;
    vLLM's prompt TypedDicts and RequestOutputKind import from the package."""
    from nanovllm import RequestOutputKind, TextPrompt, TokensPrompt

    assert SamplingParams(logprobs=True).logprobs == 1 and SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(logprobs=False).logprobs == 0
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, extra_args={"a": 1}).extra_args == {"a": 1}
    base = greedy(llm, max_tokens=6, ignore_eos=True).token_ids
    banned = greedy(llm, max_tokens=6, ignore_eos=True, logit_bias={base[0]: float("-inf")}).token_ids
    assert banned[0] != base[0]
    assert greedy(llm, max_tokens=6, ignore_eos=True, logit_bias={base[0]: -1e9}).token_ids == banned
    forced = greedy(llm, max_tokens=3, ignore_eos=True, logit_bias={7: 250.0}).token_ids
    assert forced == [7, 7, 7]
    text: TextPrompt = {"prompt": PROMPT}
    tokens: TokensPrompt = {"prompt_token_ids": llm.get_tokenizer().encode(PROMPT)}
    a, b = llm.generate([text, tokens], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_max_tokens_none_runs_to_max_model_len(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, min_tokens=3)
    out = llm.generate({"prompt_token_ids": [5] * 500}, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 512 - 500 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens must be None"):
        SamplingParams(max_tokens=0)


def test_truncated_prompts_and_the_whole_vocabulary_of_logprobs(llm: LLM, model_dir: Path) -> None:
    ids = llm.get_tokenizer().encode("word " * 40)
    params = SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=10)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    kept = llm.generate({"prompt_token_ids": ids[-10:]}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out.prompt_token_ids == ids[-10:] and out.outputs[0].token_ids == kept[0].outputs[0].token_ids
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="more than this engine's max_logprobs"):  # -1: the vocabulary (512)
        llm.generate("abc", SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)
    everything = LLM(str(model_dir), max_logprobs=-1, **ENGINE)
    out = everything.generate("abc", SamplingParams(temperature=0, max_tokens=2, logprobs=-1), use_tqdm=False)[0]
    vocab = everything.engine.vocab_size
    assert all(len(d) == vocab for d in out.outputs[0].logprobs or [])


def test_allowed_token_ids_are_the_only_ones_sampled(llm: LLM) -> None:
    allowed = [7, 300, 301]
    for params in (SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed,
                                  logit_bias={300: -100.0}, n=2)):
        for comp in llm.generate(PROMPT, params, use_tqdm=False)[0].outputs:
            assert len(comp.token_ids) == 8 and set(comp.token_ids) <= ({7, 301} if params.logit_bias else set(allowed))
    for bad in ([], [-1], "7"):
        with pytest.raises(ValueError, match="allowed_token_ids must be"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="allowed_token_ids holds token id 9999"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[9999]), use_tqdm=False)


def test_seed_minus_one_is_no_seed_and_llm_seed_none_draws_one(llm: LLM, model_dir: Path) -> None:
    params = SamplingParams(temperature=1.0, seed=-1, max_tokens=12, ignore_eos=True)
    assert params.seed is None
    samples = {tuple(llm.generate("abc", params, use_tqdm=False)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(samples) > 1
    unseeded = LLM(str(model_dir), seed=None, **ENGINE)
    assert isinstance(unseeded.engine.config.options.seed, int)
    with pytest.raises(ValueError, match="seed must be None or an integer"):
        LLM(str(model_dir), seed="7", **ENGINE)


def test_each_logprobs_dict_starts_with_the_chosen_token(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=1.5, seed=1, max_tokens=8, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    comp = out.outputs[0]
    assert comp.logprobs is not None and out.prompt_logprobs is not None
    assert any(d[t].rank != 1 for t, d in zip(comp.token_ids, comp.logprobs))  # some not the most likely
    for t, d in zip(comp.token_ids, comp.logprobs):
        assert next(iter(d)) == t and [v.rank for v in list(d.values())[1:]] == sorted(v.rank for v in
                                                                                        list(d.values())[1:])
    for t, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert d is not None and next(iter(d)) == t


def vllm_beam_search(hf: transformers.PreTrainedModel, prompt: list[int], width: int, max_tokens: int,
                     eos: int) -> list[tuple[list[int], float]]:
    """vLLM's LLM.beam_search: each live beam's top 2 * width next tokens are candidates; one ending
    in EOS is complete whatever its rank; the others compete for the width live beams; at the end
    completed and live beams, best first, by cum_logprob / length (EOS not counted)."""

    def score(beam: tuple[list[int], float]) -> float:
        return beam[1] / (len(beam[0]) - (beam[0][-1] == eos))

    beams: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    completed: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        grown = []
        for tokens, cum in beams:
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].double(), -1)
            top = torch.topk(lp, 2 * width)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                (completed if t == eos else grown).append((tokens + [t], cum + v))
        beams = sorted(grown, key=score, reverse=True)[:width]
    return sorted(completed + beams, key=score, reverse=True)[:width]


def test_beam_search_chooses_beams_as_vllm(model_dir: Path, tmp_path: Path) -> None:
    """On a model whose EOS is often a candidate without being the best (its LM head row scaled), a
    completed beam takes no live beam's place and EOS candidates of any rank complete."""
    path = tmp_path / "eos_heavy"
    shutil.copytree(model_dir, path)
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"][0] *= 4.0
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(path), **ENGINE)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    eos = llm.get_tokenizer().eos_token_id
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 512) for _ in range(6)] for _ in range(6)]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=6))
    ends_early = 0
    for prompt, out in zip(prompts, outs):
        expected = vllm_beam_search(hf, prompt, 3, 6, eos)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in expected]
        for s, (_, cum) in zip(out.sequences, expected):
            assert s.cum_logprob == pytest.approx(cum, abs=1e-3)
        ends_early += sum(len(s.tokens) < len(prompt) + 6 for s in out.sequences)
    assert ends_early >= 3  # the EOS rule was exercised
    # The beams' text skips special tokens (EOS here) unless skip_special_tokens=False (vLLM's field).
    decode = llm.get_tokenizer().decode
    i = next(i for i, out in enumerate(outs) if any(s.tokens[-1] == eos for s in out.sequences))
    kept = llm.beam_search([{"prompt_token_ids": prompts[i]}],
                           BeamSearchParams(beam_width=3, max_tokens=6, skip_special_tokens=False))[0]
    assert [s.text for s in outs[i].sequences] == [decode(s.tokens, skip_special_tokens=True)
                                                   for s in outs[i].sequences]
    assert [s.text for s in kept.sequences] == [decode(s.tokens) for s in kept.sequences]
    assert [s.text for s in kept.sequences] != [s.text for s in outs[i].sequences]


def test_beam_search_scores_raw_logprobs_whatever_the_temperature(llm: LLM) -> None:
    """vLLM's beam search scores the model's raw logprobs (its temperature changes nothing); each
    step's logprobs entry is that step's 2 * beam_width candidates, ranked from 1; prompts run
    concurrency_limit at a time with the same result."""
    prompts = [{"prompt_token_ids": [11, 12, 13, 14]}, {"prompt_token_ids": [21, 22, 23]}]
    cold = llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    hot = llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True, temperature=0.5),
                          use_tqdm=False, concurrency_limit=1)
    for a, b in zip(cold, hot):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for s, t in zip(a.sequences, b.sequences):
            assert s.cum_logprob == pytest.approx(t.cum_logprob, abs=1e-6)
            generated = s.tokens[len(s.tokens) - len(s.logprobs):]
            assert s.cum_logprob == pytest.approx(sum(e[tok].logprob for tok, e in zip(generated, s.logprobs)),
                                                  abs=1e-5)
            for entry in s.logprobs:
                assert len(entry) == 4 and sorted(lp.rank for lp in entry.values()) == [1, 2, 3, 4]
                values = [lp.logprob for lp in sorted(entry.values(), key=lambda lp: lp.rank)]
                assert values == sorted(values, reverse=True)


# bad_words ---------------------------------------------------------------------------------------

def sequences(llm: LLM, words: list[str]) -> list[list[int]]:
    params = SamplingParams(bad_words=words)
    params.update_from_tokenizer(llm.get_tokenizer())
    assert params.bad_words_token_ids is not None
    return params.bad_words_token_ids


def reference(model_dir: Path, prompt: list[int], banned: list[list[int]], max_new: int) -> list[int]:
    """Greedy decoding over transformers' logits, each step masking the last token of every
    sequence whose other tokens end the output so far (vLLM's _apply_bad_words_single_batch)."""
    model = hf_model(str(model_dir))
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
            for seq in banned:
                if len(seq) - 1 <= len(out) and out[len(out) - len(seq) + 1:] == seq[:-1]:
                    logits[seq[-1]] = float("-inf")
            token = int(torch.argmax(logits))
            ids.append(token)
            out.append(token)
    return out


def contains(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i:i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def words_at(llm: LLM, tokens: list[int], width: int) -> list[tuple[int, str]]:
    """(i, text) where tokens[i:i + width] decode to a word that encodes back to those tokens."""
    tok = llm.get_tokenizer()
    found = []
    for i in range(2, len(tokens) - width):
        text = tok.decode(tokens[i:i + width])
        if text.strip() and text == text.lstrip() and tok.encode(text, add_special_tokens=False) == tokens[i:i + width]:
            found.append((i, text))
    return found


def words_from(llm: LLM, tokens: list[int], width: int) -> list[str]:
    return [text for _, text in words_at(llm, tokens, width)]


def test_words_tokenize_as_vllm(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    word = next(w for w in ("world", "hello", "this", "is")
                if len(tok.encode(" " + w, add_special_tokens=False)) == len(tok.encode(w, add_special_tokens=False))
                and tok.encode(" " + w, add_special_tokens=False)[0] != tok.encode(w, add_special_tokens=False)[0])
    plain, spaced = tok.encode(word, add_special_tokens=False), tok.encode(" " + word, add_special_tokens=False)
    # Leading spaces are stripped first; a word given twice counts once.
    assert sequences(llm, ["  " + word, "  " + word]) == [plain, spaced]
    # A spaced form of another length is not a word start of its own: left out (vLLM's rule).
    long = next(w for w in ("hello world", "xqzv", "zzqq", "qqq")
                if len(tok.encode(" " + w, add_special_tokens=False)) != len(tok.encode(w, add_special_tokens=False)))
    assert sequences(llm, [long]) == [tok.encode(long, add_special_tokens=False)]


@pytest.mark.parametrize("words, match", [
    (["ok", ""], "bad_words"), (["ok", 3], "bad_words"), ("ok", "bad_words must be a list"),
    (["\ud800"], "bad_words"),
])
def test_malformed_bad_words_are_named(words: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(bad_words=words)  # type: ignore[arg-type]


def test_a_word_of_no_tokens_is_refused_at_admission(llm: LLM) -> None:
    with pytest.raises(ValueError, match="no tokens"):
        llm.generate(PROMPT, SamplingParams(bad_words=["   "]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_greedy_output_avoids_the_words_as_the_reference(llm: LLM, model_dir: Path) -> None:
    prompt = llm.get_tokenizer().encode(PROMPT)
    base = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    ones, twos = words_from(llm, base, 1), words_from(llm, base, 2)
    assert ones and twos, "the output holds words of one and two tokens"
    for words in ([ones[0]], [twos[0]], [ones[-1], twos[-1]]):
        banned = sequences(llm, words)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=words)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
        assert out == reference(model_dir, prompt, banned, 24)
        assert out != base and not any(contains(out, seq) for seq in banned)
    assert params.bad_words_token_ids is None  # the caller's params stay as given


def test_the_prompt_does_not_count(llm: LLM, model_dir: Path) -> None:
    """A two-token word whose first token ends the prompt: its second is still allowed first."""
    prompt = llm.get_tokenizer().encode(PROMPT)
    base = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    i, word = words_at(llm, base, 2)[0]
    longer = prompt + base[:i + 1]  # ends with the word's first token; greedy goes on with its second
    banned = sequences(llm, [word])
    assert banned[0] == base[i:i + 2]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word])
    out = llm.generate({"prompt_token_ids": longer}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert out[0] == base[i + 1] and out == reference(model_dir, longer, banned, 8)


def test_every_sample_of_n_avoids_the_words(llm: LLM) -> None:
    free = llm.generate(PROMPT, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs
    words = sorted({w for o in free for w in words_from(llm, o.token_ids, 1)})[:3]
    assert words
    banned = sequences(llm, words)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, bad_words=words)
    outs = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs
    for o in outs:
        assert not any(contains(o.token_ids, seq) for seq in banned)


def test_speculative_decoding_gives_the_same_tokens(llm: LLM, model_dir: Path) -> None:
    prompt = llm.get_tokenizer().encode(PROMPT * 3)
    base = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    words = words_from(llm, base, 2)[:2] + words_from(llm, base, 1)[:1]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=words)
    expected = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM(str(model_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3}, **ENGINE)
    out = spec.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == expected == reference(model_dir, prompt, sequences(llm, words), 24)


# A SentencePiece-style tokenizer (Llama 2 / Mistral: `▁` spaces, `<0xNN>` byte fallback) -------------

@pytest.fixture(scope="module")
def sp_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    from test_detokenizer import _sp_tokenizer

    from nanovllm.builtin_model import TinyModelSpec, build_hf_model

    path = tmp_path_factory.mktemp("sentencepiece")
    tok = _sp_tokenizer()
    tok.save_pretrained(path)
    build_hf_model(TinyModelSpec(arch="LlamaForCausalLM", vocab_size=len(tok), head_dim=16, seed=5),
                   eos_token_id=tok.eos_token_id).save_pretrained(path, safe_serialization=True)
    return LLM(str(path), **ENGINE)


def test_an_output_continues_its_prompts_text_as_vllm_decodes_it(sp_llm: LLM) -> None:
    """vLLM decodes an output after its prompt: a SentencePiece output keeps its first token's
    leading space (decoded alone, Strip would drop it), and a stop string written with that space
    matches there."""
    tok = sp_llm.get_tokenizer()
    prompt = tok.encode("world cat", add_special_tokens=False)
    hello = tok.convert_tokens_to_ids("▁hello▁")
    out = sp_llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2,
                          allowed_token_ids=[hello]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [hello, hello]
    assert out.text == tok.decode(prompt + [hello, hello])[len(tok.decode(prompt)):] == " hello  hello "
    stopped = sp_llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4,
                              stop=[" hello"], allowed_token_ids=[hello]), use_tqdm=False)[0].outputs[0]
    assert stopped.text == "" and stopped.token_ids == [hello] and stopped.stop_reason == " hello"


def test_a_stop_string_that_only_the_end_completes_is_a_stop(sp_llm: LLM) -> None:
    """A run of byte tokens decodes when it closes (ByteFallback decodes a run as a whole); one the
    output's end closes can still complete a stop string: finish_reason "stop", not "length"."""
    a = sp_llm.get_tokenizer().convert_tokens_to_ids("<0x41>")
    out = sp_llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, stop=["AA"], allowed_token_ids=[a]),
                          use_tqdm=False)[0].outputs[0]
    assert out.text == "" and out.finish_reason == "stop" and out.stop_reason == "AA"


def test_logprob_strings_of_a_characters_parts_as_vllm(sp_llm: LLM) -> None:
    """vLLM's logprob strings of byte-fallback tokens: "" while a character is unfinished, the
    whole character on its last byte (from the sequence's 4 tokens before it: its earlier output
    tokens; for a prompt's, the prompt tokens after the first), as test_detokenizer's oracle."""
    from test_detokenizer import vllm_corrected, vllm_token_string

    tok = sp_llm.get_tokenizer()
    sigma = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "∑".encode()]
    prompt = tok.encode("a ∑ b", add_special_tokens=False)
    assert set(sigma) <= set(prompt)
    # The grammar makes the output the character's bytes in order, three times.
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=1,
                            allowed_token_ids=[*sigma, tok.eos_token_id],
                            structured_outputs=StructuredOutputsParams(regex="∑{3}"))
    out = sp_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]

    def expected(token: int, context: list[int]) -> str:
        text = vllm_token_string(tok, token)
        return vllm_corrected(tok, token, context[-4:]) if text.endswith("\ufffd") else text

    got = out.outputs[0]
    assert got.text == "∑∑∑" and got.finish_reason == "stop" and got.logprobs is not None
    for j, entry in enumerate(got.logprobs):
        for token, lp in entry.items():
            assert lp.decoded_token == expected(token, got.token_ids[:j]), (j, token)
    assert [e[t].decoded_token for t, e in zip(got.token_ids, got.logprobs)][:9] == ["", "", "∑"] * 3
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for p, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None
        for token, lp in entry.items():
            assert lp.decoded_token == expected(token, prompt[1:p]), (p, token)
    assert [out.prompt_logprobs[p][t].decoded_token for p, t in enumerate(prompt) if t in sigma] == ["", "", "∑"]


def test_num_cached_tokens_counts_the_prompts_prefix_cache_hits(model_dir: Path) -> None:
    """vLLM's RequestOutput.num_cached_tokens: the prompt tokens the prefix cache held when the
    request was first scheduled (whole blocks; never the prompt's last token, which is computed)."""
    llm = LLM(str(model_dir), **ENGINE)
    prompt = {"prompt_token_ids": list(range(1, 71))}  # 70 tokens: 4 whole blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
    again = llm.generate([prompt, {"prompt_token_ids": list(range(1, 40))}], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [64, 32]
    n = llm.generate(prompt, SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=2), use_tqdm=False)[0]
    assert n.num_cached_tokens == 64 and len(n.outputs) == 3
    off = LLM(str(model_dir), enable_prefix_caching=False, **ENGINE)
    off.generate(prompt, params, use_tqdm=False)
    assert off.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0


def test_sampling_params_lists_as_vllm() -> None:
    """vLLM's SamplingParams keeps stop as a list ([] for none, a lone string its entry) and None
    bad_words as [], and reads `stop` when a request is added (an assignment after construction
    counts)."""
    assert SamplingParams().stop == [] and SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"] and SamplingParams().bad_words == []
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    params.stop = ["\x00never"]
    assert params.stop_strings == ["\x00never"]
    params.stop = "x"
    assert params.stop_strings == ["x"]


def test_stop_assigned_after_construction_stops(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip() and stop in text
    params.stop = [stop]
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[:text.index(stop)]


def test_engine_options_as_vllm_passes_them(model_dir: Path) -> None:
    """vLLM's None for max_num_seqs, enable_prefix_caching and enable_chunked_prefill is its
    default (prefix caching on); its names of options (num_gpu_blocks_override) are taken."""
    llm = LLM(str(model_dir), device="cpu", num_gpu_blocks_override=40, max_model_len=512, block_size=16,
              max_num_seqs=None, enable_prefix_caching=None, enable_chunked_prefill=None)
    assert llm.stats()["num_total_blocks"] == 40
    prompt = {"prompt_token_ids": list(range(1, 40))}
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 32
    with pytest.raises(TypeError, match="both num_kvcache_blocks and its other name num_gpu_blocks_override"):
        LLM(str(model_dir), device="cpu", num_gpu_blocks_override=40, num_kvcache_blocks=40)


def test_what_this_engine_does_not_do_says_so(llm: LLM) -> None:
    """vLLM's prompt fields for multimodal input, embeddings and cache isolation are refused, not
    dropped; its LLM methods for pooling, sleep mode, profiling and worker calls raise
    NotImplementedError naming the reason."""
    for key, value in (("multi_modal_data", {"image": object()}), ("mm_processor_kwargs", {"x": 1}),
                       ("cache_salt", "tenant-a"), ("prompt_embeds", object())):
        for prompt in ({"prompt": "hello", key: value}, {"prompt_token_ids": [1, 2], key: value}):
            with pytest.raises(ValueError, match=f"a prompt's '{key}' is not supported"):
                llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.generate({"prompt": "hello", "multi_modal_data": None}, SamplingParams(max_tokens=1),
                        use_tqdm=False)[0].outputs[0].token_ids
    for name in ("encode", "embed", "classify", "score", "sleep", "wake_up", "start_profile", "stop_profile",
                 "collective_rpc", "apply_model", "get_metrics"):
        with pytest.raises(NotImplementedError, match=rf"LLM\.{name}\(\) is not supported: "):
            getattr(llm, name)("x")
    assert llm.reset_prefix_cache(reset_running_requests=True, reset_connector=False) is True
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_unfinished_character_at_the_end_is_dropped(llm: LLM, stream: bool) -> None:
    """vLLM's text never ends in U+FFFD (its decoder holds a step whose text does): an output cut
    inside a character by max_tokens ends before it, where tokenizer.decode would end in U+FFFD;
    text that follows such bytes releases them (as U+FFFD, in the middle)."""
    from nanovllm.token_table import bytes_to_unicode

    tok = llm.get_tokenizer()
    lead, tail = (tok.convert_tokens_to_ids(bytes_to_unicode()[b]) for b in (0xE6, 0x97))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, allowed_token_ids=[lead])
    if stream:
        llm.engine.add_request("cut", PROMPT, params, stream=True)
        deltas = [o.outputs[0].text for _ in range(10) for o in llm.engine.step()]
        assert deltas and all(d == "" for d in deltas)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [lead] * 3 and out.text == "" and tok.decode(out.token_ids) == "\ufffd" * 3
    mixed = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                allowed_token_ids=[lead, tail]), use_tqdm=False)[0].outputs[0]
    assert mixed.text == tok.decode(mixed.token_ids).rstrip("\ufffd")


def test_a_request_keeps_the_params_it_was_admitted_with(llm: LLM) -> None:
    """As vLLM's processor copies them: params changed after add_request change neither the request
    nor its later n > 1 samples (each forks at the first step), and a bad value assigned before
    admission is refused there, leaving the engine clean."""
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=8, ignore_eos=True)
    engine.add_request("kept", PROMPT, params)
    params.stop = [""]  # invalid, and after admission: no effect
    outs = [o for _ in range(20) for o in engine.step()]
    assert [(c.finish_reason, c.stop_reason, len(c.token_ids)) for c in outs[-1].outputs] == [("length", None, 8)] * 3
    with pytest.raises(ValueError, match="stop must be"):
        llm.generate(PROMPT, params, use_tqdm=False)
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"] and not engine.has_unfinished_requests()
