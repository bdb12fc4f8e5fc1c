"""Every sampling path on the device that decodes, against the C++ CPU sampler and a CPU engine.

On a GPU these run on CUDA (scripts/gpu_check.sh runs them): the torch sampling backend against the
C++ kernels on the same logits, the engine's features (penalties, logit bias, min_tokens,
logprobs, prompt logprobs, structured output, n > 1, beam search) against a CPU engine, seeded
rows eager against CUDA graphs, bf16 logprobs against transformers' bf16, and a sync audit: decode
steps of mixed sampling parameters under `torch.cuda.set_sync_debug_mode("error")`, where any
host-device synchronization but the step's one wait for its tokens (an event, nanovllm.staging)
raises.

Where no GPU is, the same checks run on the CPU with the engine's sampler switched to the torch
backend, the code CUDA takes, so the checks themselves run in CI; the CUDA-only ones skip.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from engine_helpers import random_prompts
from test_models_sampler import reference_distribution

from nanovllm import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from nanovllm.builtin_model import TinyModelSpec, create_model_dir
from nanovllm.sample import Sampler, make_sampling_batch
from nanovllm.cpu import sampler as cpu_sampler

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
VOCAB = 512
ENGINE = dict(dtype="float32", block_size=16, num_kvcache_blocks=128, max_model_len=512, max_num_seqs=16)
# Greedy tokens of two fp32 engines on different devices agree while the top-2 logit margin is
# above rounding (~1e-6 relative); compare up to the first position closer than this.
MARGIN = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 32 with q/k norm: a decode-kernel head size, and Qwen3's code path.
    return create_model_dir(tmp_path_factory.mktemp("sampling_cuda") / "qwen3",
                            spec=TinyModelSpec(arch="Qwen3ForCausalLM", head_dim=32, seed=21))


def device_llm(model_dir: Path, device: str, **kwargs: object) -> LLM:
    """An engine on `device`; on the CPU its sampler takes the torch path (the one CUDA runs)."""
    llm = LLM(str(model_dir), device=device, **{**ENGINE, **kwargs})  # type: ignore[arg-type]
    if device == "cpu":
        llm.engine.executor.runner.token_sampler.sampler = Sampler("torch")
    return llm


@pytest.fixture(scope="module")
def cpu_llm(model_dir: Path) -> LLM:
    """The oracle: the CPU engine with the C++ sampler."""
    return LLM(str(model_dir), device="cpu", **ENGINE)  # type: ignore[arg-type]


def assert_pool_whole(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"


# The sampler alone ------------------------------------------------------------------------------


def random_logits(rows: int, vocab: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[::7, 5] = logits[::7].max(dim=1).values  # ties for the maximum: the first one wins
    return logits.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_equals_the_cpu_kernels(device: str) -> None:
    logits = random_logits(64, 4099, seed=1, device=device)
    got = Sampler("torch")(logits, make_sampling_batch([0.0] * 64))
    want = cpu_sampler.argmax(logits.cpu().contiguous())
    np.testing.assert_array_equal(got.cpu().numpy(), want)
    assert got.device.type == device


FILTER_ROWS = [  # temperature, top_k, top_p, min_p
    (1.0, 5, 1.0, 0.0), (0.7, 0, 0.6, 0.0), (1.3, 0, 1.0, 0.2), (1.0, 20, 0.7, 0.05), (0.9, 0, 0.9, 0.1),
    (0.0, 0, 1.0, 0.0),
]


@pytest.mark.parametrize("device", DEVICES)
def test_filters_never_leave_their_support(device: str) -> None:
    """Every draw of every filtered row lies where the float64 reference gives it probability."""
    vocab = 300
    logits = random_logits(len(FILTER_ROWS), vocab, seed=2, device=device)
    reps = 200
    batch = make_sampling_batch([r[0] for r in FILTER_ROWS] * reps, top_k=[r[1] for r in FILTER_ROWS] * reps,
                                top_p=[r[2] for r in FILTER_ROWS] * reps, min_p=[r[3] for r in FILTER_ROWS] * reps)
    torch.manual_seed(3)
    tokens = Sampler("torch")(logits.repeat(reps, 1), batch).cpu().view(reps, len(FILTER_ROWS))
    host = logits.cpu()
    for j, (temp, k, p, m) in enumerate(FILTER_ROWS):
        drawn = set(tokens[:, j].tolist())
        if temp == 0.0:
            assert drawn == {int(host[j].argmax())}
            continue
        support = set(torch.nonzero(reference_distribution(host[j], temp, k, p, m) > 0).flatten().tolist())
        assert drawn <= support, (FILTER_ROWS[j], sorted(drawn - support))
        assert len(drawn) > 1 or len(support) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_do_not_depend_on_the_batch(device: str) -> None:
    """A seeded row draws the same tokens alone and among other rows (seeded or not, any filter)."""
    logits = random_logits(5, 1000, seed=4, device=device)
    sampler = Sampler("torch")

    def run(rows: list[int], steps: int = 6) -> list[list[int]]:
        gens = {r: torch.Generator(device=device).manual_seed(100 + r) for r in rows if r in (0, 3)}
        out = []
        for _ in range(steps):
            params = [FILTER_ROWS[r % len(FILTER_ROWS)] for r in rows]
            batch = make_sampling_batch([p[0] or 1.0 for p in params], top_k=[p[1] for p in params],
                                        top_p=[p[2] for p in params], min_p=[p[3] for p in params],
                                        generators=[gens.get(r) for r in rows])
            out.append(sampler(logits[rows], batch).tolist())
        return out

    together = run([0, 1, 2, 3, 4])
    alone = {r: run([r]) for r in (0, 3)}
    for r in (0, 3):
        assert [step[r] for step in together] == [step[0] for step in alone[r]]


# The engine's features ---------------------------------------------------------------------------


def agreeing_prefix(tokens: list[int], logprobs: list[dict]) -> int:
    """How many leading tokens of a CPU run another device must reproduce: up to and including
    the first whose top-2 logprob margin is within rounding of a tie."""
    for i, entry in enumerate(logprobs):
        top = sorted((lp.logprob for lp in entry.values()), reverse=True)
        if len(top) > 1 and top[0] - top[1] < MARGIN:
            return i + 1
    return len(tokens)


FEATURES = {
    "penalties": dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
    "logit_bias": dict(logit_bias={7: 4.0, 11: -100.0, 300: 2.5}),
    "min_tokens": dict(min_tokens=10),
    "plain": dict(),
}


@pytest.mark.parametrize("device", DEVICES)
def test_features_agree_with_the_cpu_engine(device: str, model_dir: Path, cpu_llm: LLM) -> None:
    """Greedy with penalties, logit bias, min_tokens, and logprobs of every token (and of the
    prompt): the same tokens as the CPU engine and logprobs within fp32 rounding of its."""
    llm = device_llm(model_dir, device)
    eos = llm.get_tokenizer().eos_token_id
    prompts = random_prompts([5, 23, 40, 17], VOCAB, seed=7)
    params = [SamplingParams(temperature=0, max_tokens=16, logprobs=4, prompt_logprobs=2, **kw)
              for kw in FEATURES.values()]
    got = llm.generate(prompts, params, use_tqdm=False)
    want = cpu_llm.generate(prompts, params, use_tqdm=False)
    for name, g, w in zip(FEATURES, got, want):
        gc, wc = g.outputs[0], w.outputs[0]
        n = agreeing_prefix(wc.token_ids, wc.logprobs)
        assert gc.token_ids[:n] == wc.token_ids[:n], name
        for tok, ge, we in zip(wc.token_ids[:n], gc.logprobs[:n], wc.logprobs[:n]):
            assert ge[tok].logprob == pytest.approx(we[tok].logprob, abs=2e-4), name
            for t in set(ge) & set(we):
                assert ge[t].logprob == pytest.approx(we[t].logprob, abs=2e-4), name
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
        for ge, we in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            common = set(ge) & set(we)
            assert common, name
            for tok in common:
                assert ge[tok].logprob == pytest.approx(we[tok].logprob, abs=2e-4), name
    logit_bias_out = got[1].outputs[0].token_ids
    assert 11 not in logit_bias_out
    min_tokens_out = got[2].outputs[0].token_ids
    assert eos not in min_tokens_out[:10]
    assert_pool_whole(llm)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("device", DEVICES)
def test_structured_output_is_valid_and_masked_on_the_device(device: str, model_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    import xgrammar

    masked_on: set[str] = set()
    apply = xgrammar.apply_token_bitmask_inplace

    def spy(logits: torch.Tensor, bitmask: torch.Tensor, **kw: object) -> None:
        masked_on.add(logits.device.type)
        assert bitmask.device == logits.device
        apply(logits, bitmask, **kw)

    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace", spy)
    llm = device_llm(model_dir, device)
    params = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)))
    out = llm.generate(["x"], params, use_tqdm=False)[0]
    assert masked_on == {device}
    assert len(out.outputs) == 3
    for c in out.outputs:
        if c.finish_reason == "length":
            continue  # cut off mid-object: nothing to validate
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert any(c.finish_reason == "stop" for c in out.outputs)
    assert_pool_whole(llm)


@pytest.mark.parametrize("device", DEVICES)
def test_parallel_samples_and_beam_search(device: str, model_dir: Path, cpu_llm: LLM) -> None:
    llm = device_llm(model_dir, device)
    prompt = random_prompts([12], VOCAB, seed=8)[0]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(n=4, temperature=1.0, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    samples = [c.token_ids for c in out.outputs]
    assert len(samples) == 4 and all(len(s) == 12 for s in samples) and len({tuple(s) for s in samples}) > 1
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    got = llm.beam_search([{"prompt_token_ids": prompt}], params)[0].sequences
    want = cpu_llm.beam_search([{"prompt_token_ids": prompt}], params)[0].sequences
    scores = [s.cum_logprob for s in want]
    assert [s.cum_logprob for s in got] == pytest.approx(scores, abs=1e-3)
    if all(a - b > MARGIN for a, b in zip(scores, scores[1:])):  # no two beams within rounding
        assert [s.tokens for s in got] == [s.tokens for s in want]
    assert_pool_whole(llm)


# CUDA only ----------------------------------------------------------------------------------------


@needs_cuda
def test_seeded_sampling_equal_eager_and_cuda_graphs(model_dir: Path) -> None:
    prompts = random_prompts([4, 9, 30, 15, 2], VOCAB, seed=9)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=k, min_p=m, seed=40 + i, max_tokens=20,
                             ignore_eos=True) for i, (k, m) in enumerate([(0, 0.0), (50, 0.0), (0, 0.05), (8, 0.1),
                                                                          (0, 0.0)])]
    runs = []
    for eager in (True, False):
        llm = device_llm(model_dir, "cuda", enforce_eager=eager)
        assert (llm.engine.executor.runner.graphs is None) == eager
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    assert runs[0] == runs[1]


@needs_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_logprobs_match_transformers_bf16(head_dim: int, tmp_path: Path) -> None:
    """Prompt logprobs (the prefill path) and the logprobs of greedy decodes (the decode kernel)
    in bf16 against transformers' bf16 forward over the same tokens: our error against the fp32
    forward stays within twice theirs."""
    path = create_model_dir(tmp_path / f"hd{head_dim}", spec=TinyModelSpec(
        arch="Qwen3ForCausalLM", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        seed=30 + head_dim))
    llm = LLM(str(path), device="cuda", dtype="bfloat16", block_size=16, num_kvcache_blocks=64, max_model_len=512)
    prompt = random_prompts([37], VOCAB, seed=10)[0]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0),
                       use_tqdm=False)[0]
    tokens = prompt + out.outputs[0].token_ids
    ours = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    ours += [e[t].logprob for e, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    ref = {}
    for dtype in (torch.bfloat16, torch.float32):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=dtype).to("cuda").eval()
        with torch.no_grad():
            logits = hf(torch.tensor([tokens], device="cuda")).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        ref[dtype] = [float(lp[i - 1, tokens[i]]) for i in range(1, len(tokens))]
    ours_err = np.abs(np.array(ours) - np.array(ref[torch.float32]))
    hf_err = np.abs(np.array(ref[torch.bfloat16]) - np.array(ref[torch.float32]))
    assert ours_err.max() <= 2 * hf_err.max() + 0.02, (ours_err.max(), hf_err.max())


@needs_cuda
def test_sync_audit_decode_steps_wait_only_for_their_tokens(model_dir: Path) -> None:
    """Decode steps with every sampling feature at once, under sync debug mode "error": a
    pageable copy, `.item()`, `.cpu()`, `nonzero` or a size read back from the device raises."""
    llm = device_llm(model_dir, "cuda")
    engine = llm.engine
    assert engine.executor.runner.graphs is not None
    schema = StructuredOutputsParams(json=json.dumps(SCHEMA))
    mixes = [
        dict(temperature=0), dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=20),
        dict(temperature=0.7, min_p=0.1, seed=1), dict(temperature=0, repetition_penalty=1.2, presence_penalty=0.3,
                                                       frequency_penalty=0.2),
        dict(temperature=0.9, logit_bias={3: 2.0, 9: -5.0}), dict(temperature=0, min_tokens=6),
        dict(temperature=0.6, logprobs=3), dict(temperature=1.0, n=3, seed=4), dict(temperature=0.5, structured_outputs=schema),
    ]
    for i, (kw, prompt) in enumerate(zip(mixes, random_prompts([6, 11, 3, 25, 8, 14, 5, 9, 12, 7], VOCAB, seed=11))):
        params = SamplingParams(max_tokens=24, ignore_eos=True, **kw)
        grammar = engine.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params, grammar=grammar)
    engine.step()  # the prefill (one step: every prompt fits the token budget)
    engine.step()  # n = 3 fans out: its children join from here on
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_whole(llm)
