"""Host data onto the device and a step's results back, without stalling the host on the device.

A step queues its whole forward on the GPU and goes on preparing sampling on the host (the grammar
bitmask, penalty rows) while the GPU computes: anything that waits for the GPU in between throws
that overlap away. `torch.from_numpy(x).to("cuda")` is such a wait: from ordinary (pageable)
memory the copy is synchronous, so the host waits for everything queued before it. Every host
array bound for a device goes through `to_device`, and the results come back through `to_host`,
which waits once for all of them; that wait, for the sampled tokens, is the one a decode step
has (tests/test_staging.py checks that the step path has no other way onto the device, and on a
GPU that a step under `torch.cuda.set_sync_debug_mode("error")` runs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(data: np.ndarray | Sequence[int] | Sequence[float], device: torch.device,
              dtype: np.dtype | type | None = None) -> torch.Tensor:
    """`data` (a numpy array or a sequence of numbers, as `dtype` if given) as a tensor on `device`.

    CUDA: copied through page-locked memory with `non_blocking=True`, so the host goes on at once.
    The page-locked block comes from torch's caching host allocator, which records an event with
    the copy and hands the block out again only after the copy has run: `data` may change as soon
    as this returns. CPU: the tensor shares `data`'s memory when it is already a numpy array of
    the right dtype (no copy), as `torch.from_numpy` does."""
    array = np.asarray(data, dtype=dtype)
    if not array.flags.writeable:  # torch.from_numpy warns on read-only arrays
        array = array.copy()
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def to_host(*tensors: torch.Tensor) -> list[np.ndarray]:
    """The tensors as numpy arrays, with one wait for all of them: each is copied `non_blocking`
    into page-locked memory, then one CUDA event recorded after the copies is waited for. (An event
    wait is not one of the synchronizations `torch.cuda.set_sync_debug_mode` reports, unlike
    `.cpu()`, which syncs once per tensor.) CPU tensors come back as views, without a copy."""
    out: list[np.ndarray] = []
    cuda = False
    for t in tensors:
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            cuda = True
        else:
            host = t if t.is_cpu else t.cpu()  # the CPU's: a view; other devices: an ordinary copy
        out.append(host.numpy())
    if cuda:
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
    return out
