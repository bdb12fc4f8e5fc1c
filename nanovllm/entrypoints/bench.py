"""The throughput workload of nano-vllm's bench: N sequences of random token ids, prompt lengths
uniform in [100, max_input], output lengths uniform in [100, max_output], EOS ignored."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(num_seqs: int, max_input: int, max_output: int, vocab_size: int, seed: int = 0,
                  min_len: int = 100) -> Workload:
    rng = random.Random(seed)
    top = min(vocab_size, 10_000)
    prompts = [[rng.randrange(top) for _ in range(rng.randint(min(min_len, max_input), max_input))]
               for _ in range(num_seqs)]
    outputs = [rng.randint(min(min_len, max_output), max_output) for _ in range(num_seqs)]
    return Workload(prompts, outputs)


@dataclass(frozen=True)
class BenchResult:
    seconds: float
    prompt_tokens: int
    output_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def run_engine(llm: LLM, workload: Workload, use_tqdm: bool = True) -> BenchResult:
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in workload.output_lens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=use_tqdm)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(f"engine produced {produced} tokens, the workload asks for {workload.num_output_tokens}")
    return BenchResult(seconds, workload.num_prompt_tokens, produced)
