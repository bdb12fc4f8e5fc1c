"""Tensor parallelism on CPU (gloo, 2 ranks) against transformers and against one rank: the
sharded layers for three dense model shapes and two mixtures of experts, the engine's scheduling features through the step channel,
faults, and what a shut-down engine leaves behind (nothing)."""

from __future__ import annotations

import os
import signal
import socket
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import assert_greedy_matches_with_preemption_and_prefix_cache, hf_greedy, random_prompts
from tp_helpers import alive, children, make_tp_model, shm_segments

from nanovllm import LLM, SamplingParams
from nanovllm.distributed import WorkerDiedError
from nanovllm.sampling_params import BeamSearchParams

BLOCK = 16
# A pool of 24 blocks for 6 prompts of 50-80 tokens plus 40 generated forces preemption; a token
# budget of 48 chunks every prompt.
ENGINE = dict(device="cpu", block_size=BLOCK, num_kvcache_blocks=24, max_model_len=24 * BLOCK, max_num_seqs=6,
              max_num_batched_tokens=48)


def make_llm(path: Path, tp: int, **kwargs: object) -> LLM:
    return LLM(str(path), tensor_parallel_size=tp, **{**ENGINE, **kwargs})  # type: ignore[arg-type]


# The mixtures of experts split every expert's intermediate dimension (one all-reduce per layer).
@pytest.fixture(scope="module", params=["qwen3", "qwen2_odd_vocab", "llama_mqa_tied", "qwen3_moe_tp", "mixtral_wide"])
def tp_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, LLM]]:
    path = make_tp_model(tmp_path_factory.mktemp("tp"), request.param)
    llm = make_llm(path, 2)
    assert llm.engine.executor.runner.tp is not None and llm.engine.executor.runner.tp.backend == "gloo"  # the CPU default
    pids = llm.engine.executor.worker_pids
    assert len(pids) == 1 and alive(pids[0])
    assert shm_segments() == []  # unlinked once attached (here: not yet created, before the first step)
    yield path, llm
    llm.engine.shutdown()
    assert not any(alive(p) for p in pids), "a worker outlived the engine"
    assert shm_segments() == [], "the step ring's segment was left in /dev/shm"


def test_greedy_matches_transformers_with_chunking_preemption_and_prefix_cache(tp_case: tuple[Path, LLM]) -> None:
    path, llm = tp_case
    assert_greedy_matches_with_preemption_and_prefix_cache(llm, path)
    assert shm_segments() == []  # the ring exists now, its name is gone


def test_parallel_sampling_beam_search_and_prompt_logprobs_match_one_rank(tp_case: tuple[Path, LLM]) -> None:
    """Copy-on-write block copies (n > 1 and beams fork shared blocks) run on every rank; prompt
    logprobs take logits at rows other than the sampled ones."""
    path, llm = tp_case
    ref = make_llm(path, 1)
    prompts = random_prompts([21, 40], llm.engine.vocab_size, seed=3)
    sampled = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12, prompt_logprobs=2)
    for got, want in zip(llm.generate(prompts, sampled, use_tqdm=False), ref.generate(prompts, sampled, use_tqdm=False)):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert [sorted(p) if p else p for p in got.prompt_logprobs] == [sorted(p) if p else p for p in want.prompt_logprobs]
    beams = BeamSearchParams(beam_width=3, max_tokens=10)
    got_b, want_b = llm.beam_search(prompts, beams), ref.beam_search(prompts, beams)
    for g, w in zip(got_b, want_b):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        for gs, ws in zip(g.sequences, w.sequences):
            assert gs.cum_logprob == pytest.approx(ws.cum_logprob, abs=1e-4)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_abort_mid_generation(tp_case: tuple[Path, LLM]) -> None:
    path, llm = tp_case
    engine = llm.engine
    prompts = random_prompts([30, 33], engine.vocab_size, seed=4)
    params = SamplingParams(temperature=0, max_tokens=20)
    engine.add_request("keep", prompts[0], params)
    engine.add_request("drop", prompts[1], params)
    for _ in range(3):
        engine.step()
    engine.abort_request("drop")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["keep"]
    eos = llm.get_tokenizer().eos_token_id
    assert outs[0].outputs[0].token_ids == hf_greedy(path, prompts[0], 20, eos)


def test_tp_size_must_divide_the_heads(tmp_path: Path) -> None:
    path = make_tp_model(tmp_path, "qwen3")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the number of attention heads \(4\)"):
        make_llm(path, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        make_llm(path, 0)


def test_a_killed_worker_fails_the_engine_promptly_and_leaves_nothing(tmp_path: Path) -> None:
    path = make_tp_model(tmp_path, "qwen3")
    llm = make_llm(path, 2)
    engine = llm.engine
    [pid] = engine.executor.worker_pids
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    engine.step()
    engine.step()
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    with pytest.raises(WorkerDiedError):  # and every later step too, at once
        engine.add_request("s", [4, 5], SamplingParams(max_tokens=3))
        engine.step()
    engine.shutdown()
    assert not alive(pid) and shm_segments() == []


@pytest.mark.parametrize("tp", [1, 2])
def test_a_dropped_llm_stops_its_workers_and_frees_its_model(tmp_path: Path, tp: int) -> None:
    """Dropping the last reference to an LLM releases it at once (no collection needed; the startup
    heap is frozen out of the cyclic GC): its workers stop, its runner (model, KV cache) is freed.
    A worker watcher or a runner hook holding the executor strongly kept both for good."""
    path = make_tp_model(tmp_path, "qwen3")
    llm = make_llm(path, tp)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    pids = llm.engine.executor.worker_pids if tp > 1 else []
    runner = weakref.ref(llm.engine.executor.runner)
    del llm
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert runner() is None
    assert not any(alive(p) for p in pids) and shm_segments() == []


def test_a_taken_master_port_is_named_and_the_worker_stopped(tmp_path: Path) -> None:
    path = make_tp_model(tmp_path, "qwen3")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        before = set(children(os.getpid()))
        with pytest.raises(OSError, match=f"master_port {port} on 127.0.0.1 is in use"):
            make_llm(path, 2, master_port=port)
    deadline = time.monotonic() + 15
    while set(children(os.getpid())) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(children(os.getpid())) - before


def test_an_interrupted_step_fails_every_later_one(tmp_path: Path) -> None:
    """A KeyboardInterrupt inside a step the workers are running leaves the ranks out of step: every
    later step fails at once, naming the interrupt, instead of pairing stale collectives (a 60 s
    hang, then a dead worker)."""
    path = make_tp_model(tmp_path, "qwen3")
    llm = make_llm(path, 2)
    engine = llm.engine
    [pid] = engine.executor.worker_pids
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))

    def interrupted(so: object) -> None:
        raise KeyboardInterrupt

    engine.executor.runner.execute = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="a step was interrupted"):
        engine.step()
    assert time.monotonic() - start < 5
    engine.shutdown()
    assert not alive(pid) and shm_segments() == []


def test_a_gloo_transport_error_counts_as_a_lost_peer() -> None:
    """gloo reports a peer that went away as a plain RuntimeError, not always a DistError; the
    runner must still fail the engine (WorkerDiedError), not treat it as one failed step (seen
    as a 500 and a server that kept running when a worker was killed)."""
    from nanovllm.executor.multiproc_executor import _is_collective_failure

    gone = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:36741. This is typically caused by a remote worker crashing.")
    assert _is_collective_failure(RuntimeError(gone))
    assert not _is_collective_failure(RuntimeError("the prompt is too long"))
    assert not _is_collective_failure(ValueError("connection closed by peer"))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_over_two_ranks(tmp_path: Path, method: str) -> None:
    """Rows of 1 + k tokens through the step channel (drafts in the plan's inputs, every position's
    logits gathered from both ranks; a draft model on rank 0 alone): the one-rank engine's tokens."""
    path = make_tp_model(tmp_path, "qwen3")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2} \
        if method == "ngram" else {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    prompts = [p * 3 for p in random_prompts([5, 9, 13], 512, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = make_llm(path, 2, speculative_config=spec)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats()["spec_num_accepted_tokens"] > 0
    finally:
        llm.engine.shutdown()
    assert got == [o.outputs[0].token_ids for o in make_llm(path, 1).generate(prompts, params, use_tqdm=False)]
