"""Shared test setup.

The tests exercise the installed package, with its compiled modules (`nanovllm._C`), never the
bare source tree that `python -m pytest` would otherwise put first on sys.path.
"""

import sys
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _REPO_ROOT]
