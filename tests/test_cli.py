"""The `nanovllm` command line: `generate` prints the greedy completion, `bench` runs the
throughput workload and reports tokens/s, and bad input exits with a clear error."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from nanovllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("cli"), "qwen3")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nanovllm.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parent)


def test_generate_prints_the_greedy_completion(model_dir: Path) -> None:
    prompt = "Hello there"
    res = run_cli("generate", "--model", str(model_dir), "--prompt", prompt, "--max-tokens", "12",
                  "--num-kvcache-blocks", "64", "--max-model-len", "256", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=64, max_model_len=256)
    expected = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    assert res.stdout == expected + "\n"


def test_bench_reports_throughput(model_dir: Path) -> None:
    res = run_cli("bench", "--model", str(model_dir), "--num-seqs", "6", "--max-input-len", "40",
                  "--max-output-len", "20", "--num-kvcache-blocks", "128", "--max-model-len", "256", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    m = re.search(r"Total: (\d+) output tokens in [\d.]+s, Throughput: ([\d.]+) tok/s", res.stdout)
    assert m is not None, res.stdout
    assert int(m.group(1)) > 0 and float(m.group(2)) > 0


def test_bad_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    res = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert res.returncode == 2
    assert "model directory not found" in res.stderr and "Traceback" not in res.stderr
