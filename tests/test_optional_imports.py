"""Optional dependencies stay optional: without xgrammar (structured output) and the web stack
(`serve`), `import nanovllm`, the CLI's parser and `LLM(...).generate(...)` work, and asking for
structured output says what is missing. Each case runs in a fresh interpreter whose import system
refuses those modules, as on a machine where they are not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tiny_models import make_tiny_model

OPTIONAL = ("xgrammar", "fastapi", "uvicorn", "starlette", "pydantic", "jsonschema", "prometheus_client", "openai")

BLOCKER = textwrap.dedent(f"""
    import sys
    BLOCKED = {OPTIONAL!r}

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)

    sys.meta_path.insert(0, Blocker())
    sys.path[:] = [p for p in sys.path if p not in ("", ".")]
""")


def run_without_optional(code: str, tmp_path: Path) -> str:
    script = tmp_path / "case.py"
    script.write_text(BLOCKER + textwrap.dedent(code))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_blocker_blocks(tmp_path: Path) -> None:
    out = run_without_optional("""
        for name in BLOCKED:
            try:
                __import__(name)
            except ImportError:
                print("blocked", name)
    """, tmp_path)
    assert out.split() == [w for name in OPTIONAL for w in ("blocked", name)]


def test_generate_and_cli_without_optional_modules(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path, "qwen3")
    out = run_without_optional(f"""
        import nanovllm
        from nanovllm import LLM, SamplingParams, StructuredOutputsParams
        from nanovllm.entrypoints.cli import build_parser

        build_parser().parse_args(["serve", "--port", "1"])
        llm = LLM({str(model)!r}, device="cpu", num_kvcache_blocks=32, max_model_len=256)
        outs = llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(temperature=0, max_tokens=4),
                            SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=4, logprobs=2, n=2)],
                            use_tqdm=False)
        print("tokens", [len(c.token_ids) for o in outs for c in o.outputs])
        try:
            llm.generate([[1, 2]], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+")),
                         use_tqdm=False)
        except ValueError as e:
            print("structured:", e)
        loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set(BLOCKED))
        print("loaded", loaded)
    """, tmp_path)
    assert "tokens [4, 4, 4]" in out
    assert "structured: structured output needs the xgrammar package" in out
    assert "loaded []" in out
