"""The step channel on one node: a ring of message slots in POSIX shared memory.

Rank 0 writes each message (docs: step_message) once into the next slot and then bumps a
published counter; every worker waits for the counter, reads the slot in place (its plan tensors
are views of the slot: no copy, no pickle) and, when it no longer needs the slot, stores the
message's number into its own ack word. Rank 0 reuses a slot only after every worker has acked
the message it held, so with two slots it can publish step s+1 while a worker is still finishing
step s.

Layout: a control area (the published counter and one ack word per worker, each int64 on its own
64-byte line, so the writer and the readers never share a cache line), then SLOTS slots of a
16-int32 header plus a payload in the StepPlan buffer's layout.

Ordering: a reader acts on a slot only after it sees the counter reach the message's number, and
the writer stores the counter (one aligned 8-byte store, atomic) after the slot's bytes. That the
slot's bytes are then visible too relies on the CPU keeping stores in order, as x86-64 does; the
header repeats the message number, so a stale slot is caught as an error, not run.

Waiting: a reader spins for SPIN_S (a step usually follows the previous one within that time
while generating), then sleeps with a short back-off (at most MAX_ACTIVE_NAP_S while the engine
was recently active, IDLE_NAP_S after that), so an idle worker costs no CPU and a busy spin never
starves rank 0 on a machine with few cores.

The segment has a random name and is unlinked as soon as every rank has attached it (the mapping
stays valid): nothing is left in /dev/shm whatever way the processes end.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections.abc import Callable

import _posixshmem
import numpy as np

from nanovllm._C import StepPlan
from nanovllm.distributed import step_message as sm
from nanovllm.distributed.step_message import Kind, Message, PlanLayout, ReceivedPlan, SectionCopier

SLOTS = 2
LINE_INT64 = 8  # one 64-byte cache line of int64 words
SPIN_S = 50e-6
FIRST_NAP_S = 20e-6
MAX_ACTIVE_NAP_S = 200e-6
ACTIVE_S = 0.05  # after this long without a message the reader naps IDLE_NAP_S at a time
IDLE_NAP_S = 2e-3
ALIVE_CHECK_S = 0.01  # how often a waiting writer or reader runs its liveness check


def _name() -> str:
    return f"/nanovllm-{os.getpid()}-{secrets.token_hex(8)}"


class ShmRing:
    """One end of the ring: rank 0 creates it (`create`), worker i attaches (`attach`)."""

    def __init__(self, name: str, layout: PlanLayout, num_workers: int, *, create: bool) -> None:
        if num_workers < 1:
            raise ValueError(f"a ring needs at least one reader, got {num_workers}")
        self.name = name
        self.layout = layout
        self.num_workers = num_workers
        self.slot_ints = sm.HEADER_INTS + layout.size
        control_bytes = 8 * LINE_INT64 * (1 + num_workers)
        size = control_bytes + 4 * SLOTS * self.slot_ints
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open(name, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"shared-memory segment {name} has {os.fstat(fd).st_size} bytes, expected {size} "
                                 "(engine options differ between ranks?)")
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._linked = create
        # Control words: [0] the last published message number; [LINE * (1 + w)] worker w's ack.
        self._ctl = np.frombuffer(self._mmap, dtype=np.int64, count=control_bytes // 8)
        slots = np.frombuffer(self._mmap, dtype=np.int32, offset=control_bytes).reshape(SLOTS, self.slot_ints)
        self._headers = [slots[i, :sm.HEADER_INTS] for i in range(SLOTS)]
        self._payloads = [slots[i, sm.HEADER_INTS:] for i in range(SLOTS)]
        self._plans = [ReceivedPlan(layout, p) for p in self._payloads]
        if create:  # block-table columns past what any step copies read as the plan's padding
            for p in self._payloads:
                p[layout.offsets["block_tables"]:] = -1
        self._copiers: list[SectionCopier] | None = None
        self._plan: StepPlan | None = None
        self._plan_address = 0
        self._next = 1  # the next message number to publish (writer) or to read (reader)
        self._ack_index = 0

    @classmethod
    def create(cls, layout: PlanLayout, num_workers: int) -> ShmRing:
        return cls(_name(), layout, num_workers, create=True)

    @classmethod
    def attach(cls, name: str, layout: PlanLayout, num_workers: int, worker_index: int) -> ShmRing:
        ring = cls(name, layout, num_workers, create=False)
        if not 0 <= worker_index < num_workers:
            raise ValueError(f"worker index {worker_index} outside [0, {num_workers})")
        ring._ack_index = LINE_INT64 * (1 + worker_index)
        return ring

    def unlink(self) -> None:
        """Remove the name (rank 0, once every worker has attached); the mapping stays usable."""
        if self._linked:
            self._linked = False
            try:
                _posixshmem.shm_unlink(self.name)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        # numpy views may outlive this object in a caller's hands; let the mapping go with them.
        self._ctl = None  # type: ignore[assignment]

    # Writer (rank 0) ---------------------------------------------------------------------

    def _claim(self, alive: Callable[[], None]) -> tuple[int, np.ndarray, int]:
        seq = self._next
        oldest = seq - SLOTS  # the message this slot held: every worker must be done with it
        if oldest > 0:
            acks = self._ctl[LINE_INT64::LINE_INT64]
            if int(acks.min()) < oldest:
                _wait(lambda: int(acks.min()) >= oldest, alive, active_since=time.perf_counter())
        slot = seq % SLOTS
        header = self._headers[slot]
        header[sm.SEQ] = seq & 0x7FFFFFFF
        return seq, header, slot

    def _commit(self, seq: int) -> None:
        self._ctl[0] = seq  # after the slot's bytes: readers act on it from here on
        self._next = seq + 1

    def publish_step(self, plan: StepPlan, alive: Callable[[], None] = lambda: None) -> None:
        seq, header, slot = self._claim(alive)
        # The same wrapper is the same buffer; only a new one needs the (slow, ~4 us) address check.
        if plan is not self._plan:
            src = plan.buffer
            if self._copiers is None or src.ctypes.data != self._plan_address:
                self._plan_address = src.ctypes.data
                self._copiers = [SectionCopier(self.layout, src, p) for p in self._payloads]
            self._plan = plan
        assert self._copiers is not None
        sm.fill_step_header(header, plan)
        self._copiers[slot].copy(plan.num_tokens, plan.num_seqs, plan.num_samples, plan.num_copies,
                                 int(header[sm.MAX_SEQLEN_K]))
        self._commit(seq)

    def publish_logits(self, rows: np.ndarray, alive: Callable[[], None] = lambda: None) -> None:
        seq, header, slot = self._claim(alive)
        header[sm.KIND] = Kind.LOGITS
        header[sm.NUM_ROWS] = len(rows)
        self._payloads[slot][:len(rows)] = rows
        self._commit(seq)

    def publish_stop(self, alive: Callable[[], None] = lambda: None) -> None:
        seq, header, _ = self._claim(alive)
        header[sm.KIND] = Kind.STOP
        self._commit(seq)

    # Reader (workers) --------------------------------------------------------------------

    def receive(self, alive: Callable[[], None] = lambda: None, active_since: float | None = None) -> Message:
        """The next message; its slot stays valid until `ack()`. `active_since` (perf_counter) is
        when the caller last had work: it naps shortly until ACTIVE_S after that, then idles."""
        seq = self._next
        ctl = self._ctl
        if ctl[0] < seq:
            _wait(lambda: ctl[0] >= seq, alive, active_since=active_since or time.perf_counter())
        slot = seq % SLOTS
        header = self._headers[slot]
        if header[sm.SEQ] != seq & 0x7FFFFFFF:
            raise RuntimeError(f"shared-memory ring out of step: slot {slot} holds message {header[sm.SEQ]}, "
                               f"expected {seq}")
        kind = Kind(int(header[sm.KIND]))
        if kind is Kind.STEP:
            return Message(kind, plan=self._plans[slot].load(header), slot=slot)
        if kind is Kind.LOGITS:
            return Message(kind, rows=self._payloads[slot][:int(header[sm.NUM_ROWS])], slot=slot)
        return Message(kind, slot=slot)

    def ack(self) -> None:
        """Done with the last received message's slot."""
        self._ctl[self._ack_index] = self._next
        self._next += 1


def _wait(ready: Callable[[], bool], alive: Callable[[], None], *, active_since: float) -> None:
    """Spin briefly, then nap with back-off until `ready()`; `alive()` (which raises when the
    other side is gone) runs every ALIVE_CHECK_S."""
    now = time.perf_counter
    spin_until = now() + SPIN_S
    while now() < spin_until:
        if ready():
            return
    nap = FIRST_NAP_S
    next_check = now() + ALIVE_CHECK_S
    while not ready():
        t = now()
        if t >= next_check:
            alive()
            next_check = t + ALIVE_CHECK_S
        time.sleep(nap if t - active_since < ACTIVE_S else IDLE_NAP_S)
        nap = min(2 * nap, MAX_ACTIVE_NAP_S)
