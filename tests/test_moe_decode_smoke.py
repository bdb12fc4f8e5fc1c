"""Smoke run of benchmarks/moe_decode.py on a tiny Qwen3-MoE model: its mixture-of-experts layers
are timed and their experts counted (the engine runs the layers as one C++ call, which the meter
cannot see, so the benchmark times its MoE part on the Python layers). Speed is never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from moe_models import make_moe_model

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "moe_decode.py"


def test_the_moe_layers_are_timed_and_their_experts_counted(tmp_path: Path) -> None:
    model = make_moe_model(tmp_path, "qwen3_moe")
    out = tmp_path / "moe_decode.json"
    cmd = [sys.executable, str(SCRIPT), "--model", str(model), "--num-seqs", "4", "--prompt-len", "8",
           "--steps", "2", "--max-model-len", "256", "--json", str(out)]
    # From tmp: the installed package with its compiled core, not the source tree.
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert record["step ms"] > 0 and record["MoE ms"] > 0
    read, total = (int(n) for n in record["experts read / step"].split(" of "))
    assert 0 < read <= total == 8 * 2  # 8 experts in each of the model's 2 layers
    assert record["MB read / step"] > 0
