"""Tensor-parallel configuration and one rank's handle on its process group.

The group is a torch.distributed backend object (ProcessGroupNCCL on CUDA, ProcessGroupGloo on
CPU) built directly on a TCPStore, not through `init_process_group`: the default process group is
global state that could be created only once per process, while an engine owns its group and
destroys it when it shuts down (tests build several engines in one process). A model built for
tensor parallelism receives its `TPGroup` explicitly; with one rank there is no group at all
(`None`), so a single-device model makes no collective call.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm.model_config import ModelConfig

# How long a collective may wait for a peer before it fails. A dead peer closes its sockets, which
# gloo notices at once; this bounds a peer that hangs instead. Idle time between steps is not
# spent inside a collective (workers wait on the step channel), so it need not cover that.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# The store and the group's connections are made while the other ranks load their weights.
STARTUP_TIMEOUT = timedelta(seconds=600)


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks are laid out: `nnodes` nodes of `tensor_parallel_size // nnodes` ranks each,
    rank 0 (the engine) on node 0. `master_port=None` picks a free port (one node only: the other
    nodes must be told the port)."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    distributed_backend: str | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be a multiple of "
                             f"nnodes={self.nnodes} (the same number of ranks on every node)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank!r}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("a multi-node launch needs master_port (the same on every node)")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in [1, 65535], got {self.master_port!r}")
        if self.distributed_backend not in (None, "nccl", "gloo"):
            raise ValueError(f"distributed_backend must be None, 'nccl' or 'gloo', got {self.distributed_backend!r}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def backend_for(self, device: torch.device) -> str:
        return self.distributed_backend or ("nccl" if device.type == "cuda" else "gloo")


def check_model_divides(config: ModelConfig, tp: int) -> None:
    """The shapes tensor parallelism of size `tp` needs; ValueError naming what does not divide."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the number of attention heads ({heads})")
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size={tp} and the number of KV heads ({kv}) must divide one another "
                         "(KV heads are split across ranks, or replicated when there are fewer than ranks)")
    if config.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide intermediate_size ({config.intermediate_size})")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class TPGroup:
    """This rank's place in the tensor-parallel group and the collectives the model uses."""

    def __init__(self, rank: int, world_size: int, device_pg: dist.Backend, cpu_pg: dist.Backend,
                 store: dist.Store) -> None:
        self.rank = rank
        self.world_size = world_size
        self._pg = device_pg  # the model's collectives, on the model's device
        self._cpu = cpu_pg  # host-side control (block counts, the step plan across nodes): gloo
        self._store = store  # the backends keep using it (and rank 0 serves it)

    @classmethod
    def connect(cls, rank: int, world_size: int, master_addr: str, master_port: int, backend: str,
                device: torch.device) -> TPGroup:
        """Join the group (every rank calls this; rank 0 hosts the store)."""
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                              timeout=STARTUP_TIMEOUT, wait_for_workers=False)
        cpu_pg = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, world_size, COLLECTIVE_TIMEOUT)
        if backend == "gloo":
            return cls(rank, world_size, cpu_pg, cpu_pg, store)
        if device.type != "cuda":
            raise ValueError(f"the {backend!r} backend needs CUDA devices, got {device}")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = COLLECTIVE_TIMEOUT
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size, opts)
        return cls(rank, world_size, nccl, cpu_pg, store)

    @property
    def backend(self) -> str:
        """The model collectives' backend: "gloo" or "nccl"."""
        return "gloo" if self._pg is self._cpu else "nccl"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `x`."""
        self._pg.allreduce([x]).wait()
        return x

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._cpu.allreduce([t], opts).wait()
        return int(t.item())

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` concatenated along the last dimension on rank 0; None elsewhere."""
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            self._pg.gather([parts], [x], opts).wait()
            return torch.cat(parts, dim=-1)
        self._pg.gather([], [x], opts).wait()
        return None

    def broadcast_host(self, x: torch.Tensor, timeout: timedelta | None = None) -> torch.Tensor:
        """Rank 0's host tensor `x` into every rank's `x` (same shape and dtype), in place.
        `timeout` overrides COLLECTIVE_TIMEOUT (a worker waiting for the next step may wait for as
        long as the engine stays idle)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if timeout is not None:
            opts.timeout = timeout
        self._cpu.broadcast([x], opts).wait()
        return x

    @property
    def store(self) -> dist.Store:
        """The group's key-value store (rank 0 hosts it): for one-off startup exchanges."""
        return self._store

    def barrier(self) -> None:
        self._cpu.allreduce([torch.zeros(1)]).wait()

    def abort(self) -> None:
        """Fail the collectives in flight (a peer died: NCCL would otherwise wait for it forever)."""
        for pg in (self._pg, self._cpu):
            if pg is None:  # closed meanwhile
                continue
            try:
                pg.abort()
            except RuntimeError:
                pass  # not supported by this backend, or already broken

    def close(self) -> None:
        """Release the group's connections (the peers' next collective fails), and the backend and
        store objects with them, now: the model's layers keep this TPGroup alive, and left to
        interpreter teardown, the C++ objects' destructors ran in no set order and sometimes
        aborted the process ("terminate called without an active exception"). Idempotent."""
        pgs = [] if self._store is None else list({id(self._pg): self._pg, id(self._cpu): self._cpu}.values())
        for pg in pgs:
            try:
                pg.shutdown()
            except RuntimeError:
                pass  # already broken: a peer died
        # Backends before the store they were built on.
        self._pg = self._cpu = None  # type: ignore[assignment]
        del pgs
        self._store = None  # type: ignore[assignment]
