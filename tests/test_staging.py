"""nanovllm.staging: the one way host arrays reach a device and step results come back.

The static check below reads the package's sources: a host array turned into a tensor and moved
to a device in one expression (`torch.from_numpy(x).to(dev)`, `torch.as_tensor(x, device=dev)`,
...) is a pageable, blocking copy on CUDA, and `.cpu()` waits for the device once per tensor; both
must go through `to_device` / `to_host`. On a GPU, tests/test_sampling_cuda.py runs whole steps
under torch.cuda.set_sync_debug_mode("error").
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

import nanovllm
from nanovllm.staging import to_device, to_host

PACKAGE = Path(nanovllm.__file__).resolve().parent
_HOST_TO_TENSOR = {"from_numpy", "as_tensor", "tensor", "asarray"}


def _is_host_tensor_call(node: ast.AST) -> bool:
    """`torch.from_numpy(...)`, `torch.as_tensor(...)`, `torch.tensor(...)` or `np.*(...)`."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    owner = node.func.value
    if not isinstance(owner, ast.Name):
        return False
    return (owner.id == "torch" and node.func.attr in _HOST_TO_TENSOR) or owner.id in ("np", "numpy")


def blocking_transfers(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        if not isinstance(node, ast.Call):
            continue
        where = f"{name}:{node.lineno}"
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("to", "cuda") and _is_host_tensor_call(func.value):
            found.append(f"{where}: host array .{func.attr}(device)")
        elif _is_host_tensor_call(node) and any(k.arg == "device" for k in node.keywords):
            found.append(f"{where}: host data created on a device")
        elif isinstance(func, ast.Attribute) and func.attr == "cpu" and not node.args:
            found.append(f"{where}: .cpu() (one wait per tensor)")
    return found


def test_package_moves_host_data_only_through_staging() -> None:
    sources = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "staging.py"]
    assert len(sources) > 50  # the installed package, not an empty directory
    found = [f for p in sources for f in blocking_transfers(p.read_text(), str(p.relative_to(PACKAGE.parent)))]
    assert not found, "use nanovllm.staging.to_device / to_host:\n" + "\n".join(found)


def test_the_check_finds_each_blocking_form() -> None:
    sample = ("import numpy as np\nimport torch\n"
              "a = torch.from_numpy(np.zeros(2)).to('cuda')\n"
              "b = torch.as_tensor([1, 2], device='cuda')\n"
              "c = torch.tensor([1], dtype=torch.int32, device=dev)\n"
              "d = np.arange(3).cuda()\n"
              "e = t.cpu()\n"
              "ok = to_device(np.zeros(2), dev)\n"
              "ok2 = torch.zeros(3, device=dev)\n")
    found = blocking_transfers(sample, "sample.py")
    assert [f.split(":")[1] for f in found] == ["3", "4", "5", "6", "7"], found


def test_to_device_on_cpu_shares_memory_and_converts() -> None:
    a = np.arange(6, dtype=np.int64)
    t = to_device(a, torch.device("cpu"))
    assert t.dtype == torch.int64 and np.shares_memory(t.numpy(), a)
    t32 = to_device([1, 2, 3], torch.device("cpu"), np.int32)
    assert t32.dtype == torch.int32 and t32.tolist() == [1, 2, 3]
    ro = np.arange(3, dtype=np.float32)
    ro.flags.writeable = False
    assert to_device(ro, torch.device("cpu")).tolist() == [0.0, 1.0, 2.0]


def test_to_host_on_cpu_returns_views() -> None:
    x, y = torch.arange(4), torch.ones(2, 3)
    hx, hy = to_host(x, y)
    assert np.shares_memory(hx, x.numpy()) and hy.shape == (2, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_round_trip_on_cuda_without_sync_debug_errors() -> None:
    dev = torch.device("cuda")
    a = np.random.default_rng(0).integers(0, 1000, 4096).astype(np.int64)
    torch.cuda.set_sync_debug_mode("error")
    try:
        t = to_device(a, dev)
        a[:] = -1  # the staging copy is the caller's no longer: changing it cannot reach the device
        (back,) = to_host(t * 2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert (back >= 0).all() and back.shape == (4096,)
