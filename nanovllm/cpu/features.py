"""What the host CPU can compute natively, for choosing a dtype and the GEMM kernel on CPU.

torch runs bfloat16 on any x86 CPU, but without AVX512-BF16 or AMX it converts every operand to
fp32 and back: on such a CPU (AVX2 only) a bf16 GEMM measured 2x slower than fp32
(benchmarks/RESULTS.md), so bf16 is worth it only where the instructions exist.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from nanovllm import _cpu


def _probe(name: str) -> bool:
    # Private torch helpers (torch.cpu._is_*_supported, torch >= 2.3): absent means unknown, i.e. no.
    fn = getattr(torch.cpu, name, None)
    return bool(fn()) if fn is not None else False


@functools.cache
def amx_tiles() -> bool:
    """AMX tiles (Intel Sapphire Rapids and later): bf16 products several times a vector unit's."""
    return _probe("_is_amx_tile_supported")


@functools.cache
def native_bf16() -> bool:
    """AVX512-BF16 or AMX tiles (Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later)."""
    return _probe("_is_avx512_bf16_supported") or amx_tiles()


GemmKernel = Literal["avx2", "onednn"]


@functools.cache
def gemm_kernel() -> GemmKernel:
    """The CPU linear layers' kernel (cpu/gemm.py) for fp32 weights, and bf16 ones the CPU does not
    compute natively: ours ("avx2": AVX2 tiles, AVX-512 ones where the CPU has them) wherever AVX2 +
    FMA exist, else oneDNN. cpu/gemm.layer_kernel gives large bf16 weights to oneDNN where the CPU
    computes bf16 natively."""
    return "avx2" if _cpu.has_avx2_fma() else "onednn"
