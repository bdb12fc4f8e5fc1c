"""Running a benchmark script as a user does, for the benchmarks' smoke tests (speed is never
asserted: docs/design.md, "Performance rules")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run_benchmark(script: str, args: list[str], cwd: Path, timeout: int = 300) -> str:
    """benchmarks/`script` with `args`, its stdout; it must exit 0. Run from `cwd`, a temporary
    directory: the script's own directory, not the source tree, is first on sys.path, so it imports
    the installed package with its compiled core."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
