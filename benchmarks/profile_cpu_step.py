"""Where a CPU decode step's time goes: GEMMs, attention, norms, rotary, activation, the experts of
mixture-of-experts layers, logits, sampling, and the rest (Python, the scheduler, tensor plumbing), under torch.profiler.

`--num-seqs` prompts of `--prompt-len` random tokens are prefilled first; then `--steps` decode
steps of the whole batch are profiled. The layers' forwards are wrapped in
`torch.profiler.record_function` labels here, in the benchmark (the engine's code is not touched),
and each label's total CPU time, children included, is attributed to its category. A GEMM inside
an attention label counts as attention: the labels do not nest.
The layers run in Python here (`python_layers`), not as the engine's one C++ call for all of them
(models/cpu_stack.py, which calls the same kernels), so that their parts are seen; "other" then
includes the Python around the layers' kernels that the stack saves. The report ends with the
engine's own step, `--steps` more decode steps run as the engine runs them (the stack, no profiler),
so that the parts can be read against what a step costs.

Usage: python benchmarks/profile_cpu_step.py [--model DIR] [--dtype bfloat16] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench_report import machine, write_json

from nanovllm import LLM, SamplingParams
from nanovllm.builtin_model import ensure_default_model
from nanovllm.layers import activation, attention, embed_head, fused_moe, layernorm, linear, rotary_embedding
from nanovllm.sample import sampler

# label -> (class, methods) wrapped under it. Attention covers the KV write and the kernel; on CPU
# (forward_qkv: one call from the qkv rows) also the q/k norm and rotary, which then count there.
WRAPPED: dict[str, tuple[type, tuple[str, ...]]] = {
    "gemm": (linear.LinearBase, ("matmul",)),  # not forward: RowParallelLinear overrides it
    "attention": (attention.Attention, ("forward", "forward_qkv")),
    "norm": (layernorm.RMSNorm, ("forward",)),
    "rotary": (rotary_embedding.RotaryEmbedding, ("forward",)),
    "activation": (activation.SiluAndMul, ("forward",)),
    "moe experts": (fused_moe.FusedMoE, ("forward",)),  # routing, experts, combine; the router's GEMM is "gemm"
    # compute_logits' entry, one C++ call on CPU; an all-greedy step's tokens come from `greedy`
    # (the argmax with them: "sampling" then has no call).
    "lm_head": (embed_head.ParallelLMHead, ("logits", "greedy")),
    "sampling": (sampler.Sampler, ("__call__",)),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the built-in model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="caps the checkpoint's (a Qwen3 config's 40,960 would not fit the default KV cache)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def install_labels() -> None:
    """Wrap each of WRAPPED's methods in its profiler label (once per process)."""
    for name, (cls, methods) in WRAPPED.items():
        for method in methods:
            setattr(cls, method, _label(name, getattr(cls, method)))


def _label(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def python_layers(llm: LLM, on: bool = True) -> None:
    """Run the model's layers in Python (on), where the labels see them, or as the engine does: one
    C++ call for all of them where the model takes it (models/cpu_stack.py), which calls the same
    kernels (off)."""
    for module in llm.engine.executor.runner.model.modules():
        if hasattr(module, "use_cpu_stack"):
            module.use_cpu_stack = not on


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_labels()
    model = args.model or str(ensure_default_model())
    llm = LLM(model, dtype=args.dtype, max_num_seqs=args.num_seqs, max_model_len=args.max_model_len)
    python_layers(llm)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2 * args.steps + 8)
    for _ in range(args.num_seqs):
        prompt = [rng.randrange(min(engine.vocab_size, 10_000)) for _ in range(args.prompt_len)]
        engine.add_request(engine.next_request_id(), prompt, params)
    # Prefill everything (and a couple of decodes, so the profiled steps are all decode).
    budget = engine.config.max_num_batched_tokens  # the step's token budget
    for _ in range(1 + -(-args.num_seqs * args.prompt_len // budget) + 2):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            with record_function("step"):
                engine.step()
        wall = time.perf_counter() - start
    totals = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages() if e.key in (*WRAPPED, "step")}
    step_ms = totals["step"] / args.steps
    parts = {name: totals.get(name, 0.0) / args.steps for name in WRAPPED}
    parts["other (python, scheduler, plumbing)"] = step_ms - sum(parts.values())
    engine_step_ms = _engine_step_ms(llm, args.steps)
    print(f"{model}, {engine.executor.runner.dtype}, backend {engine.executor.runner.attn_backend}, batch {args.num_seqs}, "
          f"context ~{args.prompt_len}, {torch.get_num_threads()} threads, {machine()}")
    print(f"decode step: {step_ms:.2f} ms under the profiler ({1000 * wall / args.steps:.2f} ms wall)")
    print("| part | ms / step | share |\n|---|---:|---:|")
    for name, ms in parts.items():
        print(f"| {name} | {ms:.2f} | {100 * ms / step_ms:.0f}% |")
    print(f"the engine's own decode step (the layers as one C++ call where the model takes it, no profiler): "
          f"{engine_step_ms:.2f} ms")
    if args.json is not None:
        write_json(args.json, {"model": model, "dtype": str(engine.executor.runner.dtype), "num_seqs": args.num_seqs,
                               "prompt_len": args.prompt_len, "step_ms": step_ms, "parts_ms": parts,
                               "engine_step_ms": engine_step_ms, "machine": machine()})
    return 0


def _engine_step_ms(llm: LLM, steps: int) -> float:
    """Wall ms of `steps` decode steps run as the engine runs them, after one untimed step (which
    builds the layer stack)."""
    python_layers(llm, on=False)
    llm.engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    return 1000 * (time.perf_counter() - start) / steps


if __name__ == "__main__":
    sys.exit(main())
