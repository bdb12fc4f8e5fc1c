#!/usr/bin/env bash
# The wheels the GPU machine lacks, for scripts/gpu_check.sh to install there (it has no package
# index). Run here, on a machine that reaches PyPI:
#
#   scripts/gpu_wheels.sh [DIR]        (default DIR: .whl, git-ignored)
#
# It starts from the package's runtime requirements and its `test` and `serve` extras
# (pyproject.toml), drops what the device image already holds (scripts/gpu_image_packages.txt,
# from the device tool's list of the image's packages) and what is only a build tool, then fetches
# each missing distribution as a CPython 3.12 manylinux x86-64 (or pure Python) wheel and follows
# its own requirements (markers evaluated for Python 3.12 on Linux x86-64) the same way: one
# version of each, the version installed here where there is one (the one the tests ran with),
# else the newest. It ends with the set's size; a call may carry 64 MiB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-$(command -v python3 || command -v python)}
mkdir -p "$DIR"
"$PY" - "$DIR" <<'EOF'
import importlib.metadata as md
import pathlib
import re
import subprocess
import sys
import tomllib
import zipfile

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

out = pathlib.Path(sys.argv[1])
image = {canonicalize_name(line.split("#")[0].strip())
         for line in pathlib.Path("scripts/gpu_image_packages.txt").read_text().splitlines() if line.split("#")[0].strip()}
# Build tools (the image builds the package with its own) and what must come from the image.
SKIP = {canonicalize_name(n) for n in ("torch", "triton", "cmake", "ninja", "pybind11", "cython", "nanovllm")}
PLATFORMS = ["manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
ENV = default_environment()
ENV.update(python_version="3.12", python_full_version="3.12.3", implementation_name="cpython",
           platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
           platform_machine="x86_64", os_name="posix")

project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
wanted = list(project["dependencies"])
for extra in ("test", "serve"):
    wanted += project["optional-dependencies"][extra]


def applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate({**ENV, "extra": ""})


def fetch(req: Requirement) -> pathlib.Path:
    name = canonicalize_name(req.name)
    try:
        local = md.version(req.name)
    except md.PackageNotFoundError:
        local = None
    if local is not None and req.specifier.contains(local, prereleases=True):
        spec = f"{req.name}=={local}"
    else:
        spec = f"{req.name}{req.specifier}"
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + ["-d", str(out), spec], check=True)
    found = [w for w in out.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) == name]
    if len(found) != 1:
        raise SystemExit(f"expected one wheel of {name} in {out}, found {[w.name for w in found]}")
    return found[0]


def requirements(wheel: pathlib.Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = [Requirement(v) for k, v in re.findall(r"^(Requires-Dist): (.+)$", text, re.M)]
    return [r for r in reqs if applies(r)]


seen: dict[str, pathlib.Path] = {}
queue = [Requirement(r) for r in wanted]
while queue:
    req = queue.pop(0)
    name = canonicalize_name(req.name)
    if not applies(req) or name in SKIP or name in image or name in seen:
        continue
    wheel = seen[name] = fetch(req)
    print(f"{wheel.name}  (for {req})")
    queue += requirements(wheel)

stale = [w for w in out.glob("*.whl") if canonicalize_name(w.name.split("-")[0]) not in seen]
for w in stale:
    print(f"removing {w.name}: no longer needed")
    w.unlink()
total = sum(w.stat().st_size for w in seen.values())
print(f"{len(seen)} wheels, {total / 2**20:.1f} MiB in {out}")
if total > 48 * 2**20:
    raise SystemExit("the wheel set is over 48 MiB: with the working tree it would not fit the 64 MiB a call carries")
EOF
