"""Detokenization cost per decode step: one `Detokenizer.process()` call against per-sequence decoding.

A step gives each of N sequences (256) one new token; each sequence already has CONTEXT (512)
generated tokens. Methods, all producing each sequence's new text (delta) for the step:

- `ours`: `nanovllm._core.Detokenizer.process(keys, tokens)`, one call for the whole batch
  (`ours+stop`: the same with two stop strings per sequence that never match, so every step also
  searches and holds back).
- `windowed`: the incremental scheme engines have long used (vLLM's `detokenize_incrementally`):
  per sequence, `convert_ids_to_tokens` of the new id, then `convert_tokens_to_string` of the
  tokens from `prefix_offset` and from `prefix_offset` to `read_offset` (about 5-6 tokens), delta =
  the difference unless it ends in U+FFFD.
- `decode_stream`: tokenizers' own incremental decoder (`tokenizers.decoders.DecodeStream.step`),
  one Python call per sequence.
- `full`: `tokenizer.decode(all ids so far)` per sequence, delta = the new suffix.

Tokenizers: the built-in model's (`nanovllm.builtin_model.ensure_default_model()`, byte-level
BPE, 4096 ids) and a byte-level BPE with 32000 ids trained here in ~2 s on the Python standard
library's sources (a realistic vocabulary size and token length distribution for code). The token
streams are that source text encoded by each tokenizer, a different slice per sequence.

Timing: each timed step is bracketed by `time.perf_counter_ns()` with the garbage collector off;
we report the median and p90 over steps. Methods run in rounds, one after another, so noise on a
shared machine spreads over all rows. After the run, every sequence's text from `ours` (deltas +
`flush()`) is checked against `tokenizer.decode(all ids)`.

Usage: python benchmarks/detokenize.py [--quick] [--json PATH] [--num-seqs N] [--context C]
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import random
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from bench_report import machine, markdown_table, write_json

from nanovllm._core import Detokenizer
from nanovllm.token_table import build_token_table

ns = time.perf_counter_ns
# Stop strings that do not occur in the benchmark text (checked): the search runs, never matches.
NO_MATCH_STOPS = ("<|no-such-stop|>", "\n\n\n\n\n\n")


@dataclass
class Record:
    tokenizer: str
    vocab: int
    method: str
    num_seqs: int
    context: int
    us_per_step: float  # median over timed steps, whole batch
    us_per_step_p90: float
    ns_per_seq: float  # us_per_step / num_seqs, in ns
    x_slower_than_ours: float
    steps: int
    exact: bool | None  # texts equal tokenizer.decode(all ids)? (checked for ours only)


def corpus_text(limit_chars: int = 8_000_000) -> list[str]:
    """Python standard library sources (some non-ASCII in docstrings and tests)."""
    root = sysconfig.get_paths()["stdlib"]
    out, size = [], 0
    for f in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        if "site-packages" in f:
            continue
        try:
            with open(f, encoding="utf-8") as fh:
                s = fh.read()
        except (OSError, UnicodeDecodeError):
            continue
        out.append(s)
        size += len(s)
        if size >= limit_chars:
            break
    return out


def train_large_tokenizer(texts: list[str], vocab_size: int = 32000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def make_streams(tok, texts: list[str], num_seqs: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    joined = "\n".join(texts)
    streams = []
    while len(streams) < num_seqs:
        start = rng.randrange(0, len(joined) - 20 * length)
        ids = tok.encode(joined[start : start + 12 * length], add_special_tokens=False)
        if len(ids) >= length:
            streams.append(ids[:length])
    return streams


# ------------------------------------------------------------------------------------ methods
# Each returns (prepare, step, finish): prepare() sets up the state with the context tokens
# (untimed), step(t) runs step t for all sequences (timed), finish() returns the texts.


def method_ours(table, streams, context, stops=()):
    n = len(streams)
    keys = np.arange(n, dtype=np.int64)
    arr = np.array(streams, dtype=np.int32)
    per_step = [np.ascontiguousarray(arr[:, context + t]) for t in range(arr.shape[1] - context)]
    state = {}

    def prepare():
        d = Detokenizer(table)
        for k in range(n):
            d.add(k, skip_special_tokens=True, stop=stops)
        ctx = np.ascontiguousarray(arr[:, :context]).reshape(-1)
        cu = np.arange(0, n * context + 1, context, dtype=np.int64)
        state["d"] = d
        state["texts"] = [delta for _, delta, _ in d.process(keys, ctx, cu)]

    def step(t):
        return state["d"].process(keys, per_step[t])

    def finish(results):
        texts = state["texts"]
        for res in results:
            for k, delta, _ in res:
                texts[k] += delta
        return [texts[k] + state["d"].flush(k) for k in range(n)]

    return prepare, step, finish


def method_full(tok, streams, context):
    state = {}

    def prepare():
        state["prev"] = [tok.decode(s[:context], skip_special_tokens=True) for s in streams]

    def step(t):
        prev = state["prev"]
        out = []
        for k, s in enumerate(streams):
            new = tok.decode(s[: context + t + 1], skip_special_tokens=True)
            out.append(new[len(prev[k]) :])
            prev[k] = new
        return out

    return prepare, step, None


def method_windowed(tok, streams, context):
    """vLLM's former `detokenize_incrementally` (prefix/read offsets over token strings)."""
    state = {}
    convert_ids = tok.convert_ids_to_tokens
    to_string = tok.convert_tokens_to_string

    def prepare():
        toks, pref, read = [], [], []
        for s in streams:
            t = convert_ids(s[:context], skip_special_tokens=True)
            toks.append(t)
            pref.append(max(len(t) - 5, 0))
            read.append(len(t))
        state.update(toks=toks, pref=pref, read=read)

    def step(t):
        toks, pref, read = state["toks"], state["pref"], state["read"]
        out = []
        for k, s in enumerate(streams):
            new_tokens = convert_ids([s[context + t]], skip_special_tokens=True)
            output = toks[k]
            output.extend(new_tokens)
            prefix_text = to_string(output[pref[k] : read[k]])
            new_text = to_string(output[pref[k] :])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                out.append(new_text[len(prefix_text) :])
                pref[k] = read[k]
                read[k] = len(output)
            else:
                out.append("")
        return out

    return prepare, step, None


def method_decode_stream(tok, streams, context):
    from tokenizers.decoders import DecodeStream

    backend = tok.backend_tokenizer
    state = {}

    def prepare():
        streams_ = []
        for s in streams:
            ds = DecodeStream(skip_special_tokens=True)
            for i in s[:context]:
                ds.step(backend, i)
            streams_.append(ds)
        state["ds"] = streams_

    def step(t):
        return [ds.step(backend, s[context + t]) for ds, s in zip(state["ds"], streams)]

    return prepare, step, None


def run(
    name: str, tok, texts: list[str], num_seqs: int, context: int, steps: int, rounds: int, seed: int
) -> list[Record]:
    table = build_token_table(tok)
    streams = make_streams(tok, texts, num_seqs, context + steps, seed)
    for s in streams:
        text = tok.decode(s)
        assert not any(x in text for x in NO_MATCH_STOPS)
    methods: dict[str, Callable] = {
        "ours": lambda: method_ours(table, streams, context),
        "ours+stop": lambda: method_ours(table, streams, context, NO_MATCH_STOPS),
        "windowed": lambda: method_windowed(tok, streams, context),
        "decode_stream": lambda: method_decode_stream(tok, streams, context),
        "full": lambda: method_full(tok, streams, context),
    }
    # The full decode is O(context) per sequence; fewer steps keep the run short.
    method_steps = {m: (max(steps // 4, 4) if m == "full" else steps) for m in methods}
    times: dict[str, list[int]] = {m: [] for m in methods}
    exact: dict[str, bool | None] = {m: None for m in methods}
    for _ in range(rounds):
        for m, make in methods.items():
            prepare, step, finish = make()
            prepare()
            results = []
            gc.collect()
            gc.disable()
            try:
                for t in range(method_steps[m]):
                    t0 = ns()
                    res = step(t)
                    times[m].append(ns() - t0)
                    results.append(res)
            finally:
                gc.enable()
            if finish is not None and method_steps[m] == steps:
                got = finish(results)
                ok = all(g == tok.decode(s, skip_special_tokens=True) for g, s in zip(got, streams))
                exact[m] = ok if exact[m] is None else (exact[m] and ok)
    base = statistics.median(times["ours"]) / 1e3
    records = []
    for m in methods:
        med = statistics.median(times[m]) / 1e3
        p90 = sorted(times[m])[int(0.9 * (len(times[m]) - 1))] / 1e3
        records.append(
            Record(
                tokenizer=name,
                vocab=len(table),
                method=m,
                num_seqs=num_seqs,
                context=context,
                us_per_step=round(med, 1),
                us_per_step_p90=round(p90, 1),
                ns_per_seq=round(med * 1e3 / num_seqs, 1),
                x_slower_than_ours=round(med / base, 1),
                steps=len(times[m]),
                exact=exact[m],
            )
        )
    return records


COLUMNS = [
    "tokenizer", "vocab", "method", "num_seqs", "context", "us_per_step", "us_per_step_p90",
    "ns_per_seq", "x_slower_than_ours", "steps", "exact",
]


def table_md(records: list[Record]) -> str:
    return markdown_table((asdict(r) for r in records), COLUMNS)


def machine_line() -> str:
    import tokenizers
    import transformers

    return machine(tokenizers=tokenizers.__version__, transformers=transformers.__version__)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few steps: a smoke run, timings not meaningful")
    ap.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokenizer", choices=["builtin", "large", "all"], default="all")
    args = ap.parse_args(argv)
    steps, rounds = (8, 1) if args.quick else (64, 3)

    from transformers import AutoTokenizer

    texts = corpus_text(2_000_000 if args.quick else 8_000_000)
    tokenizers_ = []
    if args.tokenizer in ("builtin", "all"):
        from nanovllm.builtin_model import BUILTIN_NAME, ensure_default_model

        tokenizers_.append((BUILTIN_NAME, lambda: AutoTokenizer.from_pretrained(ensure_default_model())))
    if args.tokenizer in ("large", "all"):
        tokenizers_.append(("bpe-32k (stdlib)", lambda: train_large_tokenizer(texts)))
    print(f"machine: {machine_line()}")
    print(f"{args.num_seqs} sequences, context {args.context}, one new token each per step\n")
    records: list[Record] = []
    for name, load in tokenizers_:
        t0 = time.perf_counter()
        tok = load()
        t1 = time.perf_counter()
        build_token_table(tok)
        t2 = time.perf_counter()
        print(f"{name}: tokenizer {t1 - t0:.2f} s, build_token_table {1e3 * (t2 - t1):.1f} ms")
        records += run(name, tok, texts, args.num_seqs, args.context, steps, rounds, seed=0)
    print()
    print(table_md(records))
    print()
    ok = True
    for name, _ in tokenizers_:
        rows = {r.method: r for r in records if r.tokenizer == name}
        ratio = rows["windowed"].us_per_step / rows["ours"].us_per_step
        passed = ratio >= 10 and rows["ours"].exact
        ok &= bool(passed)
        print(
            f"{'PASS' if passed else 'FAIL'}  {name}: windowed / ours = {ratio:.1f}x (target >= 10x), "
            f"ours exact = {rows['ours'].exact}"
        )
    if args.json:
        write_json(args.json, [asdict(r) for r in records])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
