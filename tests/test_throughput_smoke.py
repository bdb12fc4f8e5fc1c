"""Smoke run of benchmarks/throughput.py with --compare-hf: it runs and writes a well-formed record.

Speed is never asserted in tests (docs/design.md, "Performance rules"); the benchmark reports it. What
is checked is that both sides counted exactly the workload's output tokens.
"""

from __future__ import annotations

import json

import pytest
from bench_helpers import run_benchmark

from nanovllm.builtin_model import BUILTIN_SPEC, ensure_default_model
from nanovllm.entrypoints.bench import make_workload

# Tiny: 4 sequences, both length ranges lowered from [100, ...] so the run takes seconds.
NUM_SEQS, MIN_LEN, MAX_IN, MAX_OUT, BATCH, SEED = 4, 8, 24, 16, 3, 0


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict:
    ensure_default_model()  # created once here rather than inside the timed subprocess
    tmp = tmp_path_factory.mktemp("throughput")
    out = tmp / "throughput.json"
    stdout = run_benchmark("throughput.py", [
        "--num-seqs", str(NUM_SEQS), "--min-len", str(MIN_LEN), "--max-input-len", str(MAX_IN),
        "--max-output-len", str(MAX_OUT), "--max-num-seqs", str(BATCH), "--seed", str(SEED), "--device", "cpu",
        "--compare-hf", "--no-tqdm", "--json", str(out)], tmp)
    assert "| nanovllm |" in stdout and "| transformers generate |" in stdout, stdout
    return json.loads(out.read_text())


def test_schema(record: dict) -> None:
    for name in ("engine_tok_s", "hf_tok_s", "ratio", "engine_seconds", "hf_seconds"):
        assert isinstance(record[name], float) and record[name] > 0, (name, record[name])
    assert record["ratio"] == pytest.approx(record["engine_tok_s"] / record["hf_tok_s"])
    assert (record["num_seqs"], record["min_len"], record["max_input_len"], record["max_output_len"],
            record["max_num_seqs"]) == (NUM_SEQS, MIN_LEN, MAX_IN, MAX_OUT, BATCH)
    assert record["device"] == "cpu" and record["dtype"] == "float32"
    assert isinstance(record["threads"], int) and record["threads"] >= 1
    for side in ("engine", "hf"):
        s = record[side]
        assert s["seconds"] == record[f"{side}_seconds"]
        assert s["tok_s"] == pytest.approx(s["output_tokens"] / s["seconds"])
    # 4 prompts in static batches of 3: two batches.
    assert record["hf"]["num_batches"] == 2


def test_both_sides_count_the_workloads_tokens(record: dict) -> None:
    w = make_workload(NUM_SEQS, MAX_IN, MAX_OUT, BUILTIN_SPEC.vocab_size, seed=SEED, min_len=MIN_LEN)
    assert record["workload_output_tokens"] == w.num_output_tokens
    assert record["workload_prompt_tokens"] == w.num_prompt_tokens
    for side in ("engine", "hf"):
        assert record[side]["output_tokens"] == w.num_output_tokens, side
        assert record[side]["prompt_tokens"] == w.num_prompt_tokens, side
    # transformers decodes every row of a static batch to the batch's longest output and pads
    # prompts to the batch's longest prompt; that work is reported but not counted.
    batches = [range(i, min(i + BATCH, NUM_SEQS)) for i in range(0, NUM_SEQS, BATCH)]
    generated = sum(len(b) * max(w.output_lens[i] for i in b) for b in batches)
    padded = sum(len(b) * max(len(w.prompts[i]) for i in b) for b in batches)
    assert record["hf"]["generated_tokens"] == generated
    assert record["hf"]["padded_prompt_tokens"] == padded
