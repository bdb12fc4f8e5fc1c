"""Per-step cost of grammar-constrained rows in the sampling package, next to the same step
unconstrained.

A step here is what the sampling package does for N rows of random logits: `SamplingState.process`
(logits processors; for constrained rows the bitmask fill and the one masking call), the sampler,
and `SamplingState.record` (for constrained rows: the matchers accept their tokens). The same N
rows run once unconstrained and once each constrained by a JSON schema (and by json_object); a
matcher whose grammar finished is restarted, so every step has N live matchers. The vocabulary is
a byte-level BPE tokenizer trained by nanovllm.builtin_model with `--vocab` tokens.

    plain_us        median step time, no row constrained
    constrained_us  median step time, every row constrained
    extra_us        constrained_us - plain_us
    mask_us         median time of the bitmask fill + apply alone (GrammarRows.mask)
    record_us       median time of SamplingState.record in the constrained steps (the matchers
                    accept their tokens)

Usage: python benchmarks/structured.py [--num-rows 16 64 256] [--vocab 4096 32000] [--steps 100]
           [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_report import machine, markdown_table, write_json  # noqa: E402

from nanovllm import SamplingParams, StructuredOutputsParams  # noqa: E402
from nanovllm.builtin_model import build_tokenizer  # noqa: E402
from nanovllm.sample import Sampler, SamplingState  # noqa: E402
from nanovllm.sample.grammar import GrammarCompiler  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "email"],
}
SPECS = {"json_schema": StructuredOutputsParams(json=SCHEMA), "json_object": StructuredOutputsParams(json_object=True)}


def run(state: SamplingState, sampler: Sampler, sids: np.ndarray, vocab: int, steps: int,
        grammar: xgr.CompiledGrammar | None) -> tuple[float, float, float]:
    """Median microseconds of a whole step, of the masking alone (0 when unconstrained) and of
    `record`."""
    params = SamplingParams(temperature=0.0)  # greedy: the cheapest sampler, so the grammar's share shows
    for sid in sids.tolist():
        state.add(sid, params, [1, 2, 3], grammar)
    mask_times: list[float] = []
    grammars = state.grammars
    real_mask = grammars.mask

    def timed_mask(*args: Any) -> None:
        t = time.perf_counter()
        real_mask(*args)
        mask_times.append(time.perf_counter() - t)

    grammars.mask = timed_mask  # type: ignore[method-assign]
    times, record_times = [], []
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        logits = torch.randn(len(sids), vocab, generator=gen)
        t = time.perf_counter()
        processed = state.process(logits, sids, keep_input=False)  # as the runner does without logprobs
        tokens = sampler(processed, state.batch(sids))
        t_record = time.perf_counter()
        ends = state.record(sids, tokens, tokens.numpy())
        end = time.perf_counter()
        times.append(end - t)
        record_times.append(end - t_record)
        for sid in ends.terminated + ends.rejected:  # a finished output: start a new one
            grammars.matchers[sid].reset()
    grammars.mask = real_mask  # type: ignore[method-assign]
    for sid in sids.tolist():
        state.remove(sid)
    mask_us = statistics.median(mask_times) * 1e6 if mask_times else 0.0
    return statistics.median(times) * 1e6, mask_us, statistics.median(record_times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-rows", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--vocab", type=int, nargs="+", default=[4096, 32000])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    records = []
    for vocab in args.vocab:
        tokenizer = build_tokenizer(vocab)
        compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
        for kind, spec in SPECS.items():
            t = time.perf_counter()
            grammar = compiler.compile(spec).compiled
            compile_ms = (time.perf_counter() - t) * 1e3
            for n in args.num_rows:
                state = SamplingState(torch.device("cpu"), vocab, [tokenizer.eos_token_id])
                sampler = Sampler()
                sids = np.arange(n)
                run(state, sampler, sids, vocab, 5, None)  # warm-up
                plain, _, _ = run(state, sampler, sids, vocab, args.steps, None)
                constrained, mask, record = run(state, sampler, sids, vocab, args.steps, grammar)
                records.append(dict(vocab=vocab, grammar=kind, rows=n, compile_ms=round(compile_ms, 1),
                                    plain_us=round(plain), constrained_us=round(constrained),
                                    extra_us=round(constrained - plain), mask_us=round(mask),
                                    record_us=round(record)))
                print(records[-1], flush=True)
    versions = dict(torch=torch.__version__, xgrammar=importlib.metadata.version("xgrammar"))
    print(f"\nMachine: {machine(**versions)}")
    print(markdown_table(records, ["vocab", "grammar", "rows", "compile_ms", "plain_us", "constrained_us",
                                   "extra_us", "mask_us", "record_us"]))
    if args.json:
        write_json(args.json, {"machine": machine(**versions), "records": records})


if __name__ == "__main__":
    main()
