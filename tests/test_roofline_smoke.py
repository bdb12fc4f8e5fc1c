"""Smoke run of benchmarks/roofline.py: every part of a step (GEMMs, attention, the LM head) is
timed, by the C++ stack's part clocks and the LM head's, in bf16 and int4, at one batch size. Speed
is never asserted."""

from __future__ import annotations

import json
from pathlib import Path

from bench_helpers import run_benchmark

from nanovllm.builtin_model import ensure_default_model


def test_every_part_of_the_step_is_timed(tmp_path: Path) -> None:
    model = ensure_default_model()
    out = tmp_path / "roofline.json"
    stdout = run_benchmark("roofline.py", ["--model", str(model), "--variants", "bf16,int4", "--batch", "2",
                                            "--context", "16", "--steps", "2", "--repeats", "1", "--json", str(out)],
                           tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [("bf16", 2), ("int4", 2)]
    for r in rows:  # a clock no call passes through any more reads 0 ms
        assert r["parts_timed_by"] == "stack"
        assert r["gemm_flops_s"] > 0 and r["bandwidth_bytes_s"] > 0  # each row's own, probed before its steps
        assert all(r["parts_ms"][part] > 0 for part in ("gemm", "attention", "lm_head")), r["parts_ms"]
        assert sum(r["parts_ms"][part] for part in ("gemm", "attention", "lm_head")) < r["step_ms"]
        # The 16-token prompts' one prefill step and two decode steps, then two timed steps that read
        # 19 and 20 keys: the floor counts the KV cache those read, not the prompt's 16.
        assert r["context"] == 19.5
    assert "| int4 | 2 |" in stdout
