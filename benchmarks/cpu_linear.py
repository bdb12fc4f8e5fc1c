"""CPU GEMMs of the bench models' shapes: plain `F.linear` against weights prepacked once (oneDNN's
matmul on a reordered weight as the engine calls it, MKL's packed sgemm, and nanovllm's own
`gemm_cpu`: AVX-512 or AVX2 tiles, bf16 weights on the AVX512-BF16 pair tiles where the CPU has
them), in fp32 and bf16. A variant the CPU cannot run (oneDNN bf16 needs AVX512-BW or
AVX-NE-CONVERT; ours needs AVX2 + FMA) is reported as such.

Median microseconds of `--repeats` calls per shape, the variants taking turns call by call (the
host's speed drifts); nanovllm/cpu/gemm.py says which variant the engine takes on which CPU (see
benchmarks/RESULTS.md). `--shapes` replaces the built-in list (e.g. the LM head at decode batches:
`--shapes 1x1024x32000,8x1024x32000,32x1024x32000 --dtypes bfloat16`).

Usage: python benchmarks/cpu_linear.py [--repeats 30] [--shapes MxKxN,...] [--dtypes float32,bfloat16]
[--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_report import machine, markdown_table, write_json

from nanovllm import _cpu
from nanovllm.cpu import features as cpu_features
from nanovllm.cpu import gemm as cpu_gemm

# (batch rows, in, out): decode at batch 64 of the Qwen3-shaped bench model (qkv, o, gate_up,
# down, LM head) and of the built-in model (qkv, gate_up), and one prefill chunk.
SHAPES = [(64, 1024, 2048), (64, 1024, 1024), (64, 1024, 6144), (64, 3072, 1024), (64, 1024, 32000),
          (64, 256, 512), (64, 256, 256), (64, 256, 1536), (64, 768, 256), (64, 256, 4096),
          (1, 1024, 6144), (256, 1024, 2048), (256, 1024, 6144), (256, 3072, 1024), (512, 1024, 6144)]


def median_us(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float | str]:
    """Each variant's median microseconds per call, the variants taking turns; a variant the CPU
    cannot run gets the reason instead."""
    times: dict[str, list[float]] = {}
    out: dict[str, float | str] = {}
    for name, fn in fns.items():
        try:
            for _ in range(3):
                fn()
            times[name] = []
        except RuntimeError as e:
            out[name] = f"unsupported ({str(e).splitlines()[0].split(':')[0]})"
    for _ in range(repeats):
        for name in times:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    out.update({name: round(1e6 * statistics.median(t)) for name, t in times.items()})
    return out


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = [tuple(int(d) for d in s.split("x")) for s in text.split(",")]
    if any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"shapes are MxKxN, comma-separated: {text!r}")
    return shapes  # type: ignore[return-value]


def variants(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    out: dict[str, Callable[[], object]] = {"F.linear": lambda: F.linear(x, w)}
    onednn = cpu_gemm.prepack(w, "onednn") if x.dtype == torch.float32 or cpu_features.native_bf16() else None
    out["oneDNN prepacked"] = ((lambda: cpu_gemm.linear(x, onednn, None)) if onednn is not None else
                               _unsupported("oneDNN bf16 needs AVX512-BF16 or AMX"))
    if x.dtype == torch.float32:
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, x.shape[0])
        out["MKL packed"] = lambda: torch.ops.mkl._mkl_linear(x, mkl, w, None, x.shape[0])
    ours = cpu_gemm.prepack(w, "avx2") if _cpu.has_avx2_fma() else None
    out["nanovllm gemm_cpu"] = ((lambda: cpu_gemm.linear(x, ours, None)) if ours is not None else
                                _unsupported("needs AVX2 + FMA"))
    return out


def _unsupported(why: str) -> Callable[[], object]:
    def run() -> object:
        raise RuntimeError(why)
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--shapes", type=parse_shapes, default=SHAPES, help="MxKxN,... (default: the bench models')")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows = []
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for m, k, n in args.shapes:
            g = torch.Generator().manual_seed(0)
            x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
            row: dict[str, object] = {"dtype": str(dtype).removeprefix("torch."), "shape": f"{m}x{k}x{n}"}
            row.update(median_us(variants(x, w), args.repeats))
            rows.append(row)
    print(f"{machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; median us per call")
    columns = ["dtype", "shape", "F.linear", "oneDNN prepacked", "MKL packed", "nanovllm gemm_cpu"]
    print(markdown_table(({c: r.get(c) for c in columns} for r in rows), columns))
    if args.json is not None:
        write_json(args.json, {"machine": machine(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
