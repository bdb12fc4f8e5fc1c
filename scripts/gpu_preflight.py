"""Preflight of the GPU check: can this Python import everything the package, its server, the tests
and the benchmarks need? Run before anything is built or timed, so that a machine without a
package index stops at once with the whole list of what is missing (one run then fixes it), not
one module at a time minutes into the run.

The modules are read from the sources themselves (every `import` in nanovllm/, tests/ and
benchmarks/), less the standard library and the project's own modules. An import inside a `try`
that catches ImportError is optional (flash-attn, say): its absence is reported, not fatal.
`--also MOD` adds modules the sources do not name. Exit status: 0 when every required module
imports, 1 otherwise.

Usage: python scripts/gpu_preflight.py [--root DIR] [--also MOD ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
from pathlib import Path

SOURCE_DIRS = ("nanovllm", "tests", "benchmarks")
# Imported only in the child process a benchmark starts in vLLM's own environment.
ELSEWHERE = {"vllm"}
_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in _IMPORT_ERRORS for n in names)


def imported_modules(path: Path) -> tuple[set[str], set[str]]:
    """Top-level names `path` imports: (required, optional)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    required: set[str] = set()
    optional: set[str] = set()

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.Try):
            inner = guarded or any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                visit(child, inner)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, guarded)
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            (optional if guarded else required).add(name.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return required, optional - required


def needed_modules(root: Path) -> tuple[set[str], set[str]]:
    """(required, optional) third-party modules of the project's sources under `root`."""
    local = {"nanovllm"}
    files: list[Path] = []
    for d in SOURCE_DIRS:
        for path in sorted((root / d).rglob("*.py")):
            files.append(path)
            local.add(path.stem)  # tests and benchmarks import their helpers by file name
    local |= {p.name for p in (root / "tests").iterdir() if p.is_dir()}
    required: set[str] = set()
    optional: set[str] = set()
    for path in files:
        req, opt = imported_modules(path)
        required |= req
        optional |= opt
    skip = set(sys.stdlib_module_names) | local | ELSEWHERE | {"__future__"}
    return required - skip, optional - required - skip


def try_import(name: str) -> str | None:
    """None if `name` imports, else why not (the first line of the error)."""
    try:
        importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001  (a broken install raises anything)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    p.add_argument("--also", nargs="*", default=[], help="more modules to require")
    p.add_argument("--json", default=None, help="write the result here too")
    args = p.parse_args(argv)
    required, optional = needed_modules(Path(args.root))
    required |= set(args.also)
    missing = {name: why for name in sorted(required) if (why := try_import(name)) is not None}
    absent = sorted(name for name in optional if try_import(name) is not None)
    print(f"preflight: {len(required)} modules required, {len(required) - len(missing)} import; "
          f"optional and absent: {', '.join(absent) or 'none'}")
    for name, why in missing.items():
        print(f"  MISSING {name}: {why}")
    if missing:
        print(f"preflight failed: {len(missing)} missing: {' '.join(missing)} "
              "(fetch their wheels with scripts/gpu_wheels.sh and carry .whl)")
    if args.json:
        Path(args.json).write_text(json.dumps({"required": sorted(required), "missing": missing,
                                               "optional_absent": absent}, indent=2) + "\n")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
