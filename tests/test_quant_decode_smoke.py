"""Smoke run of benchmarks/quant_decode.py: bf16, int8 and int4 take turns and each round times
each variant once. Speed is never asserted (the benchmark reports it)."""

from __future__ import annotations

import json
from pathlib import Path

from bench_helpers import run_benchmark

from nanovllm.builtin_model import ensure_default_model


def test_every_variant_is_timed_every_round(tmp_path: Path) -> None:
    model = ensure_default_model()
    out = tmp_path / "quant_decode.json"
    stdout = run_benchmark("quant_decode.py", ["--model", str(model), "--batch", "2", "--prompt-len", "16",
                                               "--output-len", "4", "--rounds", "3", "--json", str(out)], tmp_path)
    record = json.loads(out.read_text())
    assert set(record["median_ms"]) == {"bf16", "int8", "int4"}
    assert all(len(ts) == 3 and all(t > 0 for t in ts) for ts in record["step_ms"].values())
    assert "| int4 |" in stdout
