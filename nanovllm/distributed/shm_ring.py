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

Rank 0's side is native (csrc/step_ring.h, StepRingWriter): one call per message writes the
header, the used part of each plan section (of the block tables only the entries the slot does
not hold yet, see StepPlan.copy_used / PlanMirror) and the counter. With cold caches between two
steps (a forward runs in between) each numpy item access in Python cost a microsecond or more.

Ordering: a reader acts on a slot only after it sees the counter reach the message's number, and
the writer stores the counter (an atomic release store) after the slot's bytes. The reader loads
the counter through numpy, a plain load, ordered before its later loads of the slot as x86-64
orders loads; the header repeats the message number, so a stale slot is caught as an error, not
run.

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
import struct
import time
from collections.abc import Callable

import _posixshmem
import numpy as np

from nanovllm._C import StepPlan, StepRingWriter
from nanovllm.distributed import step_message as sm
from nanovllm.distributed.step_message import KIND, NUM_ROWS, SEQ, Kind, Message, PlanLayout, ReceivedPlan

SLOTS = 2
_HEADER = struct.Struct(f"={sm.HEADER_INTS}i")
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
        # The reader's hot path reads the counter and a header through a memoryview and a Struct
        # (plain C calls): numpy's item access costs microseconds once caches went cold.
        self._words = memoryview(self._mmap).cast("q")[:control_bytes // 8]
        self._header_offsets = [control_bytes + 4 * i * self.slot_ints for i in range(SLOTS)]
        # A STEP's message object per slot, reused: valid, like the slot, until `ack()`.
        self._step_messages = [Message(Kind.STEP, plan=p, slot=i) for i, p in enumerate(self._plans)]
        if create:  # block-table columns past what any step copies read as the plan's padding
            for p in self._payloads:
                p[layout.offsets["block_tables"]:] = -1
        # Rank 0 writes through the native writer: one call per message (see csrc/step_ring.h).
        self._writer = StepRingWriter(ctl.ctypes.data, num_workers, slots.ctypes.data, SLOTS, self.slot_ints,
                                      layout.max_seqs, self._mmap) if create else None
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
        # numpy views of the slots may outlive this object in a caller's hands: the mapping stays
        # until they are gone.
        self._words.release()

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
        seq = self._next
        words = self._words
        if words[0] < seq:
            _wait(lambda: words[0] >= seq, alive, active_since=active_since or time.perf_counter())
        slot = seq % SLOTS
        h = _HEADER.unpack_from(self._mmap, self._header_offsets[slot])
        if h[SEQ] == seq & 0x7FFFFFFF:
            kind = h[KIND]
            if kind == _STEP:
                self._plans[slot].load(h)
                return self._step_messages[slot]
            if kind == _LOGITS:
                return Message(Kind.LOGITS, rows=self._payloads[slot][:h[NUM_ROWS]], slot=slot)
            if kind == _STOP:
                return Message(Kind.STOP, slot=slot)
        raise RuntimeError(f"shared-memory ring out of step: slot {slot} holds message {h[SEQ]} of kind {h[KIND]}, "
                           f"expected message {seq}")

    def ack(self) -> None:
        """Done with the last received message's slot."""
        self._words[self._ack_index] = self._next
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
