"""The CPU kernels behind torch-tensor signatures: each wrapper here checks dtype, device, layout
and sizes, then calls `nanovllm._cpu` (csrc/cpu_bindings.cpp) with raw pointers.

features (what this CPU computes natively: the dtype and GEMM kernel to use), fused_ops (RMSNorm,
SiLU-and-mul, rotary), gemm (weights packed once, the linear layers' matmul), moe (the
mixture-of-experts layer), sampler (sampling, logprobs, penalties); huge_pages (2 MiB pages for the
packed weights). The attention kernel's wrapper is the attention backend itself
(attention/cpu_backend.py)."""

import torch

# The kernels' dtype codes (csrc/cpu_dtype.h, CpuDtype).
KERNEL_DTYPES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1}
