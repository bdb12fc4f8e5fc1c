"""Shared pieces of the engine tests: tiny models on disk and transformers as the oracle."""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

import torch
import transformers


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
