"""Executors: where the model runs (this process, or N tensor-parallel ranks). See executor.py."""

from __future__ import annotations

from collections.abc import Sequence

from nanovllm.config import ResolvedConfig
from nanovllm.executor.executor import Executor


def make_executor(config: ResolvedConfig, eos_token_ids: Sequence[int]) -> Executor:
    """One process on one device, else rank 0 of a tensor-parallel group (which starts the workers
    of this node)."""
    if config.parallel.tensor_parallel_size == 1:
        return Executor(config, eos_token_ids)
    from nanovllm.executor.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config, eos_token_ids)


__all__ = ["Executor", "make_executor"]
