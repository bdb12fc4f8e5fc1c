"""docs/design.md describes the code as it is: every source file under nanovllm/, csrc/ and kernels/
is named in it (its Layout section lists each by name), so a file added without a word on its job
fails here. A name counts when it appears as written (`model_runner.py`), or as its stem with `.*`
for a C++ header/source pair (`block_pool.*`); package `__init__.py` and `__main__.py` files count
when the doc names them for their package (`worker/__init__.py`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "design.md"
SOURCE_DIRS = ("nanovllm", "csrc", "kernels")
SUFFIXES = {".py", ".pyx", ".pyi", ".h", ".cpp", ".cu", ".cuh"}


def source_files() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (REPO / d).rglob("*")
                  if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts)


def named(path: Path, text: str) -> bool:
    rel = path.relative_to(REPO)
    if path.name in ("__init__.py", "__main__.py"):
        # Named with its package: "worker/__init__.py"; the top package's as "nanovllm/__init__.py".
        return f"{rel.parent.name}/{path.name}" in text
    pattern = rf"(?<![\w.]){re.escape(path.name)}(?![\w])|(?<![\w.]){re.escape(path.stem)}\.\*"
    return re.search(pattern, text) is not None


@pytest.mark.skipif(not DOC.is_file(), reason="run from a source checkout")
def test_every_source_file_is_named_in_the_design() -> None:
    files = source_files()
    assert len(files) > 80  # the tree, not an empty directory
    text = DOC.read_text()
    missing = [str(p.relative_to(REPO)) for p in files if not named(p, text)]
    assert not missing, "docs/design.md does not name: " + ", ".join(missing)


def test_the_check_tells_named_from_unnamed() -> None:
    text = "csrc/ block_pool.* and `model_runner.py`; worker/__init__.py"
    assert named(REPO / "csrc" / "block_pool.cpp", text)
    assert named(REPO / "nanovllm" / "worker" / "model_runner.py", text)
    assert named(REPO / "nanovllm" / "worker" / "__init__.py", text)
    assert not named(REPO / "nanovllm" / "engine" / "__init__.py", text)
    assert not named(REPO / "nanovllm" / "worker" / "runner.py", text)  # a substring is not a name
    assert not named(REPO / "csrc" / "pool.h", text)
