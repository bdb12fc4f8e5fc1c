"""Host-side cost of a decode step, per sampling mode, with a null model.

The model is as small as a model can be (1 layer, hidden 32, vocab 512), so a step's time is
almost all host work: scheduling, sampling, logits processing, token bookkeeping, detokenization
and outputs. Every scenario runs through `LLM.generate`; a timer around `ModelRunner.forward` and
the LM head (`ModelRunner.logits`, or `ModelRunner.greedy` in all-greedy steps) separates the model
from the rest:

    step_us     median wall time of `LLMEngine.step()` over the decode-only steps at full batch
    forward_us  median time inside the model (forward + logits) in those steps
    host_us     step_us - forward_us

Prompts share all but their last block, so prefill is cheap through the prefix cache and every
scenario still has the full context (128 or 2048 tokens) in its sequences' token lists (what
penalties read). `extra_us` is host_us minus greedy's host_us at the same N and context.

Usage: python benchmarks/step_overhead.py [--num-seqs 64 256 1024] [--contexts 128 2048]
           [--modes greedy top_p_top_k ...] [--steps 24] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_report import CallClock, machine, markdown_table, write_json  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.builtin_model import TinyModelSpec, create_model_dir  # noqa: E402

NULL_SPEC = TinyModelSpec(
    arch="Qwen3ForCausalLM", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=8192, seed=7,
)
BLOCK_SIZE = 16

MODES: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0),
    "top_p_top_k": dict(temperature=0.8, top_p=0.9, top_k=50),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "min_p": dict(temperature=0.8, min_p=0.05),
    "logprobs": dict(temperature=0.0, logprobs=5),
    "penalties": dict(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
    "logit_bias": dict(temperature=0.0, logit_bias={t: -1.0 for t in range(5, 45)}),
    "stop_strings": dict(temperature=0.0, stop=["</answer>", "\n\n\n"]),
    "n4": dict(temperature=0.8, n=4),
}


def forward_clock(runner: Any) -> CallClock:
    """A clock of the runner's model calls: the forward, and the LM head as the token sampler calls it
    (for logits, or for an all-greedy step's tokens)."""
    sampler = runner.token_sampler
    return CallClock([(runner, "forward"), (sampler, "_logits")] + ([(sampler, "_greedy")] if sampler._greedy else []))


def run_scenario(llm: LLM, num_seqs: int, context: int, mode: str, steps: int) -> dict[str, Any]:
    engine = llm.engine
    timer = forward_clock(engine.executor.runner)
    try:
        opts = dict(MODES[mode])
        n = opts.get("n", 1)
        num_prompts = max(1, num_seqs // n)
        prompt_len = context - steps - 4
        shared = [(7 * i) % 400 + 50 for i in range(prompt_len - 1)]
        prompts = [shared + [60 + i % 400] for i in range(num_prompts)]
        params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, seed=None, **opts)
        llm.generate([shared + [1]], SamplingParams(max_tokens=1), use_tqdm=False)  # fill the prefix cache
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        step_times, forward_times = [], []
        while engine.has_unfinished_requests():
            timer.seconds = 0.0
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            plan = engine.scheduler.core.plan
            if plan.num_prefill_tokens == 0 and plan.num_seqs == num_prompts * n:
                step_times.append(dt)
                forward_times.append(timer.seconds)
    finally:
        timer.restore()
    if len(step_times) < 4:
        raise RuntimeError(f"only {len(step_times)} full decode steps measured for {mode} N={num_seqs}")
    step_us = statistics.median(step_times) * 1e6
    forward_us = statistics.median(forward_times) * 1e6
    return dict(mode=mode, num_seqs=num_prompts * n, context=context, steps=len(step_times),
                step_us=round(step_us, 1), forward_us=round(forward_us, 1), host_us=round(step_us - forward_us, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--steps", type=int, default=24, help="decode steps per scenario")
    ap.add_argument("--model", type=str, default=None, help="model directory (default: the null model)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(create_model_dir(Path(tmp) / "null", spec=NULL_SPEC))
        max_len = max(args.contexts) + 8
        max_seqs = max(args.num_seqs)
        llm = LLM(model, dtype="float32", max_model_len=max_len, max_num_seqs=max_seqs, block_size=BLOCK_SIZE,
                  max_num_batched_tokens=max(8192, max_len + max_seqs),
                  kv_cache_memory_bytes=max_seqs * (max_len + BLOCK_SIZE) * 2 * 16 * 4 * 2)
        rows = []
        for num_seqs in args.num_seqs:
            for context in args.contexts:
                greedy_host = None
                for mode in args.modes:
                    row = run_scenario(llm, num_seqs, context, mode, args.steps)
                    if mode == "greedy":
                        greedy_host = row["host_us"]
                    row["extra_us"] = None if greedy_host is None else round(row["host_us"] - greedy_host, 1)
                    rows.append(row)
                    print(row, flush=True)
    print()
    print(machine())
    print(markdown_table(rows, ["mode", "num_seqs", "context", "steps", "step_us", "forward_us", "host_us",
                                "extra_us"]))
    if args.json:
        write_json(args.json, {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
