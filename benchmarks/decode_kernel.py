"""Decode kernel bandwidth: K/V bytes the paged decode kernel reads per second, against the
device's own copy bandwidth measured in the same process.

Decode attention is bound by HBM bandwidth: each step reads every cached K and V element of the
batch once (once per KV head, whatever the GQA group size) and does little arithmetic per byte. So
the figure of merit is achieved bandwidth = (K + V bytes of all contexts) / kernel time, compared
with a large device-to-device copy (bytes read + bytes written, / time), which is about the best
any kernel streaming through HBM achieves. Target: the main row >= 70% of the copy.

Rows: the target configuration (batch 256 x context 2048, head_dim 128, 8 KV heads, 16 query heads
as in Qwen3-0.6B, bf16, block size 16, shuffled block tables), then variants: block size 256,
GQA group 8, and a small batch with long contexts with split-KV on and forced off.

Usage: python benchmarks/decode_kernel.py [--json PATH] [--iters N] [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench_report import write_json

TARGET_FRACTION = 0.70


@dataclass
class Config:
    name: str
    batch: int
    context: int
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    num_partitions: int | None = None  # None: the wrapper's heuristic

    @property
    def kv_bytes(self) -> int:
        element = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * element


CONFIGS = [
    Config("target: bs 256 x ctx 2048, hd 128, 8 kv / 16 q heads, bf16, block 16", 256, 2048),
    Config("block size 256", 256, 2048, block_size=256),
    Config("GQA group 8 (64 q heads)", 256, 2048, num_heads=64),
    Config("fp16", 256, 2048, dtype="float16"),
    Config("bs 8 x ctx 32768, split-KV (auto)", 8, 32768),
    Config("bs 8 x ctx 32768, split-KV off", 8, 32768, num_partitions=1),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="write the records here")
    p.add_argument("--iters", type=int, default=30, help="timed launches per row (after 5 warm-up)")
    p.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy measuring the bandwidth")
    p.add_argument("--only-target", action="store_true", help="just the target row")
    p.add_argument("--dry-run", action="store_true", help="no GPU: print what would run")
    return p.parse_args(argv)


def time_cuda(fn, iters: int) -> float:
    """Median seconds per call over `iters` calls, CUDA events around each."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(gib: float, iters: int) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    src.fill_(1)
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), iters)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / seconds


def bench_config(c: Config, iters: int) -> dict:
    from nanovllm.attention import cuda_ops

    dtype = getattr(torch, c.dtype)
    blocks_per_seq = -(-c.context // c.block_size)
    num_blocks = c.batch * blocks_per_seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (num_blocks, c.block_size, c.num_kv_heads, c.head_dim)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    # Shuffled: a sequence's blocks are scattered over the cache, as after hours of serving.
    tables = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32).view(c.batch, blocks_per_seq)
    lens = torch.full((c.batch,), c.context, dtype=torch.int32, device="cuda")
    query = torch.randn(c.batch, c.num_heads, c.head_dim, generator=gen, device="cuda", dtype=dtype)
    out = torch.empty_like(query)
    sms = cuda_ops.num_sms(torch.device("cuda"))
    parts = c.num_partitions or cuda_ops.choose_num_partitions(c.batch, c.num_heads, c.num_kv_heads, c.context, sms)

    def launch() -> None:
        cuda_ops.decode_attention(query, k_cache, v_cache, tables, lens, c.head_dim**-0.5, max_context_len=c.context,
                                  out=out, num_partitions=parts)

    seconds = time_cuda(launch, iters)
    del k_cache, v_cache
    torch.cuda.empty_cache()
    return {**asdict(c), "num_partitions": parts, "kv_bytes": c.kv_bytes, "us": seconds * 1e6,
            "gb_s": c.kv_bytes / seconds / 1e9}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = CONFIGS[:1] if args.only_target else CONFIGS
    if args.dry_run:
        print("dry run (no GPU): would measure a %.1f GiB device copy, then:" % args.copy_gib)
        for c in configs:
            print(f"  {c.name}: {c.kv_bytes / 2**30:.2f} GiB of K/V per call, {args.iters} timed calls")
        records = [{**asdict(c), "kv_bytes": c.kv_bytes, "us": None, "gb_s": None, "num_partitions": c.num_partitions}
                   for c in configs]
        result = {"dry_run": True, "copy_gb_s": None, "target_fraction": TARGET_FRACTION, "rows": records}
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (use --dry-run to check the script)", file=sys.stderr)
            return 2
        from nanovllm.attention import cuda_ops

        cuda_ops.kernels()  # ImportError with instructions if the kernels are not built
        props = torch.cuda.get_device_properties(0)
        copy = copy_bandwidth(args.copy_gib, args.iters)
        records = [bench_config(c, args.iters) for c in configs]
        result = {"dry_run": False, "device": props.name, "num_sms": props.multi_processor_count,
                  "torch": torch.__version__, "copy_gb_s": copy / 1e9, "target_fraction": TARGET_FRACTION,
                  "rows": records}
    print_table(result)
    if args.json is not None:
        write_json(args.json, result)
    if result["dry_run"]:
        return 0
    return 0 if target_met(result) else 1


def target_met(result: dict) -> bool:
    row = result["rows"][0]
    return row["gb_s"] is not None and row["gb_s"] >= TARGET_FRACTION * result["copy_gb_s"]


def print_table(result: dict) -> None:
    copy = result["copy_gb_s"]
    print(f"\ndevice copy bandwidth (read + write): {'-' if copy is None else f'{copy:.0f} GB/s'}"
          f"{'' if result['dry_run'] else ' on ' + result['device']}")
    print("| decode kernel | partitions | K/V GiB | us / call | GB/s | % of copy |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        us = "-" if r["us"] is None else f"{r['us']:.1f}"
        gbs = "-" if r["gb_s"] is None else f"{r['gb_s']:.0f}"
        pct = "-" if r["gb_s"] is None or not copy else f"{100 * r['gb_s'] / copy:.0f}%"
        parts = "auto" if r["num_partitions"] is None else r["num_partitions"]
        print(f"| {r['name']} | {parts} | {r['kv_bytes'] / 2**30:.2f} | {us} | {gbs} | {pct} |")
    if not result["dry_run"]:
        row = result["rows"][0]
        verdict = "PASS" if target_met(result) else "FAIL"
        print(f"\n{verdict}  target row: {row['gb_s']:.0f} GB/s = {100 * row['gb_s'] / copy:.0f}% of the copy "
              f"bandwidth (target >= {100 * TARGET_FRACTION:.0f}%)")


if __name__ == "__main__":
    sys.exit(main())
