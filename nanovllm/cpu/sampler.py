"""The sampler's CPU kernels of `nanovllm._cpu` (csrc/cpu_sampler.cpp) behind array signatures.

On the CPU torch spends a full-vocabulary pass per primitive (argmax, a uniform per entry, topk or
sort, cumsum, log_softmax), each far slower than the arithmetic it does; these kernels do a row in
one or two passes. `runs_on(logits)` says whether a tensor can take them: fp32 rows on the CPU with
contiguous entries (a row stride is fine). The callers keep their torch code for everything else.
"""

from __future__ import annotations

import numpy as np
import torch

from nanovllm import _cpu


def runs_on(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and logits.shape[1] > 0)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    if not runs_on(logits):
        raise ValueError(f"CPU sampler kernels take fp32 CPU rows, got {tuple(logits.shape)} {logits.dtype} "
                         f"on {logits.device} with strides {logits.stride()}")
    return logits


def _array(values: np.ndarray, dtype: type, rows: int, name: str) -> np.ndarray:
    a = np.ascontiguousarray(values, dtype=dtype)
    if a.shape != (rows,):
        raise ValueError(f"{name} must have one entry per row ({rows}), got shape {a.shape}")
    return a


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row, int64 `[rows]`, as torch.argmax(dim=-1)."""
    x = _rows(logits)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _cpu.argmax_cpu(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def sample(logits: torch.Tensor, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
           min_p: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """One token per row (int64), each row drawing with its own `uniform` in [0, 1); see
    csrc/cpu_sampler.h for the filters' order and meaning."""
    x = _rows(logits)
    n = x.shape[0]
    args = [_array(temperature, np.float32, n, "temperature"), _array(top_k, np.int64, n, "top_k"),
            _array(top_p, np.float32, n, "top_p"), _array(min_p, np.float32, n, "min_p"),
            _array(uniform, np.float64, n, "uniform")]
    out = np.empty(n, dtype=np.int64)
    _cpu.sample_cpu(x.data_ptr(), n, x.shape[1], x.stride(0), *(a.ctypes.data for a in args), out.ctypes.data,
                  torch.get_num_threads())
    return out


def logprobs(logits: torch.Tensor, chosen: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                       np.ndarray]:
    """(chosen logprob float64 [R], chosen rank int64 [R], top ids int64 [R, k], top logprobs float64
    [R, k]) of the rows' log_softmax."""
    x = _rows(logits)
    n, vocab = x.shape
    if not 0 <= k <= vocab:
        raise ValueError(f"k must be in [0, {vocab}], got {k}")
    ids = _array(chosen, np.int64, n, "chosen")
    if n and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"chosen token ids must be in [0, {vocab})")
    chosen_lp, rank = np.empty(n, dtype=np.float64), np.empty(n, dtype=np.int64)
    top_ids, top_lp = np.empty((n, k), dtype=np.int64), np.empty((n, k), dtype=np.float64)
    _cpu.logprobs_cpu(x.data_ptr(), n, vocab, x.stride(0), ids.ctypes.data, k, chosen_lp.ctypes.data,
                    rank.ctypes.data, top_ids.ctypes.data, top_lp.ctypes.data, torch.get_num_threads())
    return chosen_lp, rank, top_ids, top_lp


def apply_penalties(logits: torch.Tensor, rows: np.ndarray, seen: torch.Tensor, slots: np.ndarray,
                    repetition: np.ndarray, frequency: np.ndarray, presence: np.ndarray) -> None:
    """In place on logits[rows[i]], from the dense row seen[slots[i]] ([2, vocab]: prompt presence,
    output counts), with row i's penalties."""
    x = _rows(logits)
    n = len(rows)
    r, s = _array(rows, np.int64, n, "rows"), _array(slots, np.int64, n, "slots")
    if not (seen.device.type == "cpu" and seen.dtype == torch.float32 and seen.is_contiguous()
            and seen.shape[1:] == (2, x.shape[1])):
        raise ValueError(f"seen must be contiguous fp32 CPU rows [slots, 2, {x.shape[1]}], got {tuple(seen.shape)}")
    if n and (r.min() < 0 or r.max() >= x.shape[0] or s.min() < 0 or s.max() >= seen.shape[0]):
        raise ValueError("penalty rows or slots out of range")
    params = [_array(p, np.float32, n, name) for p, name in
              ((repetition, "repetition"), (frequency, "frequency"), (presence, "presence"))]
    _cpu.apply_penalties_cpu(x.data_ptr(), x.shape[1], x.stride(0), n, r.ctypes.data, seen.data_ptr(), s.ctypes.data,
                           *(p.ctypes.data for p in params), torch.get_num_threads())
