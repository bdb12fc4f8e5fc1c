"""scripts/gpu_check.sh as a dry run on the CPU: what the GPU machine does before any GPU work
(install carried wheels into a --target directory, put it first on PYTHONPATH, the preflight
import check) and the report it always leaves, so that the one lent GPU session does not find a
broken script. The wheel is made here (a pure-Python package the preflight is told to require);
without it the preflight must stop the check and name the module."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"
PROBE = "nanovllm_gpu_check_probe"


def make_wheel(directory: Path, name: str = PROBE, version: str = "1.0") -> Path:
    """A minimal valid wheel of one module, `name`, whose import prints nothing and defines VALUE."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for arcname, text in files.items():
            data = text.encode()
            z.writestr(arcname, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arcname},sha256={digest},{len(data)}")
        z.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
    return path


def dry_run(tmp_path: Path, wheels: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    results = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--skip-tests", "--skip-bench", "--skip-suite", "--wheels", str(wheels),
         "--site", str(tmp_path / "site"), "--require", PROBE, "--results", str(results), "--deadline", "300"],
        cwd=REPO, capture_output=True, text=True, timeout=400, env=env)
    return proc, results


def steps(results: Path) -> dict[str, str]:
    return {line.split("\t")[0]: line.split("\t")[1] for line in (results / "status.tsv").read_text().splitlines()}


@pytest.mark.skipif(not SCRIPT.is_file(), reason="run from a source checkout")
def test_dry_run_installs_wheels_then_preflight_passes(tmp_path: Path) -> None:
    make_wheel(tmp_path / "whl")
    proc, results = dry_run(tmp_path, tmp_path / "whl")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / PROBE / "__init__.py").is_file()  # installed into the --target
    assert steps(results) == {"wheels": "0", "preflight": "0"}
    preflight = json.loads((results / "preflight.json").read_text())
    assert preflight["missing"] == {}
    # The sources' own needs were found, beside the module asked for.
    assert {PROBE, "torch", "transformers", "xgrammar", "fastapi", "pytest"} <= set(preflight["required"])
    summary = (results / "summary.md").read_text()
    assert "DRY RUN" in summary and "all import" in summary and "wheels ok" in summary


@pytest.mark.skipif(not SCRIPT.is_file(), reason="run from a source checkout")
def test_dry_run_preflight_stops_and_names_the_missing_module(tmp_path: Path) -> None:
    make_wheel(tmp_path / "whl", name="some_other_package")
    proc, results = dry_run(tmp_path, tmp_path / "whl")
    assert proc.returncode == 3
    assert f"MISSING {PROBE}" in proc.stdout and "preflight failed: 1 missing" in proc.stdout
    assert steps(results) == {"wheels": "0", "preflight": "1"}  # nothing after the preflight ran
    assert f"MISSING {PROBE}" in (results / "summary.md").read_text()
