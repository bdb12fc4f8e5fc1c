"""`builtin-code`: the small code model shipped with the package, and its draft.

scripts/train_tiny_model.py trains both on the Python standard library's own sources (present on
every machine) and writes them under nanovllm/builtin_models/. The files it keeps out of training
are chosen by a fixed rule on their path under the standard library (`is_heldout`), so a held-out
file is never trained on, whichever Python's library the script read; `heldout_files()` lists the
ones that exist here, for evaluation and for the speculative-decoding benchmark's prompts.

The names `builtin-code` and `builtin-code-draft` work wherever a model directory does
(`resolve_builtin`: `LLM(model=...)`, every command's `--model`, a tokenizer).
"""

from __future__ import annotations

import json
import os
import sysconfig
import zlib
from pathlib import Path

BUILTIN_CODE = "builtin-code"
BUILTIN_CODE_DRAFT = "builtin-code-draft"
MODELS_DIR = Path(__file__).resolve().parent / "builtin_models"
# Written beside the target model: the split (the held-out files, the training files' count).
SPLIT_FILE = "stdlib_split.json"

# One file in HELDOUT_MODULUS is held out: those whose path's CRC-32 is 0 modulo it.
HELDOUT_MODULUS = 16
# Directories whose files are not the library's own ordinary code: tests (and their deliberately
# broken data files), installed packages, the IDE and demos, vendored wheels, generated tables
# (codecs' character maps, pydoc's help text).
EXCLUDED_DIRS = frozenset({
    "test", "tests", "site-packages", "dist-packages", "idlelib", "turtledemo", "ensurepip",
    "encodings", "pydoc_data", "__phello__", "__pycache__",
})


def builtin_code_dir() -> Path:
    """The trained target model's directory (Hugging Face format)."""
    return MODELS_DIR / "code"


def builtin_code_draft_dir() -> Path:
    """The trained draft model's directory: 1 layer, the target's tokenizer."""
    return MODELS_DIR / "code-draft"


def resolve_builtin(name_or_dir: str | os.PathLike[str]) -> str:
    """A model directory for `name_or_dir`: the shipped model's for the names `builtin-code` and
    `builtin-code-draft` (a local directory of that name is `./builtin-code`), anything else as
    given."""
    name = os.fspath(name_or_dir)
    if name == BUILTIN_CODE:
        return str(builtin_code_dir())
    if name == BUILTIN_CODE_DRAFT:
        return str(builtin_code_draft_dir())
    return name


def stdlib_root() -> Path:
    """This Python's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """Whether the file at `relpath` (POSIX path under the standard library) is kept out of training."""
    return zlib.crc32(relpath.encode("utf-8")) % HELDOUT_MODULUS == 0


def stdlib_sources(root: Path | None = None) -> tuple[list[str], list[str]]:
    """The standard library's `.py` files as sorted POSIX paths under `root` (default: this
    Python's), split into (training, held-out)."""
    root = root or stdlib_root()
    paths = sorted(
        rel for p in root.rglob("*.py")
        if p.is_file()
        and not EXCLUDED_DIRS.intersection((rel := p.relative_to(root).as_posix()).split("/")[:-1])
        and not rel.startswith("config-")
    )
    return [p for p in paths if not is_heldout(p)], [p for p in paths if is_heldout(p)]


def heldout_files() -> list[Path]:
    """Absolute paths of the held-out files (recorded when the model was trained) that exist in
    this Python's standard library, sorted."""
    split = json.loads((builtin_code_dir() / SPLIT_FILE).read_text(encoding="utf-8"))
    root = stdlib_root()
    return [root / rel for rel in split["heldout"] if (root / rel).is_file()]
