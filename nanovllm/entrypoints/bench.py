"""The throughput workload of nano-vllm's bench: N sequences of random token ids, prompt lengths
uniform in [100, max_input], output lengths uniform in [100, max_output], EOS ignored.

`run_engine` times nanovllm on it; `run_hf` times Hugging Face transformers' `generate` on the
same prompts (static, left-padded batches), counting the same tokens, as the baseline.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

# The bench samples (rather than decodes greedily) like nano-vllm's original bench did.
DEFAULT_TEMPERATURE = 0.6


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
                  min_len: int = 100, min_output_len: int | None = None) -> Workload:
    """`min_len` bounds both ranges from below unless `min_output_len` gives the output's own."""
    rng = random.Random(seed)
    top = min(vocab_size, 10_000)
    min_out = min_len if min_output_len is None else min_output_len
    prompts = [[rng.randrange(top) for _ in range(rng.randint(min(min_len, max_input), max_input))]
               for _ in range(num_seqs)]
    outputs = [rng.randint(min(min_out, max_output), max_output) for _ in range(num_seqs)]
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


def run_engine(llm: LLM, workload: Workload, use_tqdm: bool = True,
               temperature: float = DEFAULT_TEMPERATURE) -> BenchResult:
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n) for n in workload.output_lens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=use_tqdm)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(f"engine produced {produced} tokens, the workload asks for {workload.num_output_tokens}")
    return BenchResult(seconds, workload.num_prompt_tokens, produced)


@dataclass(frozen=True)
class HFBenchResult(BenchResult):
    """`output_tokens` counts, like the engine, only each sequence's own output length. A static
    batch decodes every row to the batch's longest output, and pads prompts to its longest prompt;
    `generated_tokens` and `padded_prompt_tokens` are what the model actually processed."""

    generated_tokens: int
    padded_prompt_tokens: int
    num_batches: int


def load_hf_model(model_dir: str, dtype: torch.dtype, device: torch.device) -> Any:
    """transformers' own model class for `model_dir`, in eval mode, on `device` in `dtype`."""
    import transformers
    from transformers import AutoModelForCausalLM

    # transformers renamed `torch_dtype` to `dtype` in 4.56; the old name only warns since.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    # Any: transformers' decorated `to` confuses type checkers.
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, **{dtype_kw: dtype})
    return model.to(device).eval()


def _left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding keeps every row's last prompt token in the last column, where generate()
    appends; the attention mask (and the position ids generate derives from it) hides the pads."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _hf_sampling_kwargs(temperature: float) -> dict[str, Any]:
    """The engine's sampling in generate()'s terms: plain temperature sampling, no top-k/top-p
    (generation configs may default top_k to 50, which our SamplingParams would not do)."""
    if temperature <= 0.0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def run_hf(model: Any, workload: Workload, batch_size: int, use_tqdm: bool = True,
           temperature: float = DEFAULT_TEMPERATURE) -> HFBenchResult:
    """Times `model.generate` over the workload in order, `batch_size` prompts per static batch.

    Each batch decodes exactly the longest output length it contains (min_new_tokens =
    max_new_tokens suppresses EOS, the equivalent of the engine's ignore_eos); shorter requests'
    surplus tokens are generated but not counted.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        pad_id = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    sampling = _hf_sampling_kwargs(temperature)
    batches = [range(i, min(i + batch_size, len(workload.prompts)))
               for i in range(0, len(workload.prompts), batch_size)]

    def generate(prompts: list[list[int]], new_tokens: int) -> int:
        ids, mask = _left_padded(prompts, pad_id, device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=pad_id, **sampling)
        produced = out.shape[1] - ids.shape[1]
        if produced != new_tokens:
            raise RuntimeError(f"transformers generated {produced} tokens per row, asked for {new_tokens}")
        return ids.numel()

    with torch.inference_mode():
        # Warm-up: the first calls pay one-off costs (kernel selection, allocator growth) the
        # engine's own warm-up in run_engine also keeps out of its timing.
        generate([p[:16] for p in workload.prompts[:2]], 4)
        counted = generated = padded = 0
        bar = tqdm(total=len(workload.prompts), desc="transformers generate", disable=not use_tqdm,
                   dynamic_ncols=True)
        start = time.perf_counter()
        for rows in batches:
            lens = [workload.output_lens[i] for i in rows]
            padded += generate([workload.prompts[i] for i in rows], max(lens))
            counted += sum(lens)
            generated += len(lens) * max(lens)
            bar.update(len(rows))
        seconds = time.perf_counter() - start
        bar.close()
    return HFBenchResult(seconds, workload.num_prompt_tokens, counted, generated, padded, len(batches))
