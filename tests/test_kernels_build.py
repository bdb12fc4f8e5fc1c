"""The CUDA kernels build, and the built module loads, on machines without a GPU.

CI has nvcc but no GPU. `pip install .` compiles kernels/ there (a kernel that does not compile
fails the install); these tests make sure that build was not silently skipped, that the module
imports and answers without a driver, and they compile the current sources for sm_90 directly, so a
kernel edited after the last install cannot slip through either.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
KERNELS = REPO / "kernels"
SOURCES = sorted(KERNELS.glob("*.cu"))


def find_nvcc() -> str | None:
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"),
                      os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def cuda_build_disabled() -> bool:
    return os.environ.get("NANOVLLM_CUDA", "").strip().upper() in ("OFF", "0", "FALSE", "NO", "N")


def load_kernels():
    try:
        return importlib.import_module("nanovllm._kernels")
    except ImportError:
        return None


def test_kernels_built_where_nvcc_exists() -> None:
    if find_nvcc() is None:
        pytest.skip("no nvcc on this machine: the CUDA kernels are not built here")
    if cuda_build_disabled():
        pytest.skip("NANOVLLM_CUDA=OFF")
    assert load_kernels() is not None, (
        "nvcc is installed but nanovllm._kernels is missing: the build skipped the kernels "
        "(see CMakeLists.txt, 'CUDA kernels'); reinstall with `pip install --no-build-isolation .`")


def test_kernels_module_imports_and_answers_without_a_gpu() -> None:
    k = load_kernels()
    if k is None:
        pytest.skip("nanovllm._kernels is not built")
    assert "sm_90" in k.build_targets().split(",")
    assert k.cuda_runtime_version() >= 11080  # compute_90 needs CUDA 11.8+
    assert k.heads_per_cta() == 8
    assert [d for d in (8, 16, 32, 48, 64, 80, 128, 256, 512) if k.supports_head_dim(d)] == [16, 32, 64, 128, 256]
    # Empty launches return before touching the CUDA runtime.
    k.cache_write(0, 0, 0, 0, 0, 0, 1, 64, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0)
    k.paged_decode(*([0] * 20), 0, 8, 8, 64, 16, 1, 2, 1.0, 0)


def test_launch_errors_surface_as_exceptions() -> None:
    k = load_kernels()
    if k is None:
        pytest.skip("nanovllm._kernels is not built")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU (the launch would really run)")
    # No driver: the launch fails cleanly (RuntimeError naming the CUDA error), never crashes.
    with pytest.raises(RuntimeError, match="cache_write failed"):
        k.cache_write(16, 16, 16, 16, 16, 1, 1, 16, 2, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 0)
    # Arguments the launcher itself must refuse (invalid grid) are refused the same way.
    with pytest.raises(RuntimeError, match="paged_decode failed"):
        k.paged_decode(*([16] * 20), 1, 8, 3, 64, 16, 1, 2, 1.0, 0)


def test_kernel_sources_compile_for_sm90(tmp_path: Path) -> None:
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    assert SOURCES, "no kernels/*.cu found"

    def compile_one(src: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
        cmd = [nvcc, "-std=c++17", "-O3", "-c", "-gencode=arch=compute_90,code=sm_90", f"-I{KERNELS}",
               str(src), "-o", str(tmp_path / (src.stem + ".o"))]
        return src, subprocess.run(cmd, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
        results = list(pool.map(compile_one, SOURCES))
    failures = [f"{src.name}:\n{r.stderr[-3000:]}" for src, r in results if r.returncode != 0]
    assert not failures, "nvcc failed:\n" + "\n".join(failures)


def test_probe_reports_why_the_kernels_cannot_run() -> None:
    k = load_kernels()
    if k is None:
        pytest.skip("nanovllm._kernels is not built")
    from nanovllm.attention import cuda_ops

    code, message, driver, runtime = k.probe()
    assert runtime == k.cuda_runtime_version()
    if torch.cuda.is_available():
        assert code == 0, message
        assert cuda_ops.probe() is None
    else:
        assert code != 0 and message
        assert "CUDA error" in cuda_ops.probe()
