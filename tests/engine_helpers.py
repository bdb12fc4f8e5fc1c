"""Shared pieces of the engine tests: tiny models on disk and transformers as the oracle."""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import transformers

if TYPE_CHECKING:
    from nanovllm import LLM

GreedyOracle = Callable[[Path, list[int], int, int | None], list[int]]


@lru_cache(maxsize=None)
def hf_model(path: str) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return model.eval()


@lru_cache(maxsize=None)
def _hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int, eos: int | None) -> tuple[int, ...]:
    with torch.no_grad():
        out = hf_model(path).generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos if eos is not None else 0,
        )
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """transformers' greedy continuation, stopping after `eos` like our engine does."""
    return list(_hf_greedy(str(path), tuple(prompt), max_new_tokens, eos))


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def assert_greedy_matches(llm: LLM, path: Path, prompts: list[list[int]], max_new: int,
                          oracle: GreedyOracle = hf_greedy) -> None:
    """Our greedy output equals the oracle's for every prompt, and no KV block is left allocated."""
    from nanovllm import SamplingParams

    eos = llm.get_tokenizer().eos_token_id
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == oracle(path, prompt, max_new, eos), f"prompt of {len(prompt)} diverged"
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"


def apply_pending_changes(llm: LLM) -> None:
    """The runner drops finished sequences' sampling state with the next plan (docs/design.md, The
    step): apply what the scheduler holds for it now, as the next step would, so a test can check
    that nothing is left behind."""
    from nanovllm.worker.step import SchedulerOutput

    scheduler = llm.engine.scheduler
    sampler = llm.engine.executor.runner.token_sampler
    assert not scheduler._admitted, "requests admitted but never scheduled"
    sampler.apply(SchedulerOutput(None, finished=scheduler._finished, forked=scheduler._forked))  # type: ignore[arg-type]
    scheduler._finished, scheduler._forked = [], []


def assert_greedy_matches_with_preemption_and_prefix_cache(llm: LLM, path: Path) -> None:
    """Greedy output equals the oracle's (1) for 6 prompts of 50-80 tokens plus 40 generated, which
    preempt in an engine whose pool is 24 blocks of 16 (and chunk under a 48-token budget), and (2)
    for prompts sharing a 70-token system prompt, whose 4 full blocks the later two read from the
    prefix cache."""
    vocab = llm.engine.vocab_size
    assert_greedy_matches(llm, path, random_prompts([60, 70, 80, 50, 65, 75], vocab, seed=9), max_new=40)
    assert llm.stats()["num_preemptions"] > 0
    system = random_prompts([70], vocab, seed=5)[0]
    tails = random_prompts([3, 9, 20], vocab, seed=6)
    assert_greedy_matches(llm, path, [system + tails[0]], max_new=8)
    hits = llm.stats()["prefix_cache_hits"]
    assert_greedy_matches(llm, path, [system + t for t in tails[1:]], max_new=8)
    assert llm.stats()["prefix_cache_hits"] - hits >= 2 * 64
