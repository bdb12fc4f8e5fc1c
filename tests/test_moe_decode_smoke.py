"""Smoke run of benchmarks/moe_decode.py on a tiny Qwen3-MoE model: its mixture-of-experts layers
are timed and their experts counted (the engine runs the layers as one C++ call, which the meter
cannot see, so the benchmark times its MoE part on the Python layers). Speed is never asserted."""

from __future__ import annotations

import json
from pathlib import Path

from bench_helpers import run_benchmark
from moe_models import make_moe_model


def test_the_moe_layers_are_timed_and_their_experts_counted(tmp_path: Path) -> None:
    model = make_moe_model(tmp_path, "qwen3_moe")
    out = tmp_path / "moe_decode.json"
    run_benchmark("moe_decode.py", ["--model", str(model), "--num-seqs", "4", "--prompt-len", "8", "--steps", "2",
                                    "--max-model-len", "256", "--json", str(out)], tmp_path)
    record = json.loads(out.read_text())
    assert record["step ms"] > 0 and record["MoE ms"] > 0
    read, total = (int(n) for n in record["experts read / step"].split(" of "))
    assert 0 < read <= total == 8 * 2  # 8 experts in each of the model's 2 layers
    assert record["MB read / step"] > 0
