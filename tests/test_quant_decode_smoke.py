"""Smoke run of benchmarks/quant_decode.py: bf16, int8 and int4 take turns and each round times
each variant once. Speed is never asserted (the benchmark reports it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from nanovllm.builtin_model import ensure_default_model

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "quant_decode.py"


def test_every_variant_is_timed_every_round(tmp_path: Path) -> None:
    model = ensure_default_model()
    out = tmp_path / "quant_decode.json"
    cmd = [sys.executable, str(SCRIPT), "--model", str(model), "--batch", "2", "--prompt-len", "16",
           "--output-len", "4", "--rounds", "3", "--json", str(out)]
    # From tmp: the installed package with its compiled core, not the source tree.
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert set(record["median_ms"]) == {"bf16", "int8", "int4"}
    assert all(len(ts) == 3 and all(t > 0 for t in ts) for ts in record["step_ms"].values())
    assert "| int4 |" in proc.stdout
