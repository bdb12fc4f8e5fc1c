"""Throughput: nanovllm on the workload of nano-vllm's bench, optionally against transformers.

The workload (`nanovllm.entrypoints.bench.make_workload`): `--num-seqs` sequences whose prompts
are random token ids with lengths uniform in [min_len, max_input_len], output lengths uniform in
[min_len, max_output_len] (min_len 100 by default, as in nano-vllm), EOS ignored, temperature
sampling at 0.6. All requests are submitted at once and the engine schedules them with at most
`--max-num-seqs` running.

`--compare-hf` also times Hugging Face transformers' `generate` on the same prompts: static
batches of `--max-num-seqs` prompts in workload order, left padded with an attention mask, each
batch decoding exactly its longest output length (min_new_tokens = max_new_tokens, i.e. EOS
ignored) with the same sampling. Both run in this process, so they use the same
torch.get_num_threads(), the same dtype and device, and each gets a warm-up call before timing.

What is counted: tok/s is OUTPUT tokens per second of wall time for the whole workload (prefill
time included, prompt tokens not counted). Both sides count the same tokens: each sequence's own
output length, whose sum is the workload's. transformers also decodes surplus tokens for the
shorter requests of a batch (up to the batch's longest), and pads prompts; those are reported
(`hf.generated_tokens`, `hf.padded_prompt_tokens`) but not counted.

Usage: python benchmarks/throughput.py [--compare-hf] [--json PATH] [--num-seqs N] ...
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from bench_report import cpu_busy_seconds, cpu_model, write_json

from nanovllm.builtin_model import ensure_default_model
from nanovllm.entrypoints.bench import (
    DEFAULT_TEMPERATURE,
    BenchResult,
    HFBenchResult,
    load_hf_model,
    make_workload,
    run_engine,
    run_hf,
)
from nanovllm.llm import LLM

# The target on the 2-core dev CPU with the built-in model.
TARGET_RATIO = 3.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a Hugging Face model directory (default: the built-in model)")
    # nano-vllm's lengths; N scaled down from its 256 so the CPU comparison takes minutes, not an hour.
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--min-len", type=int, default=100,
                   help="lower bound of both length ranges (nano-vllm's bench uses 100)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="the engine's max running sequences, and transformers' static batch size")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="0 = greedy on both sides")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (GPU)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engine's max_model_len (default: the model's max_position_embeddings)")
    p.add_argument("--compare-hf", action="store_true", help="also time transformers' generate")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--seed", type=int, default=0, help="workload and engine seed")
    p.add_argument("--no-tqdm", action="store_true")
    args = p.parse_args(argv)
    for name in ("num_seqs", "max_input_len", "max_output_len", "min_len", "max_num_seqs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


@dataclass
class OtherCpu:
    """CPU seconds that processes other than this one used while a block ran (None where
    /proc/stat is unavailable). On a 2-core machine anything else running distorts the timing,
    badly so for OpenMP threads that spin-wait on a shared core; this makes it visible."""

    seconds: float | None = None


def _own_s() -> float:
    t = os.times()
    return t.user + t.system


@contextmanager
def other_cpu() -> Iterator[OtherCpu]:
    result = OtherCpu()
    busy0, own0 = cpu_busy_seconds(), _own_s()
    yield result
    busy = cpu_busy_seconds()
    if busy is not None and busy0 is not None:
        result.seconds = max(0.0, (busy - busy0) - (_own_s() - own0))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _side(r: BenchResult) -> dict[str, Any]:
    d: dict[str, Any] = {
        "seconds": r.seconds,
        "output_tokens": r.output_tokens,
        "prompt_tokens": r.prompt_tokens,
        "tok_s": r.output_tok_s,
        "total_tok_s": r.total_tok_s,
    }
    if isinstance(r, HFBenchResult):
        d.update(generated_tokens=r.generated_tokens, padded_prompt_tokens=r.padded_prompt_tokens,
                 num_batches=r.num_batches)
    return d


def print_table(engine: BenchResult, hf: HFBenchResult | None) -> None:
    print("\ntok/s = output tokens / wall seconds for the whole workload; each side counts every "
          "sequence's own output length (the workload's total), nothing else.")
    print("| runner | output tok/s | seconds | tokens counted | tokens generated |")
    print("|---|---:|---:|---:|---:|")
    print(f"| nanovllm | {engine.output_tok_s:.1f} | {engine.seconds:.2f} | {engine.output_tokens} "
          f"| {engine.output_tokens} |")
    if hf is not None:
        print(f"| transformers generate | {hf.output_tok_s:.1f} | {hf.seconds:.2f} | {hf.output_tokens} "
              f"| {hf.generated_tokens} |")
        ratio = engine.output_tok_s / hf.output_tok_s
        verdict = "meets" if ratio >= TARGET_RATIO else "misses"
        print(f"| ratio nanovllm / transformers | {ratio:.2f}x | | | |")
        print(f"\n{verdict} the {TARGET_RATIO:g}x target")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or str(ensure_default_model())
    llm = LLM(model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=args.seed, device=args.device,
              enforce_eager=args.enforce_eager, max_model_len=args.max_model_len)
    device, dtype = llm.engine.device, llm.engine.executor.runner.dtype
    workload = make_workload(args.num_seqs, args.max_input_len, args.max_output_len, llm.engine.vocab_size,
                             seed=args.seed, min_len=args.min_len)
    lo_in, lo_out = min(args.min_len, args.max_input_len), min(args.min_len, args.max_output_len)
    threads = torch.get_num_threads()
    print(f"model: {model}\ndevice: {device}, dtype: {_dtype_name(dtype)}, torch {torch.__version__} "
          f"({threads} threads), transformers {transformers.__version__}, cpu: {cpu_model()}\n"
          f"workload: {args.num_seqs} sequences, input [{lo_in}, {args.max_input_len}], output "
          f"[{lo_out}, {args.max_output_len}] ({workload.num_prompt_tokens} prompt, "
          f"{workload.num_output_tokens} output tokens), max_num_seqs {args.max_num_seqs}, "
          f"temperature {args.temperature}")

    llm_graphs = getattr(llm.engine.executor.runner, "graphs", None) is not None
    with other_cpu() as engine_cpu:
        engine = run_engine(llm, workload, use_tqdm=not args.no_tqdm, temperature=args.temperature)
    engine_other = engine_cpu.seconds
    hf: HFBenchResult | None = None
    hf_other: float | None = None
    if args.compare_hf:
        # Release the engine (weights, KV cache) first so transformers runs on an idle machine.
        del llm
        hf_model = load_hf_model(model, dtype, device)
        # Same thread count on both sides (loading a model must not have changed it).
        torch.set_num_threads(threads)
        with other_cpu() as hf_cpu:
            hf = run_hf(hf_model, workload, args.max_num_seqs, use_tqdm=not args.no_tqdm,
                        temperature=args.temperature)
        hf_other = hf_cpu.seconds
        if hf.output_tokens != workload.num_output_tokens:
            raise RuntimeError(f"counted {hf.output_tokens} transformers tokens, "
                               f"the workload has {workload.num_output_tokens}")
    print_table(engine, hf)
    runs = [("nanovllm", engine_other, engine.seconds)]
    if hf is not None:
        runs.append(("transformers", hf_other, hf.seconds))
    for name, other, seconds in runs:
        # Other work worth more than 5% of one core means the timing shared the CPUs.
        if other is not None and other > 0.05 * seconds:
            print(f"warning: other processes used {other:.1f} CPU-seconds during the {seconds:.1f} s "
                  f"{name} run; its timing is contaminated, rerun on an idle machine")

    if args.json is not None:
        ratio = engine.output_tok_s / hf.output_tok_s if hf is not None else None
        record = {
            "engine_tok_s": engine.output_tok_s,
            "hf_tok_s": hf.output_tok_s if hf is not None else None,
            "ratio": ratio,
            "target_ratio": TARGET_RATIO,
            "engine_seconds": engine.seconds,
            "hf_seconds": hf.seconds if hf is not None else None,
            "counted": "output tokens: each sequence's own output length, on both sides",
            "num_seqs": args.num_seqs,
            "min_len": args.min_len,
            "max_input_len": args.max_input_len,
            "max_output_len": args.max_output_len,
            "max_num_seqs": args.max_num_seqs,
            "workload_prompt_tokens": workload.num_prompt_tokens,
            "workload_output_tokens": workload.num_output_tokens,
            "temperature": args.temperature,
            "seed": args.seed,
            "enforce_eager": args.enforce_eager,
            "cuda_graphs": llm_graphs,
            "max_model_len": args.max_model_len,
            "device": str(device),
            "dtype": _dtype_name(dtype),
            "threads": threads,
            "other_cpu_s": {"engine": engine_other, "hf": hf_other},
            "model": model,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "cpu": cpu_model(),
            "engine": _side(engine),
            "hf": _side(hf) if hf is not None else None,
        }
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
