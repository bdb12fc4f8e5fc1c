"""Python wrappers of the CUDA kernels in `nanovllm._kernels` (sources in kernels/).

Each wrapper checks its tensors' metadata (shape, dtype, strides, alignment, device) and raises
ValueError naming the argument before anything is launched: the kernels take raw pointers, so a
wrong argument would otherwise be an illegal memory access (or silently wrong numbers) later. The
checks never read tensor data, so they never synchronize with the GPU, and the device check comes
last, so the rest can be exercised with CPU tensors on machines without a GPU.

What the checks cannot see without reading device memory is trusted: slot ids and block ids must
lie inside the cache, and each context length must be covered by its block-table row (the
scheduler guarantees both).

This module imports anywhere; `nanovllm._kernels` is loaded on the first launch.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch

# What the decode kernel is compiled for (kernels/launchers.cu: decode_supports_head_dim).
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_PARTITIONS = 256  # kernels/paged_decode.cuh: kMaxPartitions
MAX_DECODE_SEQS = 65535  # kernels/paged_decode.cuh: decode_grid (sequences on grid y)

# Split-KV heuristic (see choose_num_partitions).
SPLIT_MIN_CONTEXT = 512  # below this a context is one CTA's short job; never split
TOKENS_PER_PARTITION_MIN = 256  # a partition shorter than this costs more to combine than it saves
CTAS_PER_SM_TARGET = 4  # aim for about one full wave of resident CTAs

_kernels: ModuleType | None = None
_num_sms: dict[int, int] = {}

# Test hook: tests/kernel_emulation compiles the kernel source for the CPU and installs an object
# with the same functions here; the wrappers then accept CPU tensors and launch on "stream 0".
_emulation: Any = None
EMULATED_NUM_SMS = 132  # what choose_num_partitions assumes under emulation (an H100/H200)


def kernels() -> Any:
    """The compiled module; ImportError (with what to do) where it was not built."""
    global _kernels
    if _emulation is not None:
        return _emulation
    if _kernels is None:
        try:
            from nanovllm import _kernels as module
        except ImportError as e:
            raise ImportError(
                "nanovllm._kernels is not built: reinstall on a machine with nvcc (a CUDA toolkit), "
                "e.g. `pip install --no-build-isolation .`, and without NANOVLLM_CUDA=OFF"
            ) from e
        _kernels = module
    return _kernels


def is_available() -> bool:
    try:
        kernels()
    except ImportError:
        return False
    return True


def probe() -> str | None:
    """None if the kernels can run on this machine's current CUDA device, else why not (e.g. the
    CUDA runtime they were built with needs a newer driver, or there is no kernel image for this
    GPU). Synchronizes the device once: for startup, not for the step path."""
    try:
        code, message, driver, runtime = kernels().probe()
    except ImportError as e:
        return str(e)
    if code == 0:
        return None

    def version(v: int) -> str:
        return f"{v // 1000}.{v % 1000 // 10}" if v else "none"

    return f"{message} (CUDA error {code}; driver supports CUDA {version(driver)}, kernels built with {version(runtime)})"


def supports(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the decode kernel handles this head_dim and dtype."""
    return head_dim in SUPPORTED_HEAD_DIMS and dtype in SUPPORTED_DTYPES


def _group_cap(group: int) -> int:
    # kernels/paged_decode.cuh: group_cap (query heads per CTA as compiled).
    return 1 if group <= 1 else 2 if group <= 2 else 4 if group <= 4 else 8


def choose_num_partitions(num_seqs: int, num_heads: int, num_kv_heads: int, max_context_len: int,
                          num_sms: int) -> int:
    """Split-KV partitions for a decode batch: 1 unless the (sequence, KV head) grid is too small to
    fill the GPU and the contexts are long enough for splitting to pay for the extra combine pass.

    The kernel sizes each sequence's partitions from its own length, so the result only has to be
    right for the longest context (`max_context_len`, an upper bound is fine: CUDA graphs pass the
    model's maximum length and get partitions that still suit every shorter step).
    """
    if max_context_len < SPLIT_MIN_CONTEXT or num_seqs <= 0:
        return 1
    group = num_heads // num_kv_heads
    ctas = num_seqs * num_kv_heads * math.ceil(group / _group_cap(group))
    target = CTAS_PER_SM_TARGET * num_sms
    if ctas >= target:
        return 1
    parts = min(math.ceil(target / ctas), math.ceil(max_context_len / TOKENS_PER_PARTITION_MIN), MAX_PARTITIONS)
    return max(1, parts)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return EMULATED_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _num_sms.get(index)
    if n is None:
        n = _num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def _stream(device: torch.device) -> int:
    # The current stream: inside torch.cuda.graph() capture that is the capturing stream.
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


# --- checks -------------------------------------------------------------------------------------


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _check_dtype(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {t.dtype}")


def _check_vectors(t: torch.Tensor, name: str, dims: int) -> None:
    """Last dim contiguous and every 16-byte vector the kernels read aligned."""
    if t.dim() != dims:
        _fail(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        _fail(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    es = t.element_size()
    if t.data_ptr() % 16 or any((s * es) % 16 for s in t.stride()[:-1]) or (t.shape[-1] * es) % 16:
        _fail(f"{name} rows must be 16-byte aligned (data_ptr {t.data_ptr():#x}, strides {t.stride()}, "
              f"{es}-byte elements)")


def _check_device(tensors: tuple[tuple[torch.Tensor, str], ...]) -> torch.device:
    device = tensors[0][0].device
    if device.type != "cuda" and not (_emulation is not None and device.type == "cpu"):
        _fail(f"{tensors[0][1]} must be a CUDA tensor, got device {device}")
    for t, name in tensors[1:]:
        if t.device != device:
            _fail(f"{name} is on {t.device}, expected {device} like {tensors[0][1]}")
    return device


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        _fail(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        _fail(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        _fail(f"v_cache dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    if k_cache.dtype not in SUPPORTED_DTYPES:
        _fail(f"cache dtype must be one of {SUPPORTED_DTYPES}, got {k_cache.dtype}")
    _check_vectors(k_cache, "k_cache", 4)
    _check_vectors(v_cache, "v_cache", 4)


# --- cache write --------------------------------------------------------------------------------


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter `key`/`value` `[num_tokens, num_kv_heads, head_dim]` into the caches by slot.

    Same contract as the torch backend: slot -1 skips a token, and rows of key/value beyond
    `slot_mapping`'s length are ignored (padded inputs). Key and value may be strided views (e.g. of
    a fused qkv projection) as long as each head's row is contiguous; the kernel copies 16 bytes per
    access when every address allows it and falls back to narrower accesses otherwise.
    """
    _check_cache_pair(k_cache, v_cache)
    num_tokens = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
    if num_tokens < 0:
        _fail(f"slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}")
    _check_dtype(slot_mapping, "slot_mapping", torch.int32)
    if not slot_mapping.is_contiguous():
        _fail("slot_mapping must be contiguous")
    for t, name in ((key, "key"), (value, "value")):
        if t.dim() != 3 or tuple(t.shape[1:]) != tuple(k_cache.shape[2:]):
            _fail(f"{name} must be [num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}] to match the cache, "
                  f"got shape {tuple(t.shape)}")
        if t.shape[0] < num_tokens:
            _fail(f"{name} has {t.shape[0]} tokens, fewer than slot_mapping's {num_tokens}")
        if t.dtype != k_cache.dtype:
            _fail(f"{name} dtype {t.dtype} differs from the cache dtype {k_cache.dtype}")
        if t.stride(-1) != 1:
            _fail(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    device = _check_device(((k_cache, "k_cache"), (v_cache, "v_cache"), (key, "key"), (value, "value"),
                            (slot_mapping, "slot_mapping")))
    if num_tokens == 0:
        return
    ks, vs = key.stride(), value.stride()
    kc, vc = k_cache.stride(), v_cache.stride()
    kernels().cache_write(
        key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
        num_tokens, k_cache.shape[2], k_cache.shape[3], k_cache.element_size(),
        ks[0], ks[1], vs[0], vs[1], kc[0], kc[1], kc[2], vc[0], vc[1], vc[2], k_cache.shape[1],
        _stream(device),
    )


# --- decode -------------------------------------------------------------------------------------


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_seqs: int | None = None,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,
    num_partitions: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    query `[>= num_seqs, num_heads, head_dim]` (row i is sequence i's token), caches
    `[num_blocks, block_size, num_kv_heads, head_dim]`, block_tables int32 `[>= num_seqs, W]`,
    context_lens int32 `[>= num_seqs]`. Writes rows `:num_seqs` of `out` (allocated like query when
    None) and returns it. A context length of 0 gives a zero row.

    `max_context_len`: an upper bound of the batch's context lengths (host int), used only to choose
    the split-KV partitions; default W * block_size. `num_partitions` forces the split (1 = none).
    """
    if query.dim() != 3:
        _fail(f"query must be [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    _check_cache_pair(k_cache, v_cache)
    n = query.shape[0] if num_seqs is None else num_seqs
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if not 0 <= n <= query.shape[0]:
        _fail(f"num_seqs {n} is outside [0, {query.shape[0]}] (query rows)")
    if n > MAX_DECODE_SEQS:
        _fail(f"num_seqs {n} exceeds {MAX_DECODE_SEQS} per launch (the kernel's grid y dimension)")
    if cache_dim != head_dim:
        _fail(f"query head_dim {head_dim} differs from the cache's {cache_dim}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        _fail(f"head_dim {head_dim} is not supported by the decode kernel (supported: {SUPPORTED_HEAD_DIMS})")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        _fail(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != k_cache.dtype:
        _fail(f"query dtype {query.dtype} differs from the cache dtype {k_cache.dtype}")
    if query.stride(-1) != 1:
        _fail(f"query must be contiguous in its last dimension, got strides {query.stride()}")
    if block_tables.dim() != 2 or block_tables.shape[0] < n:
        _fail(f"block_tables must be [>= {n}, max_blocks], got shape {tuple(block_tables.shape)}")
    _check_dtype(block_tables, "block_tables", torch.int32)
    if block_tables.stride(1) != 1:
        _fail(f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    if context_lens.dim() != 1 or context_lens.shape[0] < n:
        _fail(f"context_lens must be 1-D with >= {n} entries, got shape {tuple(context_lens.shape)}")
    _check_dtype(context_lens, "context_lens", torch.int32)
    if context_lens.stride(0) != 1:
        _fail("context_lens must be contiguous")
    if out is None:
        out = torch.empty_like(query)
    else:
        if out.dim() != 3 or out.shape[0] < n or tuple(out.shape[1:]) != (num_heads, head_dim):
            _fail(f"out must be [>= {n}, {num_heads}, {head_dim}], got shape {tuple(out.shape)}")
        if out.dtype != query.dtype:
            _fail(f"out dtype {out.dtype} differs from query dtype {query.dtype}")
        if out.stride(-1) != 1:
            _fail(f"out must be contiguous in its last dimension, got strides {out.stride()}")
    if num_partitions is not None and not (isinstance(num_partitions, int) and 1 <= num_partitions <= MAX_PARTITIONS):
        _fail(f"num_partitions must be an int in [1, {MAX_PARTITIONS}], got {num_partitions!r}")
    device = _check_device(((query, "query"), (k_cache, "k_cache"), (v_cache, "v_cache"),
                            (block_tables, "block_tables"), (context_lens, "context_lens"), (out, "out")))
    if n == 0:
        return out
    if num_partitions is None:
        bound = max_context_len if max_context_len is not None else block_tables.shape[1] * block_size
        num_partitions = choose_num_partitions(n, num_heads, num_kv_heads, bound, num_sms(device))
    part_out = part_max = part_sum = 0
    if num_partitions > 1:
        # One fp32 workspace: partial outputs, then the partitions' maxima and denominators.
        rows = n * num_heads * num_partitions
        work = torch.empty(rows * (head_dim + 2), dtype=torch.float32, device=device)
        part_out = work.data_ptr()
        part_max = part_out + rows * head_dim * 4
        part_sum = part_max + rows * 4
    qs, os_, kc, vc = query.stride(), out.stride(), k_cache.stride(), v_cache.stride()
    kernels().paged_decode(
        query.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), part_out, part_max, part_sum,
        qs[0], qs[1], os_[0], os_[1], kc[0], kc[1], kc[2], vc[0], vc[1], vc[2], block_tables.stride(0),
        n, num_heads, num_kv_heads, head_dim, block_size, num_partitions, _DTYPE_CODES[query.dtype], float(scale),
        _stream(device),
    )
    return out
