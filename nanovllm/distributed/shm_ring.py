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

Both ends are native (csrc/step_ring.h): rank 0's StepRingWriter writes a message in one call
(the header, the used part of each plan section, of the block tables only the entries the slot
does not hold yet, see StepPlan.copy_used / PlanMirror, then the counter); a worker's
StepRingReader polls the counter and returns the header's fields, and acks. With cold caches
between two steps (a forward runs in between) each numpy item access, slice or struct call in
Python cost microseconds.

Ordering: a reader acts on a slot only after it sees the counter reach the message's number: the
writer stores the counter with release semantics after the slot's bytes, the reader loads it
with acquire semantics before reading them, and acks (release) when done with the slot. The
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

from nanovllm._C import StepPlan, StepRingReader, StepRingWriter
from nanovllm.distributed import step_message as sm
from nanovllm.distributed.step_message import KIND, NUM_ROWS, Kind, Message, PlanLayout, ReceivedPlan

SLOTS = 2
_STEP, _LOGITS, _STOP = int(Kind.STEP), int(Kind.LOGITS), int(Kind.STOP)  # plain ints: cheaper compares
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
        ctl = np.frombuffer(self._mmap, dtype=np.int64, count=control_bytes // 8)
        slots = np.frombuffer(self._mmap, dtype=np.int32, offset=control_bytes).reshape(SLOTS, self.slot_ints)
        self._payloads = [slots[i, sm.HEADER_INTS:] for i in range(SLOTS)]
        self._plans = [ReceivedPlan(layout, p) for p in self._payloads]
        # A STEP's message object per slot, reused: valid, like the slot, until `ack()`.
        self._step_messages = [Message(Kind.STEP, plan=p, slot=i) for i, p in enumerate(self._plans)]
        if create:  # block-table columns past what any step copies read as the plan's padding
            for p in self._payloads:
                p[layout.offsets["block_tables"]:] = -1
        # Both ends are native (csrc/step_ring.h), one call per message: with caches cold between
        # two steps each numpy item access, slice or struct call in Python cost microseconds.
        self._addresses = (ctl.ctypes.data, slots.ctypes.data)
        self._writer = StepRingWriter(ctl.ctypes.data, num_workers, slots.ctypes.data, SLOTS, self.slot_ints,
                                      layout.max_seqs, self._mmap) if create else None
        self._reader: StepRingReader | None = None

    @classmethod
    def create(cls, layout: PlanLayout, num_workers: int) -> ShmRing:
        return cls(_name(), layout, num_workers, create=True)

    @classmethod
    def attach(cls, name: str, layout: PlanLayout, num_workers: int, worker_index: int) -> ShmRing:
        ring = cls(name, layout, num_workers, create=False)
        if not 0 <= worker_index < num_workers:
            raise ValueError(f"worker index {worker_index} outside [0, {num_workers})")
        ctl, slots = ring._addresses
        ring._reader = StepRingReader(ctl, num_workers, worker_index, slots, SLOTS, ring.slot_ints, ring._mmap)
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
        # numpy views of the slots may outlive this object in a caller's hands: the mapping stays
        # until they are gone.

    # Writer (rank 0) ---------------------------------------------------------------------

    def _publish(self, try_publish: Callable[[], bool], alive: Callable[[], None]) -> None:
        """Publish into the next slot, first waiting (and checking `alive`) while a worker still
        holds it."""
        if not try_publish():
            _wait(try_publish, alive, active_since=time.perf_counter())

    def publish_step(self, plan: StepPlan, alive: Callable[[], None] = lambda: None) -> None:
        w = self._writer
        assert w is not None, "only the ring's creator publishes"
        if not w.try_publish_step(plan):
            self._publish(lambda: w.try_publish_step(plan), alive)

    def publish_logits(self, rows: np.ndarray, alive: Callable[[], None] = lambda: None) -> None:
        w = self._writer
        assert w is not None, "only the ring's creator publishes"
        self._publish(lambda: w.try_publish_rows(rows), alive)

    def publish_stop(self, alive: Callable[[], None] = lambda: None) -> None:
        w = self._writer
        assert w is not None, "only the ring's creator publishes"
        self._publish(w.try_publish_stop, alive)

    # Reader (workers) --------------------------------------------------------------------

    def receive(self, alive: Callable[[], None] = lambda: None, active_since: float | None = None) -> Message:
        """The next message; its slot stays valid until `ack()`. `active_since` (perf_counter) is
        when the caller last had work: it naps shortly until ACTIVE_S after that, then idles."""
        r = self._reader
        assert r is not None, "only an attached worker receives"
        h = r.poll()
        if h is None:
            _wait(r.ready, alive, active_since=active_since or time.perf_counter())
            h = r.poll()
        # h: (slot, kind, the seven counts, rows) at the header's indices.
        slot, kind = h[0], h[KIND]
        if kind == _STEP:
            self._plans[slot].load(h)
            return self._step_messages[slot]
        if kind == _LOGITS:
            return Message(Kind.LOGITS, rows=self._payloads[slot][:h[NUM_ROWS]], slot=slot)
        if kind == _STOP:
            return Message(Kind.STOP, slot=slot)
        raise RuntimeError(f"shared-memory ring: slot {slot} holds a message of unknown kind {kind}")

    def ack(self) -> None:
        """Done with the last received message's slot."""
        assert self._reader is not None
        self._reader.ack()


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
