"""Tensor parallelism's communication: the process group (parallel_state) and the step channel
from rank 0 to the workers (shm_ring on one node, broadcast_channel across nodes, step_message
their layout). The processes themselves are the executor's (executor/multiproc_executor.py,
launcher.py) and the worker's (worker/worker.py). See docs/design.md, "Tensor parallelism"."""

from nanovllm.distributed.parallel_state import ParallelConfig, TPGroup, check_model_divides


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process ended (or its connection broke): the engine cannot run."""


__all__ = ["ParallelConfig", "TPGroup", "WorkerDiedError", "check_model_divides"]
