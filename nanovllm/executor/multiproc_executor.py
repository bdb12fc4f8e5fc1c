"""MultiprocExecutor: tensor parallelism over N ranks, rank 0 in this process.

Rank 0's ModelRunner holds its shard and samples; before its forward the executor publishes the
step (the StepPlan's buffer, see shm_ring / broadcast_channel) to the worker processes, and before
each logits call the rows to compute them for (the runner's `before_logits` hook), so every rank
runs the same collectives. Everything else the engine does (scheduling, sampling, detokenizing)
stays on rank 0 and never involves the workers.

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
from nanovllm.config import ResolvedConfig
from nanovllm.distributed import WorkerDiedError
from nanovllm.distributed.broadcast_channel import BroadcastChannel
from nanovllm.distributed.parallel_state import TPGroup, check_model_divides, free_port
from nanovllm.distributed.shm_ring import ShmRing
from nanovllm.distributed.step_message import PlanLayout
from nanovllm.executor.executor import Executor
from nanovllm.executor.launcher import WorkerProcesses
from nanovllm.worker.model_runner import ModelRunner
from nanovllm.worker.step import RunnerOutput, SchedulerOutput
from nanovllm.worker.worker import ATTACHED_KEY, RING_KEY, Channel, layout_json

logger = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 120.0


# How gloo and NCCL word a peer that went away when they raise a plain RuntimeError (gloo's
# transport errors are not always a DistError).
_PEER_GONE = ("gloo/transport", "connection closed by peer", "connection reset by peer", "broken pipe", "nccl")


def _address_in_use(e: BaseException) -> bool:
    """The group's rendezvous could not bind its port (another process holds it)."""
    text = str(e)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


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


class MultiprocExecutor(Executor):
    def __init__(self, config: ResolvedConfig, eos_token_ids: Sequence[int]) -> None:
        parallel = config.parallel
        device = config.device
        if parallel.node_rank != 0:
            raise ValueError("node_rank > 0 only runs workers: start that node with `nanovllm serve ... --headless`")
        check_model_divides(config.model_config, parallel.tensor_parallel_size)
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + parallel.ranks_per_node:
            raise ValueError(f"tensor_parallel_size={parallel.tensor_parallel_size} over {parallel.nnodes} node(s) "
                             f"needs {parallel.ranks_per_node} GPUs from {device} on, this node has "
                             f"{torch.cuda.device_count()}")
        if parallel.master_port is None:
            parallel = replace(parallel, master_port=free_port(parallel.master_addr))
        self.config = config
        self.parallel = parallel
        res = self._res = _Resources()
        self._finalizer = weakref.finalize(self, res.release)
        self._broken: str | None = None
        # The workers' watchers and the runner's hook reach this executor weakly: neither may keep
        # it alive (its finalizer stops the workers once it is dropped; the startup heap is frozen
        # out of the cyclic GC, so a cycle would keep it for good).
        me = weakref.proxy(self)
        death = weakref.WeakMethod(self._on_worker_death)
        try:
            res.workers = WorkerProcesses(config.options, parallel, range(1, parallel.ranks_per_node),
                                          lambda: (alive := death()) is not None and alive())
            res.group = self._connect(device)
            self.runner = ModelRunner(config, tp=res.group, eos_token_ids=eos_token_ids)
        except WorkerDiedError:
            self.shutdown()
            raise
        except BaseException as e:
            try:
                if _address_in_use(e):
                    raise OSError(f"tensor parallelism's master_port {parallel.master_port} on "
                                  f"{parallel.master_addr} is in use; give another or leave it unset") from e
                self._raise_if_worker_died(e)
            finally:
                self.shutdown()  # the workers started: stopped before the constructor raises
            raise
        self._plan: _C.StepPlan | None = None
        self.runner.before_logits = lambda rows: me._publish_logits(rows)

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

    def abandon(self, reason: str) -> None:
        """A step is hung (a stopped worker, say): fail the collective or ring wait it is in, and
        every later step; shutting down then kills the workers instead of asking them to stop."""
        self._broken = f"tensor parallelism failed: {reason}; the engine cannot continue"
        self._res.healthy = False
        self._on_worker_death()

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
        layout = PlanLayout.of(plan, self.config.block_size)
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

    def initialize_kv_cache(self) -> int:
        try:
            return super().initialize_kv_cache()
        except WorkerDiedError:
            raise
        except Exception as e:
            self._raise_if_worker_died(e)
            raise

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self._check()
        try:
            self._channel(so.plan).publish_step(so.plan, self._check)
            self._plan = so.plan
            return self.runner.execute(so)
        except WorkerDiedError:
            raise
        except Exception as e:
            self._raise_if_worker_died(e)
            raise
        except BaseException as e:
            # Interrupted mid-step (KeyboardInterrupt): the workers may be inside the step's
            # collectives, which the next step's would pair with. No later step can run.
            self._broken = (f"tensor parallelism failed: a step was interrupted ({type(e).__name__}) while the "
                            "workers ran it; the engine cannot continue (create a new one)")
            self._res.healthy = False
            raise

    def _publish_logits(self, rows: np.ndarray | None) -> None:
        """The runner's before_logits hook; None: the step's sample indices."""
        self._check()
        assert self._res.channel is not None and self._plan is not None
        host = self._plan.sample_indices if rows is None else rows
        self._res.channel.publish_logits(host.astype(np.int32, copy=False), self._check)

    @property
    def worker_pids(self) -> list[int]:
        return [] if self._res.workers is None else self._res.workers.pids

    def shutdown(self) -> None:
        """Stop the workers (STOP through the channel, kill if they do not leave) and release the
        group. Also runs when the executor is garbage collected and at interpreter exit."""
        self._finalizer()
