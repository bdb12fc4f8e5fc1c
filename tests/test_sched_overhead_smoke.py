"""Smoke run of benchmarks/sched_overhead.py: it runs and writes well-formed records.

Speed is never asserted in tests (docs/design.md, "Performance rules"); the benchmark reports it.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench_helpers import run_benchmark

SCENARIOS = {"decode", "prefill", "prefill_prefix_hit", "mixed"}
INT_FIELDS = ("num_seqs", "block_size", "context_len")
US_FIELDS = ("us_schedule", "us_postprocess", "us_to_torch", "us_total")


def test_quick_run_writes_every_scenario(tmp_path: Path) -> None:
    out = tmp_path / "records.json"
    stdout = run_benchmark("sched_overhead.py", ["--quick", "--json", str(out)], tmp_path)
    assert "| scenario |" in stdout and "## Targets" in stdout

    records = json.loads(out.read_text())
    assert isinstance(records, list) and records
    for r in records:
        assert r["scenario"] in SCENARIOS, r
        for name in INT_FIELDS:
            assert isinstance(r[name], int) and r[name] > 0, (name, r)
        for name in US_FIELDS:
            assert isinstance(r[name], (int, float)) and r[name] >= 0, (name, r)
    assert {r["scenario"] for r in records} == SCENARIOS

    decode = {(r["num_seqs"], r["block_size"], r["context_len"])
              for r in records if r["scenario"] == "decode"}
    assert decode == {(n, bs, ctx) for n in (64, 256, 1024) for bs in (16, 256) for ctx in (1024, 4096)}
    for r in records:
        if r["scenario"].startswith("prefill"):
            assert (r["num_seqs"], r["context_len"]) == (64, 1024), r
            assert r["us_add"] is not None, r
        if r["scenario"] == "mixed":
            assert r["num_seqs"] == 256, r
