"""The step channel across nodes: each message is a torch.distributed broadcast from rank 0 over
the group's gloo (host) connections, in two parts: the fixed header, then the payload it sizes
(the used prefix of the StepPlan buffer, or a LOGITS message's row indices). Same messages and
interface as shm_ring, one buffer instead of a ring: a broadcast returns on a worker only when the
bytes are in its own buffer, and the worker is done with them before it takes the next message."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch

from nanovllm._C import StepPlan
from nanovllm.distributed import step_message as sm
from nanovllm.distributed.parallel_state import TPGroup
from nanovllm.distributed.step_message import Kind, Message, PlanLayout, ReceivedPlan

# A worker waits for the next header for as long as the engine is idle; a dead rank 0 still ends
# the wait at once (its connections close).
IDLE_TIMEOUT = timedelta(days=365)


class BroadcastChannel:
    def __init__(self, group: TPGroup, layout: PlanLayout) -> None:
        self.group = group
        self.layout = layout
        self._header = torch.zeros(sm.HEADER_INTS, dtype=torch.int32)
        self._buffer = torch.zeros(layout.size, dtype=torch.int32)  # the plan-layout buffer sent / received
        self._buffer[layout.offsets["block_tables"]:] = -1  # as the plan's padding
        self._plan = ReceivedPlan(layout, self._buffer.numpy())
        self._writer = sm.StepWriter(self._header.numpy(), self._plan.buffer, layout)

    def _send(self, payload: torch.Tensor | None) -> None:
        self.group.broadcast_host(self._header)
        if payload is not None and payload.numel():
            self.group.broadcast_host(payload)

    def publish_step(self, plan: StepPlan, alive: Callable[[], None] = lambda: None) -> None:
        self._writer.write(plan)
        self._send(self._buffer[:self.layout.used_size(plan.num_seqs)])

    def publish_logits(self, rows: np.ndarray, alive: Callable[[], None] = lambda: None) -> None:
        h = self._header.numpy()
        h[sm.KIND] = Kind.LOGITS
        h[sm.NUM_ROWS] = len(rows)
        self._send(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int32)))

    def publish_stop(self, alive: Callable[[], None] = lambda: None) -> None:
        self._header.numpy()[sm.KIND] = Kind.STOP
        self._send(None)

    def receive(self, alive: Callable[[], None] = lambda: None, active_since: float | None = None) -> Message:
        self.group.broadcast_host(self._header, IDLE_TIMEOUT)
        h = self._header.tolist()
        kind = sm.KINDS[h[sm.KIND]]
        if kind is Kind.STEP:
            self.group.broadcast_host(self._buffer[:self.layout.used_size(h[sm.NUM_SEQS])])
            return Message(kind, plan=self._plan.load(h))
        if kind is Kind.LOGITS:
            rows = self._buffer[:h[sm.NUM_ROWS]]
            if rows.numel():
                self.group.broadcast_host(rows)
            return Message(kind, rows=rows.numpy())
        return Message(kind)

    def ack(self) -> None:
        """Nothing to release: the next broadcast overwrites the buffer only when the worker asks."""

    def unlink(self) -> None:
        """No shared name to remove."""

    def close(self) -> None:
        """Nothing to release beyond the group, which its owner closes."""
