"""Tensor parallelism: the process group (parallel_state), the step channel from rank 0 to the
workers (shm_ring on one node, broadcast_channel across nodes), the worker processes (worker) and
rank 0's side of them (launcher, driver). See docs/design.md, "Tensor parallelism"."""

from nanovllm.distributed.parallel_state import ParallelConfig, TPGroup, check_model_divides


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process ended (or its connection broke): the engine cannot run."""


__all__ = ["ParallelConfig", "TPGroup", "WorkerDiedError", "check_model_divides"]
