"""Smoke run of benchmarks/profile_cpu_step.py: the parts of a decode step under their labels, and
the engine's own step (the layer stack, unprofiled) beside them. Speed is never asserted."""

from __future__ import annotations

import json
from pathlib import Path

from bench_helpers import run_benchmark

from nanovllm.builtin_model import ensure_default_model


def test_parts_and_the_engines_own_step_are_reported(tmp_path: Path) -> None:
    model = ensure_default_model()
    out = tmp_path / "profile.json"
    stdout = run_benchmark("profile_cpu_step.py", ["--model", str(model), "--num-seqs", "2", "--prompt-len", "16",
                                                   "--steps", "2", "--json", str(out)], tmp_path)
    report = json.loads(out.read_text())
    assert report["parts_ms"]["gemm"] > 0 and report["parts_ms"]["attention"] > 0, report["parts_ms"]
    assert report["engine_step_ms"] > 0
    assert "the engine's own decode step" in stdout
