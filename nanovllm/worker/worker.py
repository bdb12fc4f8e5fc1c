"""A tensor-parallel worker process: ranks 1..N-1, each running its shard of the model.

Started by rank 0 for the ranks on its node, or by `nanovllm serve --headless` on another node,
as `python -m nanovllm.worker SPEC_JSON`. Its startup mirrors the engine's step for
step (the collectives in it must meet): join the group, load its shard, agree on the KV pool
(minimum over ranks), allocate the cache (capturing CUDA graphs, whose all-reduces are captured
too), open the step channel. Then it runs what rank 0 sends: a STEP is the forward of the plan
(block copies first), a LOGITS message its share of the LM head, gathered on rank 0; STOP ends it.

A worker started by a local parent dies with it (PR_SET_PDEATHSIG), so no worker outlives the
engine, however the engine ends.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from nanovllm.attention.metadata import HostSeqLens
from nanovllm.config import EngineConfig
from nanovllm.distributed.broadcast_channel import BroadcastChannel
from nanovllm.distributed.parallel_state import ParallelConfig, TPGroup
from nanovllm.distributed.shm_ring import ShmRing
from nanovllm.distributed.step_message import Kind, PlanLayout
from nanovllm.staging import to_device
from nanovllm.worker.model_runner import ModelRunner
from nanovllm.worker.plan_tensors import PlanTensors

logger = logging.getLogger(__name__)

RING_KEY = "nanovllm/step_ring"
ATTACHED_KEY = "nanovllm/step_ring_attached"
KEY_POLL_S = 0.01  # a worker waiting for rank 0's first step polls the store this often
Channel = ShmRing | BroadcastChannel


@dataclass(frozen=True)
class WorkerSpec:
    config: EngineConfig
    parallel: ParallelConfig  # with master_port set
    rank: int
    parent_pid: int

    def to_json(self) -> str:
        config = self.config.as_options()
        config["dtype"] = str(config["dtype"]).removeprefix("torch.")
        return json.dumps({"config": config, "parallel": asdict(self.parallel), "rank": self.rank,
                           "parent_pid": self.parent_pid})

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        d = json.loads(text)
        return cls(EngineConfig(**d["config"]), ParallelConfig(**d["parallel"]), d["rank"], d["parent_pid"])


def rank_device(config: EngineConfig, parallel: ParallelConfig, rank: int) -> torch.device:
    """Rank r's device: on CUDA the node's (r - first local rank)-th GPU after the configured one."""
    device = config.resolve_device()
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank - parallel.local_ranks.start)


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux), and leave Ctrl-C to the
    parent, which stops the workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)


def parent_alive(parent_pid: int) -> None:
    if os.getppid() != parent_pid:
        raise SystemExit(1)


def open_worker_channel(group: TPGroup, parallel: ParallelConfig, parent_pid: int) -> Channel:
    """The ring rank 0 creates at its first step on one node, the broadcast channel across nodes.
    The layout (and the ring's name) come through the group's store; waiting for them polls, so an
    engine idle for a long time before its first request does not time the worker out."""
    info = json.loads(_wait_key(group, RING_KEY, parent_pid))
    name = info.pop("name")
    layout = PlanLayout(**info)
    if parallel.nnodes > 1:
        return BroadcastChannel(group, layout)
    ring = ShmRing.attach(name, layout, parallel.tensor_parallel_size - 1, group.rank - 1)
    group.store.add(ATTACHED_KEY, 1)
    return ring


def _wait_key(group: TPGroup, key: str, parent_pid: int) -> str:
    # `check` polls without a timeout of its own (a timed-out `wait` logs a c10d warning each time).
    store = group.store
    while not store.check([key]):
        parent_alive(parent_pid)
        time.sleep(KEY_POLL_S)
    return store.get(key).decode()


def layout_json(layout: PlanLayout, name: str) -> str:
    return json.dumps({"name": name, **asdict(layout)})


def serve(runner: ModelRunner, channel: Channel, alive: Callable[[], None]) -> None:
    """Run the messages rank 0 sends until STOP."""
    device = runner.device
    tensors: dict[int, PlanTensors] = {}  # one per ring slot (each slot is its own plan buffer)
    hidden: torch.Tensor | None = None
    active = time.perf_counter()
    with torch.inference_mode():
        while True:
            msg = channel.receive(alive, active)
            if msg.kind is Kind.STOP:
                channel.ack()
                return
            if msg.kind is Kind.STEP:
                plan = msg.plan
                assert plan is not None
                pt = tensors.get(msg.slot)
                if pt is None:
                    pt = tensors[msg.slot] = PlanTensors(plan, block_size=runner.block_size)  # type: ignore[arg-type]
                v = pt.to(device, plan)  # type: ignore[arg-type]
                hidden = runner.forward(v, HostSeqLens(cu_seqlens_q=plan.cu_seqlens_q, context_lens=plan.context_lens))
            else:
                assert hidden is not None and msg.rows is not None
                runner.model.compute_logits(hidden[to_device(msg.rows, device, np.int64)])
            channel.ack()
            active = time.perf_counter()


def run_worker(spec: WorkerSpec) -> None:
    config, parallel, rank = spec.config, spec.parallel, spec.rank
    torch.manual_seed(config.seed)
    device = rank_device(config, parallel, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    assert parallel.master_port is not None
    group = TPGroup.connect(rank, parallel.tensor_parallel_size, parallel.master_addr, parallel.master_port,
                            parallel.backend_for(device), device)
    channel: Channel | None = None
    try:
        runner = ModelRunner(config.resolve(), device=device, tp=group)
        runner.allocate_kv_cache(runner.num_kv_blocks())
        channel = open_worker_channel(group, parallel, spec.parent_pid)
        serve(runner, channel, lambda: parent_alive(spec.parent_pid))
    finally:
        if channel is not None:
            channel.close()
        group.close()


def main(argv: list[str]) -> int:
    spec = WorkerSpec.from_json(argv[0])
    die_with_parent(spec.parent_pid)
    logging.basicConfig(level=os.environ.get("NANOVLLM_LOG_LEVEL", "WARNING").upper(),
                        format=f"%(levelname)s %(asctime)s tp-rank-{spec.rank} %(name)s: %(message)s")
    try:
        run_worker(spec)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001  (report and exit non-zero: rank 0 sees the exit)
        logger.error("tensor-parallel worker rank %d failed: %r", spec.rank, e)
        return 1
    return 0

