"""One decode step at batch 256 on the GPU, next to the scheduler's CPU time for that step.

The engine's per-step loop, minus text: `schedule()` (C++) -> runner.forward (plan copy, CUDA
graph replay or eager forward) -> logits at the sampled rows -> greedy token ids -> `.cpu()` (the
step's one synchronization) -> `postprocess()` (C++). Every sequence is already decoding at
`--context` tokens (its prompt was scheduled through the core without running the model: the
cache holds zeros, which costs the attention kernel exactly as much as real values).

Reported (medians over the timed steps):
- gpu_ms: CUDA-event time from just before the forward to just after the token ids are ready;
- sched_us: CPU time in schedule() + postprocess(), what the core costs per step;
- host_us: CPU time of the runner's part (plan copy, launches) up to the synchronization;
- sched / gpu: the target is under 5%.

Usage: python benchmarks/decode_step.py --model DIR [--batch 256] [--context 1024] [--enforce-eager]
       [--sched-json sched_overhead.json] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench_report import write_json

TARGET_FRACTION = 0.05


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory (benchmarks/make_bench_model.py)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024, help="context length of every sequence")
    p.add_argument("--steps", type=int, default=100, help="timed decode steps (after 10 warm-up)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--sched-json", type=Path, default=None,
                   help="benchmarks/sched_overhead.py --json output: show its decode row beside this one")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from nanovllm import _C
    from nanovllm.attention.metadata import HostSeqLens
    from nanovllm.config import EngineConfig
    from nanovllm.worker.model_runner import ModelRunner

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    warm = 10
    budget = max(8192, args.batch)
    # The prompts pass through the core in at most batch * context / (budget - batch) steps (each
    # step's decodes take part of the budget), and a sequence whose prompt is done decodes in each
    # later one: leave room for those tokens too, or the first sequences finish before the timed
    # steps end.
    prefill_steps = -(-args.batch * (args.context - 1) // max(1, budget - args.batch)) + 1
    max_tokens = warm + args.steps + prefill_steps + 8
    max_model_len = args.context + max_tokens + 8
    runner = ModelRunner(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                                      max_num_seqs=args.batch, max_model_len=max_model_len,
                                      enforce_eager=args.enforce_eager).resolve())
    vocab = runner.model_config.vocab_size
    blocks_per_seq = -(-max_model_len // args.block_size)
    num_blocks = args.batch * blocks_per_seq + 8
    runner.allocate_kv_cache(num_blocks)  # captures the decode graphs unless eager
    core = _C.Scheduler(num_blocks=num_blocks, block_size=args.block_size, max_num_seqs=args.batch,
                        max_num_batched_tokens=budget, max_model_len=max_model_len,
                        enable_prefix_caching=False, eos_token_ids=[], vocab_size=vocab)
    rng = np.random.default_rng(0)
    for i in range(args.batch):
        core.add(i, rng.integers(0, vocab, args.context - 1).tolist(), max_tokens=max_tokens, ignore_eos=True)
    # Prompts through the core only: until every sequence decodes.
    while True:
        plan = core.schedule()
        if plan.num_prefill_tokens == 0:
            break
        core.postprocess(np.zeros(plan.num_samples, dtype=np.int32))

    gpu_ms, sched_us, host_us, wall_ms = [], [], [], []
    first = True
    for step in range(warm + args.steps):
        t0 = time.perf_counter()
        if not first:
            plan = core.schedule()
        t1 = time.perf_counter()
        first = False
        assert plan.num_seqs == args.batch and plan.num_prefill_tokens == 0
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        v = runner.plan_views(plan)
        hidden = runner.forward(v, HostSeqLens(cu_seqlens_q=plan.cu_seqlens_q, context_lens=plan.context_lens))
        tokens = runner.logits(hidden, v.sample_indices, plan.sample_indices).argmax(dim=-1).to(torch.int32)
        if cuda:
            end.record()
        t2 = time.perf_counter()
        ids = tokens.cpu().numpy()
        t3 = time.perf_counter()
        core.postprocess(ids)
        t4 = time.perf_counter()
        if step >= warm:
            sched_us.append(((t1 - t0) + (t4 - t3)) * 1e6)
            host_us.append((t2 - t1) * 1e6)
            wall_ms.append((t4 - t0) * 1e3)
            if cuda:
                gpu_ms.append(start.elapsed_time(end))
    med = statistics.median
    record = {
        "model": args.model, "batch": args.batch, "context": args.context, "block_size": args.block_size,
        "dtype": args.dtype, "cuda_graphs": runner.graphs is not None, "attn_backend": runner.attn_backend,
        "steps": args.steps, "gpu_ms": med(gpu_ms) if gpu_ms else None, "sched_us": med(sched_us),
        "host_us": med(host_us), "wall_ms": med(wall_ms),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
    }
    step_ms = record["gpu_ms"] if record["gpu_ms"] is not None else record["wall_ms"]
    record["sched_fraction"] = record["sched_us"] / 1e3 / step_ms
    sched_file = None
    if args.sched_json is not None and args.sched_json.is_file():
        rows = json.loads(args.sched_json.read_text())
        match = [r for r in rows if r.get("scenario") == "decode" and r.get("num_seqs") == args.batch
                 and r.get("block_size") == args.block_size]
        if match:
            best = min(match, key=lambda r: abs(r["context_len"] - args.context))
            sched_file = {"context_len": best["context_len"], "us_total": best["us_total"]}
            record["sched_overhead_us_total"] = best["us_total"]
            record["sched_overhead_fraction"] = best["us_total"] / 1e3 / step_ms
    print(f"decode step, batch {args.batch} x context {args.context}, {args.dtype}, block {args.block_size}, "
          f"{'CUDA graphs' if record['cuda_graphs'] else 'eager'}, backend {record['attn_backend']}, "
          f"{record['device']}")
    print("| GPU step ms | wall step ms | runner host us | sched CPU us (this loop) | sched / GPU step |"
          + (" sched_overhead.py us_total | its share |" if sched_file else ""))
    print("|---:|---:|---:|---:|---:|" + ("---:|---:|" if sched_file else ""))
    gpu = "-" if record["gpu_ms"] is None else f"{record['gpu_ms']:.2f}"
    line = (f"| {gpu} | {record['wall_ms']:.2f} | {record['host_us']:.0f} | {record['sched_us']:.1f} "
            f"| {100 * record['sched_fraction']:.2f}% |")
    if sched_file:
        line += f" {sched_file['us_total']:.1f} (ctx {sched_file['context_len']}) | " \
                f"{100 * record['sched_overhead_fraction']:.2f}% |"
    print(line)
    ok = record["sched_fraction"] < TARGET_FRACTION
    print(f"\n{'PASS' if ok else 'FAIL'}  scheduler CPU time per step = {100 * record['sched_fraction']:.2f}% of the "
          f"GPU step (target < {100 * TARGET_FRACTION:.0f}%)")
    if args.json is not None:
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
