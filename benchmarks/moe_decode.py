"""The bytes of expert weights a CPU decode step reads, against the machine's memory bandwidth.

`--num-seqs` prompts of `--prompt-len` random tokens are prefilled, then `--steps` decode steps of
the whole batch are timed as the engine runs them (the layers as one C++ call where the model takes
it), then `--steps` more on the Python layers, whose mixture-of-experts layers call the same kernel:
each such call (layers/fused_moe.py, the experts only: the router's GEMM is not in it) is timed
with perf_counter, and its routing counted outside
the timing: the distinct experts its rows chose, each of which it must read once (gate/up and down
weights as packed: an idle expert is never read). Reported per step: the step's wall time, the MoE
layers' time, the experts' bytes read, and the rate they were read at against the machine's read
bandwidth (also the rate over the CPU time the layers' threads got: on a shared machine a thread
waits at each barrier for a descheduled sibling, and the wall time counts that), measured here as the best of 5 sums over a 1 GiB fp32 buffer (on huge pages, as the
packed experts) on the same threads.

`--kernel avx2|onednn` packs the experts for that GEMM kernel instead of the one this CPU takes
(nanovllm/cpu/moe.py): the MoE layer is one C++ call on the first, a per-expert loop on
the second. `--quantization int8|int4` quantizes the model at load (experts included; the bytes are
then the experts' as stored); `--experts-loop` runs quantized experts as a per-expert loop of
quantized GEMMs instead of the one-call layer (layers/quantization/cpu_moe.py).

Usage: python benchmarks/moe_decode.py --model DIR [--dtype bfloat16] [--kernel avx2] [--quantization int4]
       [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench_report import bandwidth_probe, machine, markdown_table, read_bandwidth, write_json
from profile_cpu_step import python_layers

from nanovllm import LLM, SamplingParams
from nanovllm.cpu import moe as cpu_moe
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.quantization import cpu_moe as quant_moe


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Qwen3-MoE or Mixtral model directory")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kernel", choices=["avx2", "onednn"], default=None, help="default: this CPU's")
    p.add_argument("--quantization", choices=["int8", "int4"], default=None)
    p.add_argument("--experts-loop", action="store_true", help="quantized experts as a per-expert loop")
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def expert_bytes(layer: FusedMoE) -> int:
    """One expert's gate/up and down weights as this layer reads them."""
    if layer.quant is not None:
        return layer.quant.stored_bytes() // layer.num_experts
    packed = layer.packed
    if isinstance(packed, cpu_moe.GemmPackedExperts):
        return (packed.w13.nbytes + packed.w2.nbytes) // packed.experts
    element = layer.w13_weight.element_size() if packed is None else packed.w13[0].element_size()
    return 3 * layer.hidden_size * layer.intermediate_size * element


class MoeMeter:
    """Wraps FusedMoE.forward: time in it, experts read and their bytes, while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # the process's CPU time: every thread's, spinning at barriers included
        self.experts = 0
        self.bytes = 0
        forward = FusedMoE.forward

        def timed(layer: FusedMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            if not self.on:
                return forward(layer, x, logits)
            hit = torch.unique(logits.topk(layer.top_k, dim=-1).indices).numel()
            start, cpu = time.perf_counter(), time.process_time()
            out = forward(layer, x, logits)
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.process_time() - cpu
            self.experts += hit
            self.bytes += hit * expert_bytes(layer)
            return out

        FusedMoE.forward = timed  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.kernel is not None:
        kernel = args.kernel
        cpu_moe.expert_kernel = lambda: kernel  # type: ignore[assignment]
    if args.experts_loop:
        quant_moe.can_pack = lambda w13, w2: False  # type: ignore[assignment]
    meter = MoeMeter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.num_seqs, max_model_len=args.max_model_len,
              quantization=args.quantization)
    engine = llm.engine
    layers = [m for m in engine.executor.runner.model.modules() if isinstance(m, FusedMoE)]
    if not layers:
        raise SystemExit(f"{args.model} has no mixture-of-experts layers")
    quant = layers[0].quant
    if quant is not None:
        packing = f"{args.quantization or 'quantized'}, " + ("one call" if quant.fused is not None else "loop")
    else:
        packing = type(layers[0].packed).__name__ if layers[0].packed is not None else "dense"
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2 * args.steps + 8)
    for _ in range(args.num_seqs):
        prompt = [rng.randrange(min(engine.vocab_size, 10_000)) for _ in range(args.prompt_len)]
        engine.add_request(engine.next_request_id(), prompt, params)
    budget = engine.config.max_num_batched_tokens
    for _ in range(1 + -(-args.num_seqs * args.prompt_len // budget) + 2):  # prefill, then two decodes
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - start) / args.steps  # as the engine runs: the layers as one C++ call
    # The meter wraps the Python MoE layer, which calls the same kernel as the stack's MoE layers.
    python_layers(llm)
    meter.on = True
    for _ in range(args.steps):
        engine.step()
    meter.on = False
    python_layers(llm, False)
    bandwidth = read_bandwidth(bandwidth_probe())
    moe_s = meter.seconds / args.steps
    threads = torch.get_num_threads()
    read = meter.bytes / args.steps
    row: dict[str, Any] = {
        "dtype": str(engine.executor.runner.dtype).removeprefix("torch."), "packing": packing, "batch": args.num_seqs,
        "step ms": round(1000 * step_s, 1), "MoE ms": round(1000 * moe_s, 1),
        "MoE share": f"{100 * moe_s / step_s:.0f}%",
        "experts read / step": f"{meter.experts / args.steps:.0f} of {sum(m.num_experts for m in layers)}",
        "MB read / step": round(read / 1e6, 1), "MoE GB/s": round(read / moe_s / 1e9, 2),
        "bandwidth GB/s": round(bandwidth / 1e9, 2), "of bandwidth": f"{100 * read / moe_s / bandwidth:.0f}%",
        # What the MoE layers read at while their threads ran (the wall time when they share the cores).
        "MoE GB/s on CPU time": round(read / (meter.cpu_seconds / args.steps / threads) / 1e9, 2),
    }
    print(f"{args.model}, {torch.get_num_threads()} threads, {machine()}, context ~{args.prompt_len}")
    print(markdown_table([row], list(row)))
    if args.json is not None:
        write_json(args.json, {"model": args.model, "machine": machine(), "steps": args.steps,
                               "prompt_len": args.prompt_len, **row})
    return 0


if __name__ == "__main__":
    sys.exit(main())
