"""Scheduler overhead: the C++ core driven alone (no model), median microseconds per step.

Scenarios (docs/design.md, "The step"; the issue's targets are in `check_targets`):
- decode: N sequences in steady-state decode (64 / 256 / 1024), block size 16 / 256, context
  about 1024 / 4096. A step is `schedule()` + `postprocess()` with one sampled token per
  sequence; the plan -> torch conversion (`nanovllm.worker.plan_tensors.PlanTensors`, the code
  the model runner uses) is timed separately.
- prefill: 64 prompts of 1024 tokens admitted in one step, on a fresh scheduler; `prefill` has no
  shared prefix, `prefill_prefix_hit` shares a 512-token prefix already in the prefix cache.
  `us_add` is the time of the 64 `add()` calls, which happen outside the step.
- mixed: 256 decoding sequences while one 8192-token prompt arrives and is chunk-prefilled under a
  2048-token budget; the steps that carry a prefill chunk are timed.

Each timed call is bracketed by `time.perf_counter_ns()`; columns are medians over the timed
steps, and `us_total` is the median of each step's schedule + postprocess. `us_to_torch` is the
runner's conversion as shipped (views cached by length, so repeated batch shapes are cheap);
`us_to_torch_nocache` is the same conversion building every view afresh, i.e. the cost of a
step whose shape was not seen before. A step runs one of the two, alternately, right after its
schedule() as the runner would. Every configuration runs once per round, rounds in turn, so
noise from other processes on a shared machine spreads over all rows; the header says how busy
other processes kept the machine.

Usage: python benchmarks/sched_overhead.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np
import torch

from bench_report import cpu_busy_seconds, machine, markdown_table, write_json

from nanovllm._C import Scheduler, StepPlan

try:
    from nanovllm.worker.plan_tensors import PlanTensors
except ImportError as e:  # the installed package predates plan_tensors.py
    sys.exit(f"{e}: reinstall the package (pip install --no-build-isolation .) so it includes "
             "nanovllm.worker.plan_tensors")

VOCAB = 32000
# One max_model_len for every decode configuration, so that context 1024 and 4096 differ only in
# the sequences' lengths, not in the plan's block-table stride.
MAX_MODEL_LEN = 8192
# Prefill budget while bringing decode scenarios to steady state (not timed).
WARMUP_BUDGET = 16384
SCENARIOS = ("decode", "prefill", "prefill_prefix_hit", "mixed")
ns = time.perf_counter_ns


@dataclass
class Record:
    scenario: str
    num_seqs: int
    block_size: int
    context_len: int
    us_schedule: float
    us_postprocess: float
    us_to_torch: float
    us_total: float  # median over steps of schedule + postprocess
    us_to_torch_nocache: float
    us_add: float | None  # add() of the arriving requests, outside the step; None for decode
    us_total_p90: float
    steps: int  # timed steps (or repetitions, for prefill)
    tokens_per_step: int  # median scheduled tokens in a timed step
    context_mean: float | None  # measured mean context of the decoding batch mid-run


@dataclass
class Timings:
    """Per-step nanoseconds of each timed part."""

    schedule: list[int] = field(default_factory=list)
    postprocess: list[int] = field(default_factory=list)
    to_torch: list[int] = field(default_factory=list)
    to_torch_nocache: list[int] = field(default_factory=list)
    add: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    context_mean: float | None = None  # mean context of the batch mid-run (decode, mixed)

    def merge(self, other: Timings) -> None:
        for name in ("schedule", "postprocess", "to_torch", "to_torch_nocache", "add", "tokens"):
            getattr(self, name).extend(getattr(other, name))
        if self.context_mean is None:
            self.context_mean = other.context_mean

    def record(self, scenario: str, num_seqs: int, block_size: int, context_len: int) -> Record:
        def us(xs: list[int]) -> float:
            return round(statistics.median(xs) / 1000, 2)

        total = [s + p for s, p in zip(self.schedule, self.postprocess)]
        p90 = sorted(total)[min(len(total) - 1, int(0.9 * len(total)))]
        return Record(
            scenario=scenario, num_seqs=num_seqs, block_size=block_size, context_len=context_len,
            us_schedule=us(self.schedule), us_postprocess=us(self.postprocess),
            us_to_torch=us(self.to_torch), us_total=us(total),
            us_to_torch_nocache=us(self.to_torch_nocache),
            us_add=us(self.add) if self.add else None, us_total_p90=round(p90 / 1000, 2),
            steps=len(total), tokens_per_step=int(statistics.median(self.tokens)),
            context_mean=None if self.context_mean is None else round(self.context_mean, 1),
        )


class Converters:
    """The runner's conversion, cached (as shipped) and uncached, bound to one scheduler's plan."""

    def __init__(self) -> None:
        self.cached: PlanTensors | None = None
        self.uncached: PlanTensors | None = None
        self.plan: StepPlan | None = None
        self.address = 0

    def bind(self, plan: StepPlan) -> None:
        # Once per scheduler, untimed: wrapping the buffer is a setup cost, not a step cost.
        if self.cached is None:
            self.cached = PlanTensors(plan)
            self.uncached = PlanTensors(plan, cache_views=False)
            self.plan = plan
            self.address = plan.buffer.ctypes.data

    def check_stable(self, plan: StepPlan) -> None:
        # The conversion relies on the plan being one persistent object over one buffer.
        if plan is not self.plan or plan.buffer.ctypes.data != self.address:
            raise RuntimeError("StepPlan object or buffer moved between steps")


def timed_step(sched: Scheduler, conv: Converters, sampled: np.ndarray, t: Timings,
               cached: bool = True) -> StepPlan:
    """One schedule + conversion + postprocess, in the engine's order, each part timed.

    A step runs one conversion, the cached one or the uncached one, as a runner would: running
    both would let the second find caches warmed by the first.
    """
    t0 = ns()
    plan = sched.schedule()
    t1 = ns()
    conv.bind(plan)
    converter = conv.cached if cached else conv.uncached
    assert converter is not None
    t2 = ns()
    converter.views(plan)
    t3 = ns()
    # Sized outside the timers: a runner's sampler hands over exactly num_samples ids.
    k = plan.num_samples
    tokens = sampled if k == sampled.shape[0] else sampled[:k]
    t4 = ns()
    sched.postprocess(tokens)
    t5 = ns()
    if plan is not conv.plan:
        raise RuntimeError("schedule() returned a new StepPlan object")
    t.schedule.append(t1 - t0)
    (t.to_torch if cached else t.to_torch_nocache).append(t3 - t2)
    t.postprocess.append(t5 - t4)
    t.tokens.append(plan.num_tokens)
    return plan


def untimed_step(sched: Scheduler, sampled: np.ndarray) -> StepPlan:
    plan = sched.schedule()
    sched.postprocess(sampled[: plan.num_samples])
    return plan


def random_prompts(rng: np.random.Generator, n: int, length: int) -> np.ndarray:
    # Uniform ids over a 32k vocabulary: distinct prompts share no full block in practice.
    return rng.integers(0, VOCAB, size=(n, length), dtype=np.int32)


def sampled_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n, dtype=np.int32)


def warm_to_decode(sched: Scheduler, sampled: np.ndarray, conv: Converters) -> None:
    """Steps until every sequence has finished its prompt and decodes."""
    while True:
        plan = untimed_step(sched, sampled)
        conv.bind(plan)
        if sched.num_waiting == 0 and plan.num_prefill_tokens == 0:
            return


def bench_decode(n: int, block_size: int, context: int, steps: int, warm: int, seed: int) -> Timings:
    rng = np.random.default_rng(seed)
    # Sequences admitted early in the warm-up decode while later ones still prefill, so contexts
    # spread over about `spread` tokens; prompts are shortened so that the timed steps straddle
    # `context` on average (the record carries the measured mean).
    spread = math.ceil(n * context / WARMUP_BUDGET)
    prompt_len = context - warm - steps // 2 - spread // 2
    if prompt_len < 1:
        raise ValueError(f"context {context} is too short for {warm} + {steps} decode steps")
    final_len = prompt_len + spread + warm + steps + 2
    blocks_per_seq = math.ceil(final_len / block_size) + 1
    sched = Scheduler(
        num_blocks=n * blocks_per_seq + 64, block_size=block_size, max_num_seqs=n,
        max_num_batched_tokens=WARMUP_BUDGET, max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB,
    )
    for i, prompt in enumerate(random_prompts(rng, n, prompt_len)):
        sched.add(i, prompt, max_tokens=1 << 30, ignore_eos=True)
    sampled = sampled_tokens(rng, n)
    conv = Converters()
    warm_to_decode(sched, sampled, conv)
    for _ in range(warm):
        untimed_step(sched, sampled)
    t = Timings()
    for i in range(steps):
        plan = timed_step(sched, conv, sampled, t, cached=(i + seed) % 2 == 0)
        if plan.num_tokens != n or plan.num_decode_tokens != n:
            raise RuntimeError(f"decode step scheduled {plan.num_tokens} tokens for {n} sequences")
        if i == steps // 2:
            # Read after the step's postprocess: the arrays still hold this step's plan.
            t.context_mean = float(plan.context_lens.mean())
    conv.check_stable(plan)
    if sched.num_preemptions:
        raise RuntimeError("decode scenario preempted: pool too small")
    return t


def bench_prefill(block_size: int, prefix_hit: bool, reps: int, seed: int) -> Timings:
    n, length, shared = 64, 1024, 512
    rng = np.random.default_rng(seed)
    sampled = sampled_tokens(rng, n)
    t = Timings()
    for rep in range(reps + 1):  # repetition 0 warms allocator and caches, not recorded
        # A fresh scheduler each repetition: nothing cached but what the scenario puts there.
        sched = Scheduler(
            num_blocks=(n + 2) * math.ceil((length + 1) / block_size) + 16, block_size=block_size,
            max_num_seqs=n, max_num_batched_tokens=n * length, max_model_len=MAX_MODEL_LEN,
            vocab_size=VOCAB,
        )
        # The runner's converter lives as long as the engine, so it exists before the requests
        # arrive: bind it on an empty step, whose plan object every later step returns.
        conv = Converters()
        conv.bind(untimed_step(sched, sampled))
        if prefix_hit:
            prefix = random_prompts(rng, 1, shared)[0]
            # One request with the prefix runs its prefill and finishes, leaving the prefix's
            # blocks cached and free.
            first = np.concatenate([prefix, random_prompts(rng, 1, length - shared)[0]])
            sched.add(10_000, first, max_tokens=1, ignore_eos=True)
            untimed_step(sched, sampled)
            if sched.has_unfinished():
                raise RuntimeError("prefix-warming request did not finish")
            hits_before = sched.stats()["prefix_cache_hits"]
            tails = random_prompts(rng, n, length - shared)
            prompts = [np.concatenate([prefix, tail]).tolist() for tail in tails]
        else:
            prompts = random_prompts(rng, n, length).tolist()
        # Python lists, as a tokenizer hands them over.
        t0 = ns()
        for i, prompt in enumerate(prompts):
            sched.add(i, prompt, max_tokens=16, ignore_eos=True)
        t1 = ns()
        rt = Timings()
        plan = timed_step(sched, conv, sampled, rt, cached=(rep + seed) % 2 == 0)
        computed = n * (length - shared) if prefix_hit else n * length
        if plan.num_seqs != n or plan.num_samples != n or plan.num_prefill_tokens != computed:
            raise RuntimeError(f"prefill step scheduled {plan.num_seqs} sequences, "
                               f"{plan.num_prefill_tokens} tokens; expected {n}, {computed}")
        if prefix_hit and sched.stats()["prefix_cache_hits"] - hits_before != n * shared:
            raise RuntimeError("the shared prefix was not served from the prefix cache")
        conv.check_stable(plan)
        if rep > 0:
            rt.add.append(t1 - t0)
            t.merge(rt)
    return t


def bench_mixed(reps: int, seed: int) -> Timings:
    n, block_size, context, long_len, budget = 256, 16, 1024, 8192, 2048
    rng = np.random.default_rng(seed)
    prompt_len = context - 64
    # Decodes grow by one token a step: warm-up (~130 steps at this budget) plus ~6 per rep.
    final_len = prompt_len + 400 + 8 * reps
    sched = Scheduler(
        num_blocks=n * math.ceil(final_len / block_size) + 2 * math.ceil(long_len / block_size) + 64,
        block_size=block_size, max_num_seqs=2 * n, max_num_batched_tokens=budget,
        max_model_len=2 * long_len, vocab_size=VOCAB,
    )
    for i, prompt in enumerate(random_prompts(rng, n, prompt_len)):
        sched.add(i, prompt, max_tokens=1 << 30, ignore_eos=True)
    sampled = sampled_tokens(rng, n + 1)
    conv = Converters()
    warm_to_decode(sched, sampled, conv)
    t = Timings()
    for rep in range(reps):
        long_id = 100_000 + rep
        prompt = random_prompts(rng, 1, long_len)[0].tolist()
        t0 = ns()
        sched.add(long_id, prompt, max_tokens=1 << 30, ignore_eos=True)
        t.add.append(ns() - t0)
        while True:
            rt = Timings()
            plan = timed_step(sched, conv, sampled, rt, cached=(len(t.schedule) + seed) % 2 == 0)
            if plan.num_prefill_tokens == 0:
                break  # the prompt is done: this step was decode only, not recorded
            if t.context_mean is None:
                t.context_mean = float(plan.context_lens[: plan.num_decode_tokens].mean())
            t.merge(rt)
        # Free its blocks so every repetition starts from the same 256 decodes.
        sched.abort(long_id)
    conv.check_stable(plan)
    if sched.num_preemptions:
        raise RuntimeError("mixed scenario preempted: pool too small")
    return t


# --- targets --------------------------------------------------------------------------------

@dataclass
class Check:
    name: str
    value: float
    limit: float
    unit: str

    @property
    def ok(self) -> bool:
        return self.value <= self.limit


def check_targets(records: list[Record]) -> list[Check]:
    checks: list[Check] = []
    decode = {(r.num_seqs, r.block_size, r.context_len): r for r in records if r.scenario == "decode"}
    r = decode.get((256, 16, 1024))
    if r:
        checks.append(Check("decode 256 seqs, bs 16, ctx 1024: us_total", r.us_total, 20, "us"))
    for r in records:
        checks.append(Check(f"{r.scenario} {r.num_seqs} seqs, bs {r.block_size}, ctx {r.context_len}: "
                            "us_to_torch", r.us_to_torch, 15, "us"))
    for (n, bs, ctx), r in sorted(decode.items()):
        if n == 1024:
            checks.append(Check(f"decode 1024 seqs, bs {bs}, ctx {ctx}: us_total", r.us_total, 80, "us"))
    for (n, bs, ctx), r in sorted(decode.items()):
        short = decode.get((n, bs, 1024))
        if ctx == 4096 and short:
            checks.append(Check(f"decode {n} seqs, bs {bs}: us_total ctx 4096 / ctx 1024",
                                round(r.us_total / short.us_total, 2), 1.3, "x"))
    for r in records:
        if r.scenario.startswith("prefill"):
            name = f"{r.scenario} 64 x 1024, bs {r.block_size}: us_total"
            checks.append(Check(name, r.us_total, 500, "us"))
    return checks


# --- output -----------------------------------------------------------------------------------

COLUMNS = ("scenario", "num_seqs", "block_size", "context_len", "us_schedule", "us_postprocess",
           "us_to_torch", "us_total", "us_to_torch_nocache", "us_add", "us_total_p90", "steps",
           "context_mean")


def table(records: list[Record]) -> str:
    def cell(v: object) -> str:
        if v is None:
            return "-"
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    return markdown_table((asdict(r) for r in records), COLUMNS, cell)


def machine_line() -> str:
    return machine(torch=torch.__version__, numpy=np.__version__)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few steps: a smoke run, timings not meaningful")
    ap.add_argument("--json", metavar="PATH", help="write the records as a JSON list")
    args = ap.parse_args(argv)

    # Per configuration and round; rounds run every configuration in turn, so that a noisy
    # stretch on a shared machine spreads over all rows instead of spoiling one.
    steps, warm, prefill_reps, mixed_reps, rounds = (20, 3, 2, 2, 1) if args.quick else (400, 50, 20, 10, 5)
    # (scenario, num_seqs, block_size, context_len) -> a run taking the round as its seed.
    configs: list[tuple[tuple[str, int, int, int], Callable[[int], Timings]]] = []
    for n in (64, 256, 1024):
        for bs in (16, 256):
            for ctx in (1024, 4096):
                configs.append((("decode", n, bs, ctx), partial(bench_decode, n, bs, ctx, steps, warm)))
    for hit in (False, True):
        for bs in (16, 256):
            configs.append((("prefill_prefix_hit" if hit else "prefill", 64, bs, 1024),
                            partial(bench_prefill, bs, hit, prefill_reps)))
    configs.append((("mixed", 256, 16, 1024), partial(bench_mixed, mixed_reps)))

    merged = {key: Timings() for key, _ in configs}
    busy0, own0, start = cpu_busy_seconds(), time.process_time(), time.time()
    for r in range(rounds):
        for key, run in configs:
            merged[key].merge(run(r))
    busy1, own1, elapsed = cpu_busy_seconds(), time.process_time(), time.time() - start
    # Other processes share the machine (and caches); how busy they kept it is part of the
    # context of any number below.
    background = ""
    if busy0 is not None and busy1 is not None:
        others = max(0.0, (busy1 - busy0) - (own1 - own0))
        background = f", other processes kept {others / elapsed:.2f} CPUs busy"
    records = [merged[key].record(*key) for key, _ in configs]

    print(f"# Scheduler overhead ({'quick smoke run, timings not meaningful' if args.quick else 'full run'})")
    print(f"machine: {machine_line()}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {rounds} round(s) in {elapsed:.1f} s"
          f"{background}\n")
    print("median microseconds per step (us_total = schedule + postprocess)\n")
    print(table(records))
    print("\n## Targets\n")
    checks = check_targets(records)
    for c in checks:
        print(f"- {'PASS' if c.ok else 'FAIL'}  {c.name} = {c.value:g} {c.unit} (limit {c.limit:g} {c.unit})")
    # Not a target: what a step whose shape the view cache has not seen costs.
    for label, rows in (("decode and mixed", [r for r in records if not r.scenario.startswith("prefill")]),
                        ("prefill", [r for r in records if r.scenario.startswith("prefill")])):
        if rows:
            worst = max(rows, key=lambda r: r.us_to_torch_nocache)
            print(f"- info  us_to_torch_nocache, {label} rows: at most {worst.us_to_torch_nocache:g} us "
                  f"({worst.scenario} {worst.num_seqs} seqs, bs {worst.block_size}, ctx {worst.context_len})")
    failed = [c for c in checks if not c.ok]
    note = " (quick run: not meaningful)" if args.quick else ""
    print(f"\n{len(checks) - len(failed)} of {len(checks)} targets met{note}")
    if args.json:
        write_json(args.json, [asdict(r) for r in records])
    # A benchmark reports; it does not fail on speed (docs/design.md, "Performance rules").
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
