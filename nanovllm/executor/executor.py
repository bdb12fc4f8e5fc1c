"""Executor: runs a step's plan on the model wherever the model is, and returns its RunnerOutput.

One device: the model runner lives in this process (`Executor`). Tensor parallelism: rank 0's
runner in this process plus N - 1 worker processes that mirror every step (MultiprocExecutor,
executor/multiproc_executor.py). The engine sees only `execute(scheduler_output)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanovllm.config import ResolvedConfig
from nanovllm.worker.model_runner import ModelRunner
from nanovllm.worker.step import RunnerOutput, SchedulerOutput


class Executor:
    def __init__(self, config: ResolvedConfig, eos_token_ids: Sequence[int]) -> None:
        self.config = config
        self.runner = ModelRunner(config, eos_token_ids=eos_token_ids)

    def initialize_kv_cache(self) -> int:
        """Size the KV cache (every rank agrees on the size), allocate it and capture the decode
        graphs; returns its number of blocks."""
        num_blocks = self.runner.num_kv_blocks()
        check_pool_holds_one_sequence(num_blocks, self.config)
        self.runner.allocate_kv_cache(num_blocks)
        return num_blocks

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(so)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def make_device_current(self) -> None:
        """For a thread that drives the executor (the server's engine thread): see ModelRunner."""
        self.runner.make_device_current()

    def shutdown(self) -> None:
        """Release processes this executor started (none on one device)."""

    def abandon(self, reason: str) -> None:
        """A step is hung (called from another thread): make it fail if it can, and every later
        step. Nothing to do in one process, where no peer can hang a step."""


def check_pool_holds_one_sequence(num_blocks: int, config: ResolvedConfig) -> None:
    """A pool smaller than max_model_len would cut every long enough request at the pool's size
    (reported as finish_reason "length"): refuse it at startup, as vLLM does."""
    block_size = config.block_size
    need = -(-config.max_model_len // block_size)
    if num_blocks < need:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens = {num_blocks * block_size} tokens, "
            f"but one sequence of max_model_len={config.max_model_len} tokens needs {need} blocks; lower "
            f"max_model_len to at most {num_blocks * block_size}, or give the KV cache more room "
            "(num_kvcache_blocks, kv_cache_memory_bytes or gpu_memory_utilization)")
