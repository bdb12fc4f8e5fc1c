"""LLM.generate end to end against transformers (the oracle), with every scheduling feature of
the core at work: chunked prefill, prefix caching, preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import hf_greedy, random_prompts
from tiny_models import make_tiny_model

from nanovllm import LLM, SamplingParams

BLOCK = 16
LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 300]
MAX_NEW = 24
VOCAB = 512


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def arch_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("engine"), request.param)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("engine"), "qwen3")


def make_llm(path: Path, **kwargs: object) -> LLM:
    kwargs.setdefault("num_kvcache_blocks", 256)
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("max_model_len", 1024)
    return LLM(str(path), device="cpu", **kwargs)


def check_against_hf(llm: LLM, path: Path, prompts: list[list[int]], max_new: int = MAX_NEW) -> None:
    eos = llm.get_tokenizer().eos_token_id
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(path, prompt, max_new, eos)
        got = out.outputs[0].token_ids
        assert got == expected, f"prompt of {len(prompt)} tokens diverged"
        assert out.finished
        assert out.outputs[0].finish_reason == ("stop" if got[-1] == eos else "length")
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"


def test_greedy_matches_transformers(arch_dir: Path) -> None:
    llm = make_llm(arch_dir)
    check_against_hf(llm, arch_dir, random_prompts(LENGTHS, VOCAB, seed=1))


@pytest.mark.parametrize("block_size", [48, 128])
def test_larger_blocks_match_transformers(qwen3_dir: Path, block_size: int) -> None:
    """vLLM's CPU default block size (128) and one that 16 divides into three: the CPU attention walks
    them 16 rows at a time, prefill chunks end inside blocks, and the longest prompt decodes alone
    at the end, its keys cut into parts that end inside blocks."""
    llm = make_llm(qwen3_dir, block_size=block_size, num_kvcache_blocks=64, max_num_batched_tokens=100)
    check_against_hf(llm, qwen3_dir, random_prompts([1, 15, 130, 300], VOCAB, seed=3), max_new=40)


def test_tiny_token_budget_chunks_prefill_among_decodes(qwen3_dir: Path) -> None:
    llm = make_llm(qwen3_dir, max_num_batched_tokens=7, max_num_seqs=3)
    check_against_hf(llm, qwen3_dir, random_prompts(LENGTHS, VOCAB, seed=1))


def test_shared_system_prompt_hits_prefix_cache(qwen3_dir: Path) -> None:
    llm = make_llm(qwen3_dir)
    system = random_prompts([70], VOCAB, seed=5)[0]
    first = [system + tail for tail in random_prompts([3, 9], VOCAB, seed=6)]
    check_against_hf(llm, qwen3_dir, first)
    hits_before = llm.stats()["prefix_cache_hits"]
    second = [system + tail for tail in random_prompts([1, 20, 33], VOCAB, seed=7)]
    check_against_hf(llm, qwen3_dir, second)
    stats = llm.stats()
    # Each later prompt reuses the system prompt's 4 full blocks (64 tokens).
    assert stats["prefix_cache_hits"] - hits_before >= 3 * 64
    assert stats["prefix_cache_queries"] > stats["prefix_cache_hits"]


def test_reset_prefix_cache_forgets_prefixes_only_when_idle(qwen3_dir: Path) -> None:
    llm = make_llm(qwen3_dir)
    prompt = random_prompts([70], VOCAB, seed=8)[0]
    check_against_hf(llm, qwen3_dir, [prompt])
    assert llm.stats()["num_cached_blocks"] > 0
    # A running request holds blocks: no reset (the cache stays as it was).
    llm.engine.add_request("running", prompt, SamplingParams(max_tokens=4))
    llm.engine.step()
    cached = llm.stats()["num_cached_blocks"]
    assert llm.reset_prefix_cache() is False and llm.stats()["num_cached_blocks"] == cached
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache() is True
    assert llm.stats()["num_cached_blocks"] == 0
    hits = llm.stats()["prefix_cache_hits"]
    check_against_hf(llm, qwen3_dir, [prompt])  # computed again, still right
    assert llm.stats()["prefix_cache_hits"] == hits


def test_multi_turn_reuses_generated_history(qwen3_dir: Path) -> None:
    llm = make_llm(qwen3_dir)
    prompt = random_prompts([20], VOCAB, seed=8)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    history = prompt + out.outputs[0].token_ids
    before = llm.stats()["prefix_cache_hits"]
    check_against_hf(llm, qwen3_dir, [history + [7, 8, 9]])
    assert llm.stats()["prefix_cache_hits"] - before >= 48  # 3 full blocks of the 60 computed tokens


def test_preemption_under_a_small_pool(qwen3_dir: Path) -> None:
    # 6 prompts that need ~7 blocks each at the end share a pool of 24 blocks (which holds one
    # sequence of max_model_len, as the engine requires).
    llm = make_llm(qwen3_dir, num_kvcache_blocks=24, max_model_len=24 * BLOCK, max_num_seqs=6)
    prompts = random_prompts([60, 70, 80, 50, 65, 75], VOCAB, seed=9)
    check_against_hf(llm, qwen3_dir, prompts, max_new=40)
    assert llm.stats()["num_preemptions"] > 0


def test_preemption_without_prefix_caching(qwen3_dir: Path) -> None:
    llm = make_llm(qwen3_dir, num_kvcache_blocks=24, max_model_len=24 * BLOCK, max_num_seqs=6,
                   enable_prefix_caching=False)
    prompts = random_prompts([60, 70, 80, 50, 65, 75], VOCAB, seed=9)
    check_against_hf(llm, qwen3_dir, prompts, max_new=40)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] == 0


def test_text_prompt_tokenized_like_the_tokenizer(qwen3_dir: Path) -> None:
    llm = make_llm(qwen3_dir)
    tok = llm.get_tokenizer()
    text = "The quick brown fox, naturally."
    out = llm.generate(text, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert out.prompt == text
    assert out.prompt_token_ids == tok.encode(text)
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    via_dict = llm.generate({"prompt": text}, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert via_dict.outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_uses_the_chat_template(qwen3_dir: Path) -> None:
    llm = make_llm(qwen3_dir)
    conv = [{"role": "user", "content": "hello there"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = list(expected["input_ids"])
    assert out.prompt_token_ids == expected
    two = llm.chat([conv, conv], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [out.outputs[0].token_ids] * 2


def test_finish_reasons_and_metrics(qwen3_dir: Path) -> None:
    llm = make_llm(qwen3_dir)
    prompt = random_prompts([12], VOCAB, seed=3)[0]
    free_run = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    tokens = free_run.outputs[0].token_ids
    assert len(tokens) == 8 and free_run.outputs[0].finish_reason == "length"
    stop_at = tokens[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                stop_token_ids=[stop_at]), use_tqdm=False)[0]
    first = tokens.index(stop_at)
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_at)
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_seeded_sampling_is_reproducible_whatever_the_batch(qwen3_dir: Path) -> None:
    llm = make_llm(qwen3_dir)
    prompt = random_prompts([10], VOCAB, seed=4)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts([5, 30, 17], VOCAB, seed=11)
    mixed = llm.generate(
        others + [prompt], [SamplingParams(temperature=0.8, max_tokens=12)] * 3 + [seeded], use_tqdm=False
    )
    assert mixed[-1].outputs[0].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_bad_input_rejected_and_engine_keeps_serving(qwen3_dir: Path) -> None:
    llm = make_llm(qwen3_dir, max_model_len=64)
    good = random_prompts([5], VOCAB, seed=2)[0]
    with pytest.raises(ValueError, match="empty"):
        llm.generate([good, []], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate([good, [1] * 65], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([good, [1, VOCAB]], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):  # checked before penalty rows index it
        llm.generate([good, [1, VOCAB]], SamplingParams(presence_penalty=0.5, seed=3), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([good, 3.5], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([good, good], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([good, good], SamplingParams(logit_bias={VOCAB: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([good], SamplingParams(stop_token_ids=[VOCAB + 3]), use_tqdm=False)
    # An id past int64 is reported as given (it used to read -1).
    with pytest.raises(ValueError, match=rf"prompt_token_ids\[1\] = {2**63} is outside the vocabulary"):
        llm.generate([good, [1, 2**63]], use_tqdm=False)
    with pytest.raises(ValueError, match="got NoneType"):
        llm.generate(None, use_tqdm=False)  # type: ignore[arg-type]
    # bytes would otherwise pass as a list of token ids.
    with pytest.raises(ValueError, match="got bytes"):
        llm.generate(b"bytes", use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lone surrogate"):
        llm.generate(["fine", "a\ud800"], use_tqdm=False)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_requests"] == 0 and stats["num_waiting"] == 0
    assert len(llm.engine.detokenizer) == 0  # no half-registered request left on the text side
    out = llm.generate([good], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
     ("max_tokens", 0), ("min_tokens", -1), ("seed", 1.5), ("n", 0), ("stop_token_ids", [-1]),
     ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
     ("logprobs", -2), ("prompt_logprobs", -2), ("stop", [""]), ("stop", 5), ("logit_bias", {1: float("nan")}),
     ("logit_bias", {1: float("inf")}), ("logit_bias", {1: 1e39}), ("logit_bias", {"x": 1.0}),
     ("truncation_side", "middle"), ("spaces_between_special_tokens", False), ("output_kind", 2), ("extra_args", [1]),
     ("skip_special_tokens", 1), ("temperature", float("nan")),
     ("stop", ["\ud800"]), ("top_k", 2**63), ("seed", 2**64), ("seed", -(2**63) - 1)],
)
def test_invalid_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_seed_range_ends_are_accepted(qwen3_dir: Path) -> None:
    llm = make_llm(qwen3_dir, max_model_len=64)
    for seed in (2**64 - 1, -(2**63)):
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, seed=seed, max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


def test_pool_smaller_than_max_model_len_is_refused(qwen3_dir: Path) -> None:
    """A pool that cannot hold one sequence of max_model_len would cut long requests at its size
    (finish_reason "length"); the engine refuses it, saying what to change."""
    with pytest.raises(ValueError) as e:
        make_llm(qwen3_dir, num_kvcache_blocks=8, max_model_len=512)
    message = str(e.value)
    assert "max_model_len=512" in message and "8 blocks of 16 tokens = 128 tokens" in message
    assert "lower max_model_len to at most 128" in message and "num_kvcache_blocks" in message
    # Exactly one sequence's worth is enough, and such a sequence runs to max_model_len.
    llm = make_llm(qwen3_dir, num_kvcache_blocks=4, max_model_len=64)
    out = llm.generate([list(range(3, 63))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_model_directory_errors_name_the_file(tmp_path: Path, qwen3_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"), device="cpu")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(empty), device="cpu")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    for f in qwen3_dir.iterdir():  # everything but the weights
        if f.suffix != ".safetensors":
            (no_weights / f.name).write_bytes(f.read_bytes())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(no_weights), device="cpu")
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for f in qwen3_dir.iterdir():
        data = f.read_bytes()
        if f.suffix == ".safetensors":
            data = data[: len(data) // 2]
        (truncated / f.name).write_bytes(data)
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        LLM(str(truncated), device="cpu")


def test_unsupported_architecture_lists_supported(tmp_path: Path, qwen3_dir: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    for f in qwen3_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    cfg = (other / "config.json").read_text().replace("Qwen3ForCausalLM", "GPT2LMHeadModel")
    (other / "config.json").write_text(cfg)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(other), device="cpu")
