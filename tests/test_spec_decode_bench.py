"""Smoke run of benchmarks/spec_decode.py on a tiny model, our engine only: every configuration
runs and the record holds the workload's tokens and acceptance figures that add up, and (--paired)
each speculative row also timed the same waves without speculation.

Speed is never asserted (docs/design.md, "Performance rules"). The draft model is the target
itself, so greedy verification accepts (nearly) every drafted token; the prompts repeat one line,
so the n-gram proposer has a match from the first decode step on.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from bench_helpers import BENCHMARKS, run_benchmark
from tiny_models import TINY_SPECS

from nanovllm.builtin_model import create_model_dir

SCRIPT = BENCHMARKS / "spec_decode.py"
K, BATCHES, MAX_TOKENS, NUM_REQUESTS = 2, (1, 2), 12, 2
LINE = "    total = total + values[index] * weights[index]\n"


def load_script() -> ModuleType:
    """The benchmark as a module (its sibling compare_vllm on the path, as when run)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("spec_decode_bench", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("spec_bench")
    model = create_model_dir(tmp / "qwen3", spec=TINY_SPECS["qwen3"])
    files = []
    for i in range(3):
        files.append(tmp / f"f{i}.py")
        files[-1].write_text(f"def f{i}(values, weights):\n    total = 0\n" + LINE * 12)
    out = tmp / "spec.json"
    stdout = run_benchmark("spec_decode.py", [
        "--engines", "nanovllm", "--model", str(model), "--draft-model", str(model), "--files", *map(str, files),
        "--ks", str(K), "--batches", ",".join(map(str, BATCHES)), "--max-tokens", str(MAX_TOKENS),
        "--num-requests", str(NUM_REQUESTS), "--min-prompt-tokens", "8", "--max-prompt-tokens", "64", "--paired",
        "--json", str(out)], tmp, timeout=600)
    assert "| engine | method |" in stdout, stdout
    return json.loads(out.read_text())


def test_every_configuration_ran(record: dict) -> None:
    configs = {(c["engine"], c["method"], c["k"]): c for c in record["configurations"]}
    assert set(configs) == {("nanovllm", "none", 0), ("nanovllm", "ngram", K), ("nanovllm", "draft_model", K)}
    failed = {key: c["error"] for key, c in configs.items() if c["error"] is not None}
    assert not failed, failed
    assert configs[("nanovllm", "ngram", K)]["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert configs[("nanovllm", "draft_model", K)]["speculative_config"] == {
        "method": "draft_model", "model": record["draft_model"], "num_speculative_tokens": K}
    assert configs[("nanovllm", "none", 0)]["speculative_config"] is None


def test_rows_count_the_workload(record: dict) -> None:
    rows = record["rows"]
    assert sorted((r["method"], r["batch"]) for r in rows) == sorted(
        (m, b) for m in ("none", "ngram", "draft_model") for b in BATCHES)
    for r in rows:
        assert r["requests"] == max(r["batch"], NUM_REQUESTS)
        assert r["output_tokens"] == r["requests"] * MAX_TOKENS, r
        assert r["tok_s"] == pytest.approx(r["output_tokens"] / r["seconds"])
        assert 0 < r["latency_p50_s"] <= r["seconds"] and 0 < r["latency_mean_s"] <= r["seconds"], r
        assert r["ours_over_vllm"] is None  # vLLM was not run
        base = next(b for b in rows if b["method"] == "none" and b["batch"] == r["batch"])
        assert r["speedup"] == pytest.approx(r["tok_s"] / base["tok_s"])


def test_acceptance_figures_add_up(record: dict) -> None:
    assert {r["method"] for r in record["rows"]} == {"none", "ngram", "draft_model"}
    for r in record["rows"]:
        if r["method"] == "none":
            assert (r["drafts"], r["draft_tokens"], r["accepted_tokens"]) == (0, 0, 0), r
            assert r["acceptance_rate"] is None and r["mean_accepted_length"] is None
            continue
        # The draft model (the target itself) drafts at every decode step of every request; n-gram
        # drafts need the random model's own output to repeat, so they may be few.
        if r["method"] == "draft_model":
            assert r["drafts"] >= r["requests"], r
        assert r["drafts"] <= r["draft_tokens"] <= K * r["drafts"], r
        assert 0 <= r["accepted_tokens"] <= r["draft_tokens"], r
        # Each verification emits its accepted drafts plus one token, and no more than the workload.
        assert r["drafts"] + r["accepted_tokens"] <= r["output_tokens"], r
        if r["drafts"]:
            assert r["acceptance_rate"] == pytest.approx(r["accepted_tokens"] / r["draft_tokens"])
            assert r["mean_accepted_length"] == pytest.approx(1 + r["accepted_tokens"] / r["drafts"])
        else:
            assert r["acceptance_rate"] is None and r["mean_accepted_length"] is None
        per_pos = r["accepted_per_pos"]
        assert len(per_pos) == K and sum(per_pos) == r["accepted_tokens"], r
        assert all(a >= b for a, b in itertools.pairwise(per_pos)), per_pos  # position i+1 needs i
        if r["method"] == "draft_model":  # the target drafting for itself: greedy agrees but at ties
            assert r["acceptance_rate"] >= 0.9, r


def test_prompts_are_windows_of_whole_lines(tmp_path: Path) -> None:
    """Each file's first lines come first, then each file's next lines; bounds hold; no overlap."""
    bench = load_script()

    class CharTokenizer:  # one token per character: window sizes are easy to predict
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("".join(f"a{i:03d}\n" for i in range(10)))  # 10 lines of 5 characters
    b.write_text("b000\n" + "x" * 40 + "\nb002\n")  # a line longer than the window, then a short tail
    prompts = bench.completion_prompts([a, b], CharTokenizer(), 5, min_tokens=6, max_tokens=12)
    text = ["".join(map(chr, p)) for p in prompts]
    # b's first window is one line of 5 < 6 tokens: skipped; its long line is cut to the window.
    assert text == ["a000\na001\n", "x" * 12, "a002\na003\n", "a004\na005\n", "a006\na007\n"]
    with pytest.raises(SystemExit, match="only 6 windows"):
        bench.completion_prompts([a, b], CharTokenizer(), 7, min_tokens=6, max_tokens=12)


def test_paired_rows_also_ran_the_waves_without_speculation(record: dict) -> None:
    for r in record["rows"]:
        if r["method"] == "none":
            assert "paired_speedup" not in r
            continue
        assert r["paired_none_tok_s"] > 0, r
        assert r["paired_none_draft_tokens"] == 0, r  # the base engine did not speculate
        assert r["draft_tokens"] > 0 or r["method"] == "ngram", r  # the speculating one did (draft model: always)
        # Both engines produced the workload's tokens: the ratio of seconds is the ratio of tok/s.
        assert r["paired_speedup"] == pytest.approx(r["tok_s"] / r["paired_none_tok_s"]), r
