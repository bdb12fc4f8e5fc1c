"""Decode tokens/s of a checkpoint in bf16 and quantized at load (int8, int4), the variants taking
turns request by request in one process.

On a shared VM the host's speed drifts by tens of percent within minutes, so a ratio between
variants timed one after the other (as roofline.py's rows are) can be off by that much. Here every
variant is loaded once, then each round sends the same prompt to each variant in turn (the order
reversed every other round) and times its decode steps; a variant's figure is its median over the
rounds, and the ratios are taken between those medians, all from the same run.

Usage:
    python benchmarks/make_bench_model.py /tmp/qwen3-cpu --shape qwen3-cpu
    python benchmarks/quant_decode.py --model /tmp/qwen3-cpu [--variants bf16,int8,int4] [--batch 1]
        [--rounds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench_report import machine, markdown_table, write_json

from nanovllm import LLM, SamplingParams


def decode_ms(llm: LLM, prompts: list[list[int]], output_len: int) -> float:
    """Milliseconds per decode step of `prompts` run together: the first step (their prefill, one
    step as the token budget holds them all) is not timed."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    engine.step()
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return 1000 * (time.perf_counter() - start) / max(steps, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a bf16 (or fp32) checkpoint, e.g. make_bench_model.py's qwen3-cpu")
    p.add_argument("--variants", default="bf16,int8,int4")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    llms = {v: LLM(args.model, dtype="bfloat16", quantization=None if v == "bf16" else v,
                   max_num_seqs=args.batch, max_model_len=args.prompt_len + args.output_len + 16,
                   max_num_batched_tokens=max(args.batch * args.prompt_len, 2048),
                   kv_cache_memory_bytes=1 << 29) for v in variants}
    rng = random.Random(0)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        prompts = [[rng.randrange(4000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
        for v in variants if r % 2 == 0 else variants[::-1]:
            times[v].append(decode_ms(llms[v], prompts, args.output_len))
    medians = {v: statistics.median(ts) for v, ts in times.items()}
    base = medians.get("bf16", next(iter(medians.values())))
    rows = [{"variant": v, "step ms (median)": f"{m:.2f}", "range": f"{min(times[v]):.2f}-{max(times[v]):.2f}",
             "tok/s": f"{1000 * args.batch / m:.1f}", "x bf16": f"{base / m:.2f}"} for v, m in medians.items()]
    print(f"{args.model}, batch {args.batch}, prompts of {args.prompt_len}, {args.output_len} outputs, "
          f"{args.rounds} rounds; {torch.get_num_threads()} threads, {machine()}")
    print(markdown_table(rows, ["variant", "step ms (median)", "range", "tok/s", "x bf16"]))
    if args.json is not None:
        write_json(args.json, {"machine": machine(), "threads": torch.get_num_threads(), "batch": args.batch,
                               "step_ms": times, "median_ms": medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
