"""Smoke run of benchmarks/sched_overhead.py: it runs and writes well-formed records.

Speed is never asserted in tests (docs/design.md, "Performance rules"); the benchmark reports it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "sched_overhead.py"
SCENARIOS = {"decode", "prefill", "prefill_prefix_hit", "mixed"}
INT_FIELDS = ("num_seqs", "block_size", "context_len")
US_FIELDS = ("us_schedule", "us_postprocess", "us_to_torch", "us_total")


def test_quick_run_writes_every_scenario(tmp_path: Path) -> None:
    out = tmp_path / "records.json"
    # Run from tmp_path: the script's own directory, not the source tree, is first on sys.path,
    # so it imports the installed package with its compiled core.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| scenario |" in proc.stdout and "## Targets" in proc.stdout

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
