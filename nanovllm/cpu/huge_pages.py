"""Tensors on 2 MiB pages (transparent huge pages), for what CPU kernels stream every step: the packed
weights and the KV cache.

A GEMM that streams weights from memory takes a TLB miss every 4 KiB page (the hardware prefetchers
stop at page boundaries too), and under a hypervisor each miss walks two page tables. On this
project's KVM Zen 4 a 4 x 1024 x 1024 fp32 GEMM over cold packed weights read them at 9 GB/s on
4 KiB pages and 17 GB/s on 2 MiB ones (benchmarks/RESULTS.md, "Mixture of experts"). torch's
allocator asks for huge pages only under THP_MEM_ALLOC_ENABLE; Linux gives them to a mapping
advised with MADV_HUGEPAGE before its pages are first touched, where THP is "madvise" or "always".
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized 1-D tensor, on huge pages where it spans at least one and the OS offers them
    (else a plain torch.empty). Its memory stays mapped as long as the tensor or a view of it lives."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(numel, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # Private: an anonymous mapping is shared by default, and shared memory follows THP's shmem setting.
    buffer = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # room to align to 2 MiB
    whole = torch.frombuffer(buffer, dtype=torch.uint8)
    offset = -whole.data_ptr() % HUGE_PAGE
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE, offset, span)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as torch.empty
        pass
    return whole[offset:offset + nbytes].view(dtype)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), on huge pages where `device` is the CPU (a KV cache: decode attention read
    it 5-15% faster so, as the block walk crosses fewer pages)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return empty(math.prod(shape), dtype).zero_().view(shape)
