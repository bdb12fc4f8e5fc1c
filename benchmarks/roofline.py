"""A CPU decode step against its roofline floor, per part, in bf16, int8 and int4.

A decode step reads every weight once, the KV cache of every sequence once, and little else, and
multiplies each weight with every sequence's row, so on a CPU each part's time has a floor: the
larger of its bytes / read bandwidth and its multiply-adds / the CPU's GEMM rate (the roofline:
bandwidth-bound at batch 1, compute-bound once enough rows share each weight; on an AVX2 or
AVX512-BF16 CPU without AMX a bf16 step of 32 sequences is compute-bound). This script

1. measures the read bandwidth with the engine's threads (torch.get_num_threads()): the best of a
   few sums over a 1 GiB float32 buffer (a streaming read, as a GEMM's weights are), and the GEMM
   rate: the best of a few bf16 [256, 1024] x [1024, 6144] products on the kernel the engine runs
   such a layer on (cpu/gemm.py's choice for this CPU); both taken again right before each variant
   and batch is timed (a shared VM's bandwidth drifts by tens of percent within minutes, and its
   GEMM rate by up to 9x when another process takes a core: a floor from another minute's rate
   misstates the step);
2. counts the bytes a decode step must read: each linear layer's weight at its stored precision
   (packed values, scales and zero points for int8/int4), the LM head, and the KV cache rows the
   attention kernel reads (context x layers x 2 x KV heads x head_dim, the context the sequences'
   mean over the timed steps: `--context` prompt tokens and those generated so far); and its
   multiply-adds (batch x each weight's elements; attention: batch x context x layers x 2 x heads x
   head_dim);
3. times decode steps of `--batch` sequences of `--context`-token prompts and, in the same steps,
   their parts: the GEMMs and attention by the engine's C++ stack of the layers (DecoderStack's
   part clocks, models/cpu_stack.py), the LM head by a clock around its call; and prints each
   part's time against its floor, and which bound sets it (bw or compute); the rest is the step
   less those parts (the norms, SiLU-and-mul, the host). A model whose layers run in Python has its
   parts timed under torch.profiler instead (labels as benchmarks/profile_cpu_step.py), in steps of
   their own: there attention read 1.2-1.3x its stack time and the GEMMs 1.2-1.4x at 32 sequences
   (Intel Xeon with AMX).

The variants: the checkpoint in bf16, and int8 / int4 quantized at load (LLM(quantization=...),
the same weights as `nanovllm quantize`); the embedding and the LM head stay bf16. The quantized
GEMMs' floor counts the same multiply-adds at the bf16 rate (unpacking the integers is work the
floor does not excuse). A mixture of experts' experts are counted in neither the bytes nor the FLOPs
(the floor of such a model is too low): benchmarks/moe_decode.py measures their reads.

Usage:
    python benchmarks/make_bench_model.py /tmp/qwen3-cpu --shape qwen3-cpu
    python benchmarks/roofline.py --model /tmp/qwen3-cpu [--batch 1,32] [--variants bf16,int8,int4] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench_report import CallClock, bandwidth_probe, machine, markdown_table, read_bandwidth, write_json
from profile_cpu_step import WRAPPED, install_labels, python_layers

from nanovllm import LLM, SamplingParams
from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.layers.embed_head import ParallelLMHead
from nanovllm.layers.linear import LinearBase

VARIANTS = {"bf16": None, "int8": "int8", "int4": "int4"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a bf16 (or fp32) checkpoint, e.g. make_bench_model.py's qwen3-cpu")
    p.add_argument("--variants", default="bf16,int8,int4")
    p.add_argument("--batch", default="1,32", help="decode batch sizes")
    p.add_argument("--context", type=int, default=256, help="tokens of context per sequence")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of --steps steps; the best counts")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def tensor_bytes(t: Any) -> int:
    return t.numel() * t.element_size()


def linear_bytes(layer: LinearBase) -> int:
    """A linear layer's weight (and bias) as the forward reads it."""
    if layer.quant is not None:
        weight = layer.quant.stored_bytes()
    elif layer.packed is not None:
        weight = layer.output_size * layer.input_size * layer.packed.dtype.itemsize if isinstance(
            layer.packed, torch.Tensor) else tensor_bytes(layer.packed.data)
    else:
        weight = tensor_bytes(layer.weight)
    return weight + (0 if layer.bias is None else tensor_bytes(layer.bias))


def head_bytes(head: ParallelLMHead) -> int:
    if head.packed is None:
        return tensor_bytes(head.weight)
    if isinstance(head.packed, torch.Tensor):
        return head.vocab_size * head.hidden_size * head.packed.dtype.itemsize
    return tensor_bytes(head.packed.data)


def mean_context(engine: Any, batch: int, steps: int) -> float:
    """The keys a decode step's attention reads per sequence, on average over the next `steps` decode
    steps, from the last step's plan (a decode of every sequence: its positions are the contexts less
    one, and each step adds a token). The prompts' prefill ends at different steps (chunked), so the
    sequences enter the timed steps with different numbers of generated tokens, and each timed run
    starts `steps` tokens further on than the one before: counted at --context, the KV cache's bytes
    came out 7-19% short (batch 32, 256-token prompts)."""
    plan = engine.scheduler.plan
    if plan.num_tokens != batch or len(plan.seq_ids) != batch:
        raise RuntimeError(f"the last step ran {plan.num_tokens} tokens of {len(plan.seq_ids)} sequences, "
                           f"not a decode of all {batch}")
    return float(plan.positions.mean()) + 2 + (steps - 1) / 2


def step_bytes(llm: LLM, batch: int, context: float) -> dict[str, int]:
    runner = llm.engine.executor.runner
    model = runner.model
    spec = runner.kv_spec
    kv = round(batch * context * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize)
    return {"gemm": sum(linear_bytes(m) for m in model.modules() if isinstance(m, LinearBase)),
            "attention": kv, "lm_head": head_bytes(model.lm_head)}


def step_flops(llm: LLM, batch: int, context: float) -> dict[str, int]:
    """Floating-point operations (2 per multiply-add) of a decode step's parts."""
    runner = llm.engine.executor.runner
    model = runner.model
    spec = runner.kv_spec
    heads = model.config.num_attention_heads
    linear = sum(m.input_size * m.output_size for m in model.modules() if isinstance(m, LinearBase))
    return {"gemm": 2 * batch * linear,
            "attention": round(2 * batch * context * spec.num_layers * 2 * heads * spec.head_dim),
            "lm_head": 2 * batch * model.lm_head.vocab_size * model.lm_head.hidden_size}


def gemm_rate(repeats: int = 11) -> float:
    """FLOP/s of a bf16 [256, 1024] x [1024, 6144] product on the engine's kernel for such a layer."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6144, 1024, generator=g).bfloat16()
    x = torch.randn(256, 1024, generator=g).bfloat16()
    packed = cpu_gemm.prepack(w) if cpu_gemm.can_prepack(w) else None
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        cpu_gemm.matmul(x, w, packed, None)
        best = min(best, time.perf_counter() - start)
    return 2 * 256 * 1024 * 6144 / best


def layer_stack(llm: LLM) -> Any:
    """The engine's C++ stack of the model's layers (_cpu.DecoderStack), or None where they run in Python."""
    for module in llm.engine.executor.runner.model.modules():
        if hasattr(module, "layer_stack"):
            built = module.layer_stack()
            return None if built is None else built.stack
    return None


def profiled_parts(llm: LLM, steps: int) -> dict[str, float]:
    """ms per step of the parts of `steps` decode steps on the layers in Python, under torch.profiler."""
    python_layers(llm)  # the parts are timed on the Python layers, which call the stack's kernels
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("step"):
                llm.engine.step()
    python_layers(llm, False)
    totals = {e.key: e.cpu_time_total / 1e3 / steps for e in prof.key_averages() if e.key in WRAPPED}
    return {part: totals.get(part, 0.0) for part in ("gemm", "attention", "lm_head")}


def run_variant(model: str, variant: str, batches: list[int], args: argparse.Namespace,
                probe: torch.Tensor, head: CallClock) -> list[dict[str, Any]]:
    max_batch = max(batches)
    # A sequence decodes from its prefill on, the first while the others still prefill (at most
    # `context` steps: the budget covers max_num_seqs tokens), and none may finish before the timed
    # steps end.
    generated = args.context + 2 + args.steps * (args.repeats + 1) + 8
    llm = LLM(model, dtype="bfloat16", quantization=VARIANTS[variant], max_num_seqs=max_batch,
              max_model_len=args.context + generated + 64, kv_cache_memory_bytes=2 << 30)
    engine = llm.engine
    budget = engine.config.max_num_batched_tokens
    rows = []
    for batch in batches:
        rng = random.Random(batch)
        warmup = 2 + -(-batch * args.context // budget)  # prefill, then decode only
        params = SamplingParams(temperature=0.0, ignore_eos=True,
                                max_tokens=warmup + args.steps * (args.repeats + 1) + 8)
        ids = [engine.next_request_id() for _ in range(batch)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(min(engine.vocab_size, 4000)) for _ in range(args.context)], params)
        for _ in range(warmup):
            engine.step()
        bandwidth = read_bandwidth(probe, repeats=3)
        rate = gemm_rate()
        stack = layer_stack(llm)
        walls, contexts, timed_parts = [], [], []
        for _ in range(args.repeats):
            contexts.append(mean_context(engine, batch, args.steps))
            if stack is not None:
                stack.time_parts(True)
            head.on, head.seconds = True, 0.0
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            walls.append((time.perf_counter() - start) / args.steps)
            head.on = False
            if stack is not None:
                stack.time_parts(False)
                times = stack.part_times
                timed_parts.append({"gemm": 1000 * times["gemm"] / args.steps,
                                    "attention": 1000 * times["attention"] / args.steps,
                                    "lm_head": 1000 * head.seconds / args.steps})
        best = min(range(args.repeats), key=walls.__getitem__)
        parts_ms = timed_parts[best] if stack is not None else profiled_parts(llm, args.steps)
        for rid in ids:  # so that the next batch starts clean
            engine.abort_request(rid)
        step_ms = 1000 * walls[best]
        parts_ms["rest"] = max(0.0, step_ms - sum(parts_ms.values()))
        nbytes = step_bytes(llm, batch, contexts[best])
        flops = step_flops(llm, batch, contexts[best])
        read_ms = {k: 1000 * v / bandwidth for k, v in nbytes.items()}
        compute_ms = {k: 1000 * v / rate for k, v in flops.items()}
        floor_ms = {k: max(read_ms[k], compute_ms[k]) for k in nbytes}
        rows.append({"variant": variant, "batch": batch, "context": contexts[best],
                     "bandwidth_bytes_s": bandwidth, "gemm_flops_s": rate, "step_ms": step_ms,
                     "tok_s": batch / step_ms * 1000,
                     "floor_ms": sum(floor_ms.values()), "bytes": nbytes, "flops": flops, "parts_ms": parts_ms,
                     "floor_parts_ms": floor_ms, "read_floor_parts_ms": read_ms,
                     "compute_floor_parts_ms": compute_ms, "parts_timed_by": "stack" if stack is not None
                     else "profiler"})
    engine.shutdown()
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    def pct(floor: float, ms: float) -> str:
        return f"{100 * floor / ms:.0f}%" if ms > 0 else "-"

    def part(r: dict[str, Any], key: str) -> str:
        ms, floor = r["parts_ms"][key], r["floor_parts_ms"][key]
        bound = "compute" if r["compute_floor_parts_ms"][key] > r["read_floor_parts_ms"][key] else "bw"
        return f"{ms:.2f} ({floor:.2f} {bound}, {pct(floor, ms)})"

    table = []
    for r in rows:
        p = r["parts_ms"]
        table.append({
            "variant": r["variant"], "batch": r["batch"], "context": f"{r['context']:.0f}",
            "GB/s": f"{r['bandwidth_bytes_s'] / 1e9:.1f}",
            "GFLOP/s": f"{r['gemm_flops_s'] / 1e9:.0f}",
            "tok/s": f"{r['tok_s']:.1f}",
            "step ms (floor, %)": f"{r['step_ms']:.2f} ({r['floor_ms']:.2f}, {pct(r['floor_ms'], r['step_ms'])})",
            "MB read": f"{sum(r['bytes'].values()) / 1e6:.0f}",
            "GEMMs ms (floor)": part(r, "gemm"),
            "attention ms (floor)": part(r, "attention"),
            "LM head ms (floor)": part(r, "lm_head"),
            "rest ms": f"{p['rest']:.2f}",
            "bandwidth floor ms (%)": f"{sum(r['read_floor_parts_ms'].values()):.2f} "
                                      f"({pct(sum(r['read_floor_parts_ms'].values()), r['step_ms'])})",
        })
    print(markdown_table(table, list(table[0])))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_labels()
    head = CallClock([(ParallelLMHead, "logits"), (ParallelLMHead, "greedy")], on=False)  # one of them a step
    batches = [int(b) for b in args.batch.split(",")]
    variants = [v.strip() for v in args.variants.split(",")]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants takes {', '.join(VARIANTS)}, got {v!r}")
    probe = bandwidth_probe()
    bandwidth = read_bandwidth(probe)
    rate = gemm_rate()
    print(f"{args.model}, context {args.context}, {torch.get_num_threads()} threads, {machine()}\n"
          f"read bandwidth at the start: {bandwidth / 1e9:.1f} GB/s, bf16 GEMM rate {rate / 1e9:.0f} GFLOP/s (each "
          "row's: GB/s, GFLOP/s, probed before its steps); parts timed in the same steps (the C++ stack's clocks, the "
          "LM head's); a part's floor is the larger of its bytes over the row's bandwidth and its FLOPs over the "
          "row's GEMM rate (bw / compute: which), its % that floor over its time")
    rows = [r for v in variants for r in run_variant(args.model, v, batches, args, probe, head)]
    print_rows(rows)
    if args.json is not None:
        write_json(args.json, {"model": args.model, "context": args.context, "threads": torch.get_num_threads(),
                               "bandwidth_bytes_s": bandwidth, "gemm_flops_s": rate, "machine": machine(),
                               "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
