"""One table from a scripts/gpu_check.sh results directory, ready for benchmarks/RESULTS.md.

Reads what the check wrote (env.json, status.tsv, preflight.json, pytest*.txt, decode_kernel.json,
throughput_eager.json, throughput_graphs.json, decode_step.json, sched_overhead.json), prints a
markdown summary with the targets, and writes it to summary.md in the same directory. Missing
pieces show as "-" (a step that failed or was skipped), never as an error.

Usage: python benchmarks/gpu_report.py RESULTS_DIR
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

DECODE_TARGET = 0.70  # decode kernel bandwidth / device copy bandwidth
SCHED_TARGET = 0.05  # scheduler CPU time / GPU decode step
PYTEST_COUNTS = re.compile(r"\b\d+ (passed|failed|errors?|skipped)\b.* in [\d.]+s")


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "FAIL")


def report(d: Path) -> str:
    env = load(d / "env.json") or {}
    kernel = load(d / "decode_kernel.json")
    eager = load(d / "throughput_eager.json")
    graphs = load(d / "throughput_graphs.json")
    step = load(d / "decode_step.json")
    sched = load(d / "sched_overhead.json")
    lines = [f"# GPU check: {d.name}", ""]
    lines.append(f"- Device: {env.get('gpu', '-')}, driver {env.get('driver', '-')}; "
                 f"torch {env.get('torch', '-')} (CUDA {env.get('torch_cuda', '-')}), triton {env.get('triton', '-')}, "
                 f"flash-attn {env.get('flash_attn', '-')}, nvcc {env.get('nvcc', '-')}, Python {env.get('python', '-')}")
    lines.append(f"- nvidia-smi: {env.get('nvidia_smi') or '-'}")
    lines.append(f"- Tree: {env.get('git', '-')}; date {env.get('date', '-')}")
    preflight = load(d / "preflight.json")
    if preflight is not None:
        missing = preflight.get("missing") or {}
        lines.append(f"- Preflight: {len(preflight.get('required', []))} modules required, "
                     + (f"MISSING {', '.join(missing)}" if missing else "all import")
                     + f"; optional and absent: {', '.join(preflight.get('optional_absent') or []) or 'none'}")
    if env.get("dry_run"):
        lines.append("- DRY RUN: no GPU work was done; the numbers below come from CPU stand-ins or are empty")
    status = (d / "status.tsv").read_text().splitlines() if (d / "status.tsv").is_file() else []
    if status:
        steps = ", ".join(f"{n} {'ok' if rc == '0' else 'rc=' + rc} ({s}s)"
                          for n, rc, s in (line.split("\t") for line in status if line.count("\t") == 2))
        lines.append(f"- Steps: {steps}")
    logs = sorted(d.glob("pytest*.txt"))
    for log in logs:
        text = log.read_text(errors="replace")
        # pytest's closing count, or what the log ends with where the run was cut before it.
        counts = [line.strip("= ") for line in text.splitlines() if PYTEST_COUNTS.search(line)]
        tail = text.strip().splitlines()[-1:]
        lines.append(f"- Tests ({log.stem}): {counts[-1] if counts else (tail[0] if tail else '-')}")
        lines += [f"  - {line}" for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    if not logs:
        lines.append("- Tests: -")
    lines += ["", "| measure | value | target | verdict |", "|---|---:|---|---|"]

    copy = kernel.get("copy_gb_s") if kernel else None
    lines.append(f"| device-to-device copy bandwidth (read + write) | {fmt(copy, '.0f', ' GB/s')} | | |")
    for i, row in enumerate(kernel["rows"] if kernel else []):
        gbs = row.get("gb_s")
        frac = gbs / copy if gbs is not None and copy else None
        target = f">= {100 * DECODE_TARGET:.0f}% of copy" if i == 0 else ""
        ok = (frac >= DECODE_TARGET) if (i == 0 and frac is not None) else None
        lines.append(f"| decode kernel, {row['name']} (partitions {row.get('num_partitions') or 'auto'}) "
                     f"| {fmt(gbs, '.0f', ' GB/s')} ({fmt(None if frac is None else 100 * frac, '.0f', '%')}; "
                     f"{fmt(row.get('us'), '.0f', ' us')}) | {target} | {verdict(ok)} |")

    tok_e = eager.get("engine_tok_s") if eager else None
    tok_g = graphs.get("engine_tok_s") if graphs else None
    w = eager or graphs
    if w:
        workload = (f"{w['num_seqs']} seqs, in/out uniform [{w['min_len']}, {w['max_input_len']}]/"
                    f"[{w['min_len']}, {w['max_output_len']}], {w['workload_output_tokens']} output tokens, {w['dtype']}")
    else:
        workload = "-"
    lines.append(f"| throughput, eager ({workload}) | {fmt(tok_e, '.0f', ' tok/s')} "
                 f"({fmt(eager.get('engine_seconds') if eager else None, '.1f', ' s')}) | | |")
    speedup = tok_g / tok_e if tok_e and tok_g else None
    lines.append(f"| throughput, CUDA graphs | {fmt(tok_g, '.0f', ' tok/s')} "
                 f"({fmt(graphs.get('engine_seconds') if graphs else None, '.1f', ' s')}; "
                 f"{fmt(speedup, '.2f', 'x eager')}) | | |")

    gpu_ms = step.get("gpu_ms") if step else None
    if step:
        lines.append(f"| GPU decode step, batch {step['batch']} x ctx {step['context']} "
                     f"({'graphs' if step['cuda_graphs'] else 'eager'}) | {fmt(gpu_ms, '.2f', ' ms')} "
                     f"(wall {fmt(step.get('wall_ms'), '.2f', ' ms')}) | | |")
        frac = step.get("sched_fraction")
        lines.append(f"| scheduler CPU per step in that loop (schedule + postprocess) | "
                     f"{fmt(step.get('sched_us'), '.1f', ' us')} ({fmt(None if frac is None else 100 * frac, '.2f', '%')} "
                     f"of the step) | < {100 * SCHED_TARGET:.0f}% | {verdict(None if frac is None else frac < SCHED_TARGET)} |")
    if sched:
        rows = [r for r in sched if r.get("scenario") == "decode" and r.get("num_seqs") == 256
                and r.get("block_size") == 16]
        for r in rows:
            frac = r["us_total"] / 1e3 / gpu_ms if gpu_ms else None
            lines.append(f"| sched_overhead.py decode 256 seqs, block 16, ctx {r['context_len']}: us_total | "
                         f"{r['us_total']:.1f} us ({fmt(None if frac is None else 100 * frac, '.2f', '%')} of the GPU step) "
                         f"| < {100 * SCHED_TARGET:.0f}% | {verdict(None if frac is None else frac < SCHED_TARGET)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    d = Path(args[0])
    text = report(d)
    print(text)
    (d / "summary.md").write_text(text)
    print(f"wrote {d / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
