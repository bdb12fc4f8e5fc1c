"""The `nanovllm` command line: `generate` prints the greedy completion, `bench` runs the
throughput workload and reports tokens/s, and bad input exits with a clear error."""

from __future__ import annotations

import json
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


def assert_generate_prints_greedy(model_dir: Path, prompt: str, max_tokens: int, *extra: str) -> None:
    """`generate` (with `extra` options) prints exactly LLM's greedy completion of the prompt."""
    res = run_cli("generate", "--model", str(model_dir), "--prompt", prompt, "--max-tokens", str(max_tokens),
                  "--num-kvcache-blocks", "64", "--max-model-len", "256", "--device", "cpu", *extra)
    assert res.returncode == 0, res.stderr
    llm = LLM(str(model_dir), device="cpu", num_kvcache_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    assert res.stdout == expected + "\n"


def test_generate_prints_the_greedy_completion(model_dir: Path) -> None:
    assert_generate_prints_greedy(model_dir, "Hello there", 12)


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


def test_engine_flags_come_from_the_one_declaration_of_options() -> None:
    """Every EngineConfig option is a flag of each command, with the option's default and help,
    and nothing else reaches the engine; LLM() takes exactly the same names."""
    import dataclasses

    from nanovllm.config import EngineConfig
    from nanovllm.entrypoints.cli import _engine_kwargs, build_parser

    options = {f.name: f for f in EngineConfig.options() if f.name != "model"}
    one_machine = {name for name, f in options.items() if not f.metadata["serve_only"]}
    parser = build_parser()
    for command, names in ((["bench"], one_machine), (["generate", "--prompt", "p"], one_machine),
                           (["serve"], set(options))):
        kwargs = _engine_kwargs(parser.parse_args(command))
        assert set(kwargs) == names, command  # the several-machines options are serve's alone
        assert all(kwargs[name] == options[name].default for name in names), command
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    help_text = sub.choices["serve"].format_help()
    for name, f in options.items():
        assert "--" + name.replace("_", "-") in help_text
        assert f.metadata["help"].split(" (")[0][:30] in " ".join(help_text.split()), name
    args = parser.parse_args(["bench", "--max-num-seqs", "7", "--no-enable-prefix-caching", "--dtype", "float32",
                              "-tp", "2", "--enforce-eager"])
    kwargs = _engine_kwargs(args)
    assert (kwargs["max_num_seqs"], kwargs["enable_prefix_caching"], kwargs["dtype"], kwargs["tensor_parallel_size"],
            kwargs["enforce_eager"]) == (7, False, "float32", 2, True)
    assert _engine_kwargs(parser.parse_args(["bench", "--no-prefix-caching"]))["enable_prefix_caching"] is False
    with pytest.raises(TypeError, match="unknown engine option 'max_num_seq'"):
        LLM("unused", max_num_seq=3)
    assert dataclasses.replace(EngineConfig(model="m", **kwargs)).parallel.tensor_parallel_size == 2


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
PROMPT = "ab ab ab ab ab ab ab ab ab"


def test_generate_with_speculative_config(model_dir: Path) -> None:
    assert_generate_prints_greedy(model_dir, PROMPT, 24, "--speculative-config", json.dumps(SPEC))


def test_bad_speculative_config_names_the_field(model_dir: Path) -> None:
    res = run_cli("generate", "--model", str(model_dir), "--prompt", "x", "--device", "cpu",
                  "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}')
    assert res.returncode != 0
    assert "speculative_config.num_speculative_tokens" in res.stderr and "Traceback" not in res.stderr
