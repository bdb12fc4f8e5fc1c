"""The CPU GEMM on int8 / int4 weights (csrc/cpu_gemm_quant.cpp) beside the bf16 GEMM the engine runs
for an unquantized layer (oneDNN where the CPU computes bf16, else our AVX2 `gemm_cpu`), at the
Qwen3-shaped bench model's layer shapes: the engine's own pick ("auto") and each instruction set the
CPU runs, forced.

Each variant cycles through enough copies of the weight to overflow the last-level cache, so the
weights stream from DRAM as in a decode step. Reported: microseconds per call and the weight bytes
read per second, both as wall time and as the process's CPU time (on a machine shared with other
work the CPU time says what the kernel costs, the wall time what it got).

Usage: python benchmarks/quant_gemm.py [--rows 1,8,32] [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench_report import machine, markdown_table, write_json

from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.layers.quantization import cpu_kernel
from nanovllm.layers.quantization.weights import quantize_rtn

SHAPES = [(1024, 2048), (1024, 1024), (1024, 6144), (3072, 1024)]  # (in, out): qkv, o, gate_up, down
CACHE_BYTES = 96 << 20  # well past the last-level cache


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best wall seconds, best CPU seconds) of one call."""
    for _ in range(2):
        fn()
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return min(walls), min(cpus)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    # "auto" is the path the engine takes (AMX tiles from 2 rows where the CPU has them); the others
    # forced, each that this CPU runs.
    isas = ["auto"] + [i for i in ("amx", "avx512", "avx2") if cpu_kernel.isa_supported(i)]  # type: ignore[arg-type]
    rows_out = []
    for k, n in SHAPES:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)).to(torch.bfloat16)
        copies = max(1, CACHE_BYTES // (n * k * 2))
        dense = [cpu_gemm.prepack(w) for _ in range(copies)]
        quant = {}
        for bits in (8, 4):  # distinct copies of one packed weight
            base = cpu_kernel.pack(quantize_rtn(w, bits, 128 if bits == 4 else None, symmetric=False))
            quant[bits] = [dataclasses.replace(base, packed=base.packed.clone(), scales=base.scales.clone(),
                                               zeros=None if base.zeros is None else base.zeros.clone())
                           for _ in range(max(1, CACHE_BYTES // base.nbytes()))]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k).to(torch.bfloat16)
            variants: dict[str, tuple[Callable[[], object], int]] = {}
            it = iter(range(1 << 62))

            def cycle(ws: list, call: Callable[[object], object]) -> Callable[[], object]:
                return lambda: call(ws[next(it) % len(ws)])

            variants["bf16 (engine's dense GEMM)"] = (cycle(dense, lambda d: cpu_gemm.linear(x, d, None)), n * k * 2)
            for bits, ws in quant.items():
                for isa in isas:
                    variants[f"int{bits} {isa}"] = (cycle(ws, lambda q, isa=isa: cpu_kernel.linear(x, q, None, isa=isa)),
                                                    ws[0].nbytes())
            for name, (fn, nbytes) in variants.items():
                wall, cpu = timed(fn, args.repeats)
                rows_out.append({"shape": f"{m}x{k}x{n}", "variant": name, "us": round(1e6 * wall),
                                 "GB/s": round(nbytes / wall / 1e9, 1), "cpu us": round(1e6 * cpu),
                                 "GB/s of CPU time": round(nbytes / max(cpu, 1e-9) / 1e9, 1)})
    print(f"{machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; best of {args.repeats} calls, "
          "weights streamed from DRAM")
    print(markdown_table(rows_out, ["shape", "variant", "us", "GB/s", "cpu us", "GB/s of CPU time"]))
    if args.json is not None:
        write_json(args.json, {"machine": machine(), "threads": torch.get_num_threads(), "rows": rows_out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
