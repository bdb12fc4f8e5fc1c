"""Rank 0's model runner under tensor parallelism, and the factory the engine builds its runner with.

`TensorParallelRunner` is a ModelRunner for rank 0's shard that also drives the workers: before
its own forward it publishes the step (the StepPlan's buffer, see shm_ring / broadcast_channel),
before its own LM-head shard the rows to compute logits for. Everything else the engine does
(scheduling, sampling, detokenizing) stays on rank 0 and never involves the workers.

Faults: a worker that exits is noticed by its watcher thread (launcher), which also aborts the
group so that a collective waiting for it (NCCL would wait forever) fails; a broken connection
fails a gloo collective by itself. Either way the step raises WorkerDiedError and every later step
too; the workers are stopped and the ring's name was unlinked at startup, so nothing is left.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from nanovllm import _C
from nanovllm.config import EngineConfig
from nanovllm.distributed import WorkerDiedError
from nanovllm.distributed.broadcast_channel import BroadcastChannel
from nanovllm.distributed.launcher import WorkerProcesses
from nanovllm.distributed.parallel_state import ParallelConfig, TPGroup, check_model_divides, free_port
from nanovllm.distributed.shm_ring import ShmRing
from nanovllm.distributed.step_message import PlanLayout
from nanovllm.distributed.worker import ATTACHED_KEY, RING_KEY, Channel, layout_json
from nanovllm.executor.model_runner import ModelRunner
from nanovllm.executor.plan_tensors import PlanViews
from nanovllm.model_config import load_model_config
from nanovllm.staging import to_host

logger = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 120.0


def make_model_runner(config: EngineConfig, device: torch.device, *, max_model_len: int,
                      eos_token_ids: Sequence[int]) -> ModelRunner:
    """The engine's runner: a plain ModelRunner on one device, else rank 0 of a tensor-parallel
    group (which starts the workers of this node)."""
    kwargs = dict(max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
                  enforce_eager=config.enforce_eager, eos_token_ids=eos_token_ids, quantization=config.quantization)
    parallel = config.parallel
    if parallel.tensor_parallel_size == 1:
        return ModelRunner(config.model, config.dtype, device, config.block_size, **kwargs)
    return TensorParallelRunner(config, parallel, device, **kwargs)


# How gloo and NCCL word a peer that went away when they raise a plain RuntimeError (gloo's
# transport errors are not always a DistError).
_PEER_GONE = ("gloo/transport", "connection closed by peer", "connection reset by peer", "broken pipe", "nccl")


def _is_collective_failure(e: BaseException) -> bool:
    if isinstance(e, torch.distributed.DistError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(s in text for s in _PEER_GONE)


class _Resources:
    """What must be released however the runner ends (a weakref.finalize holds this, not the
    runner): the workers, the channel and the group."""

    def __init__(self) -> None:
        self.workers: WorkerProcesses | None = None
        self.channel: Channel | None = None
        self.group: TPGroup | None = None
        self.healthy = True

    def release(self) -> None:
        workers, channel, group = self.workers, self.channel, self.group
        self.workers = self.channel = self.group = None
        if channel is not None:
            if self.healthy and workers is not None:
                try:
                    workers.check()
                    workers.expect_exit()
                    channel.publish_stop(workers.check)
                except Exception:  # noqa: BLE001  (a worker died meanwhile: it is killed below)
                    self.healthy = False
            channel.close()
        if workers is not None:
            workers.stop(timeout=10.0 if self.healthy and channel is not None else 0.5)
        if group is not None:
            group.close()


class TensorParallelRunner(ModelRunner):
    def __init__(self, config: EngineConfig, parallel: ParallelConfig, device: torch.device, **kwargs: object) -> None:
        if parallel.node_rank != 0:
            raise ValueError("node_rank > 0 only runs workers: start that node with `nanovllm serve ... --headless`")
        check_model_divides(load_model_config(config.model), parallel.tensor_parallel_size)
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + parallel.ranks_per_node:
            raise ValueError(f"tensor_parallel_size={parallel.tensor_parallel_size} over {parallel.nnodes} node(s) "
                             f"needs {parallel.ranks_per_node} GPUs from {device} on, this node has "
                             f"{torch.cuda.device_count()}")
        if parallel.master_port is None:
            parallel = replace(parallel, master_port=free_port(parallel.master_addr))
        self.parallel = parallel
        res = self._res = _Resources()
        self._finalizer = weakref.finalize(self, res.release)
        self._broken: str | None = None
        try:
            res.workers = WorkerProcesses(config, parallel, range(1, parallel.ranks_per_node), self._on_worker_death)
            res.group = self._connect(device)
            super().__init__(config.model, config.dtype, device, config.block_size, tp=res.group, **kwargs)
        except WorkerDiedError:
            self.shutdown()
            raise
        except BaseException as e:
            self._raise_if_worker_died(e)
            self.shutdown()
            raise
        self._plan: _C.StepPlan | None = None
        self._step_samples: torch.Tensor | None = None

    def _connect(self, device: torch.device) -> TPGroup:
        """Join the group while watching the local workers: one that fails at startup ends the
        wait at once (the rendezvous alone would wait for its full timeout)."""
        p, workers = self.parallel, self._res.workers
        assert p.master_port is not None and workers is not None
        box: dict[str, object] = {}

        def connect() -> None:
            try:
                box["group"] = TPGroup.connect(0, p.tensor_parallel_size, p.master_addr, p.master_port,
                                               p.backend_for(device), device)
            except BaseException as e:  # noqa: BLE001  (handed to the waiting thread)
                box["error"] = e

        t = threading.Thread(target=connect, name="nanovllm-tp-connect", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            workers.check()
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["group"]  # type: ignore[return-value]

    def _on_worker_death(self) -> None:
        # Unblocks a collective waiting for the dead worker (NCCL would wait for it forever).
        group = self._res.group
        if group is not None:
            group.abort()

    def _check(self) -> None:
        if self._broken is not None:
            raise WorkerDiedError(self._broken)
        assert self._res.workers is not None
        try:
            self._res.workers.check()
        except WorkerDiedError as e:
            self._fail(str(e))

    def _fail(self, reason: str, cause: BaseException | None = None) -> None:
        self._broken = f"tensor parallelism failed: {reason}; the engine cannot continue"
        self._res.healthy = False
        raise WorkerDiedError(self._broken) from cause

    def _raise_if_worker_died(self, e: BaseException) -> None:
        """After an exception from a collective: a dead local worker (its exit may lag its closed
        connection by a moment) or a broken connection is fatal, named as such."""
        workers = self._res.workers
        collective = _is_collective_failure(e)
        deadline = time.monotonic() + 2.0
        while workers is not None and time.monotonic() < deadline:
            try:
                workers.check()
            except WorkerDiedError as died:
                self._fail(str(died), e)
            if not collective:
                return
            time.sleep(0.05)
        if collective:
            self._fail(f"a collective failed ({e})", e)

    def _channel(self, plan: _C.StepPlan) -> Channel:
        """Open the step channel at the first step (its layout is the plan's): the ring on one node,
        unlinked once every worker has attached; the broadcast channel across nodes."""
        res = self._res
        if res.channel is not None:
            return res.channel
        assert res.group is not None and res.workers is not None
        layout = PlanLayout.of(plan, self.block_size)
        store = res.group.store
        if self.parallel.nnodes > 1:
            res.channel = BroadcastChannel(res.group, layout)
            store.set(RING_KEY, layout_json(layout, ""))
            return res.channel
        ring = ShmRing.create(layout, self.parallel.tensor_parallel_size - 1)
        res.channel = ring
        store.set(RING_KEY, layout_json(layout, ring.name))
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        while int(store.add(ATTACHED_KEY, 0)) < ring.num_workers:
            self._check()
            if time.monotonic() > deadline:
                self._fail(f"the workers did not attach the step ring within {ATTACH_TIMEOUT_S:.0f} s")
            time.sleep(0.001)
        ring.unlink()
        return ring

    @torch.inference_mode()
    def forward(self, plan: _C.StepPlan) -> tuple[PlanViews, torch.Tensor]:
        self._check()
        try:
            self._channel(plan).publish_step(plan, self._check)
            self._plan = plan
            v, hidden = super().forward(plan)
        except WorkerDiedError:
            raise
        except Exception as e:
            self._raise_if_worker_died(e)
            raise
        self._step_samples = v.sample_indices
        return v, hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self._check()
        assert self._plan is not None and self._res.channel is not None
        # The step's sample indices are on the host already (no device sync); other rows (prompt
        # logprobs) come from wherever the caller made them.
        host = self._plan.sample_indices if rows is self._step_samples else to_host(rows)[0]
        try:
            self._res.channel.publish_logits(host.astype(np.int32, copy=False), self._check)
            return super().logits(hidden, rows)
        except WorkerDiedError:
            raise
        except Exception as e:
            self._raise_if_worker_died(e)
            raise

    @property
    def worker_pids(self) -> list[int]:
        return [] if self._res.workers is None else self._res.workers.pids

    def shutdown(self) -> None:
        """Stop the workers (STOP through the channel, kill if they do not leave) and release the
        group. Also runs when the runner is garbage collected and at interpreter exit."""
        self._finalizer()
