"""Tensor parallelism's per-step broadcast: microseconds to publish a step to the workers and to
receive it, at 256 decoding sequences, block size 16, context 1024 (docs/design.md, "Tensor
parallelism"). Target: at most 20 us.

Rows:
- `shm_ring`: ours. rank 0's `ShmRing.publish_step(plan)` (one native call: header, the used part
  of each plan section, the block-table entries new to the slot, the counter) and a worker's
  `receive()` + `ack()` (one native poll returns the header; it reads the slot in place). Both ends
  run in this process, one after the other, so the numbers are the work of each end, without the
  wake-up latency of a waiting worker (that depends on its spin/nap state; see shm_ring's
  docstring). `us_total` is their sum per step. The pickle row's work runs between two steps, so
  caches are as cold as after a forward; back to back, with warm caches, publish + receive cost
  about 5 us on the machine of RESULTS.md. On a machine whose other CPUs are busy the numbers
  swing by 2x between runs: compare rows of one run (the ratio to the pickle row is steadier).
- `pickle_nanovllm_style`: the same step as nano-vllm sends it: `pickle.dumps(["run", seqs, False])`
  of 256 decoding sequences as its Sequence.__getstate__ makes them (num_tokens,
  num_prompt_tokens, num_cached_tokens, block_table, last_token), written into a shared buffer
  with its length, and `pickle.loads` on the other side.

Medians over the timed steps; the scheduler runs its real decode steps in between (untimed), so
block tables grow as they would. Run with OMP_NUM_THREADS=1; the header says how busy other
processes kept the machine.

Usage: python benchmarks/tp_broadcast.py [--steps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import time
from pathlib import Path

import numpy as np

from bench_report import cpu_busy_seconds, machine, markdown_table, write_json
from nanovllm._C import Scheduler
from nanovllm.distributed.shm_ring import ShmRing
from nanovllm.distributed.step_message import PlanLayout

NUM_SEQS, BLOCK_SIZE, CONTEXT, VOCAB = 256, 16, 1024, 32000
TARGET_US = 20.0


def decoding_scheduler() -> Scheduler:
    sched = Scheduler(num_blocks=NUM_SEQS * (CONTEXT // BLOCK_SIZE + 8), block_size=BLOCK_SIZE, max_num_seqs=NUM_SEQS,
                      max_num_batched_tokens=8192, max_model_len=4096, vocab_size=VOCAB)
    rng = random.Random(0)
    for i in range(NUM_SEQS):
        sched.add(i, [rng.randrange(1, VOCAB) for _ in range(CONTEXT - 8)], max_tokens=1 << 30, ignore_eos=True)
    while True:  # prefill everything, then it decodes
        plan = sched.schedule()
        decoding = plan.num_prefill_tokens == 0 and plan.num_seqs == NUM_SEQS
        sched.postprocess(np.ones(plan.num_samples, dtype=np.int32))
        if decoding:
            return sched


def run(steps: int) -> list[dict[str, object]]:
    sched = decoding_scheduler()
    plan = sched.schedule()
    layout = PlanLayout.of(plan, BLOCK_SIZE)
    writer = ShmRing.create(layout, num_workers=1)
    reader = ShmRing.attach(writer.name, layout, 1, 0)
    writer.unlink()
    shared = bytearray(1 << 22)  # nano-vllm's segment (1 MiB there; ours is big enough for any step)
    pub, recv, pdump, pload = [], [], [], []
    now = time.perf_counter_ns
    for _ in range(steps):
        t0 = now()
        writer.publish_step(plan)
        t1 = now()
        reader.receive()
        reader.ack()
        t2 = now()
        pub.append(t1 - t0)
        recv.append(t2 - t1)
        # nano-vllm: each decoding Sequence pickles to this tuple; the block table is a list.
        seqs = [(int(c), 0, 0, plan.block_tables[i][:-(-int(c) // BLOCK_SIZE)].tolist(), 1)
                for i, c in enumerate(plan.context_lens)]
        t3 = now()
        data = pickle.dumps(["run", seqs, False])
        shared[0:4] = len(data).to_bytes(4, "little")
        shared[4:4 + len(data)] = data
        t4 = now()
        pickle.loads(shared[4:4 + int.from_bytes(shared[0:4], "little")])
        t5 = now()
        pdump.append(t4 - t3)
        pload.append(t5 - t4)
        sched.postprocess(np.ones(plan.num_samples, dtype=np.int32))
        plan = sched.schedule()
    reader.close()
    writer.close()

    def us(xs: list[int]) -> float:
        return round(statistics.median(xs) / 1000, 2)

    total = [a + b for a, b in zip(pub, recv)]
    ptotal = [a + b for a, b in zip(pdump, pload)]
    return [
        {"method": "shm_ring", "us_publish": us(pub), "us_receive": us(recv), "us_total": us(total)},
        {"method": "pickle_nanovllm_style", "us_publish": us(pdump), "us_receive": us(pload), "us_total": us(ptotal)},
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    busy0, t0 = cpu_busy_seconds(), time.time()
    rows = run(args.steps)
    busy1, wall = cpu_busy_seconds(), time.time() - t0
    load = None if busy0 is None or busy1 is None else round((busy1 - busy0) / wall, 2)
    print(f"machine: {machine()}; other load: ~{load} busy CPUs during the run (this run uses 1)")
    print(f"{NUM_SEQS} decoding sequences, block size {BLOCK_SIZE}, context {CONTEXT}; median over {args.steps} steps")
    print(markdown_table(rows, ["method", "us_publish", "us_receive", "us_total"]))
    ok = rows[0]["us_total"] <= TARGET_US  # type: ignore[operator]
    print(f"target: shm_ring us_total <= {TARGET_US}: {'met' if ok else 'NOT met'}")
    if args.json:
        write_json(args.json, {"machine": machine(), "load_busy_cpus": load, "steps": args.steps, "rows": rows,
                               "target_us": TARGET_US, "target_met": ok})


if __name__ == "__main__":
    main()
