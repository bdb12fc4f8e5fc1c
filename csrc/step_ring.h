// Rank 0's end of the tensor-parallel step ring in shared memory. The layout and the protocol are
// nanovllm/distributed/shm_ring.py's (its docstring): a control area of int64 words (the published
// message number at [0], worker w's ack at [8 * (1 + w)]), then slots of a 16-int32 header
// (message number, kind, the plan's counts, rows) and a payload in the StepPlan buffer's layout.
// Each publish is one call: a step costs the bytes it writes, not a Python interpreter's trip
// through numpy items (which, with cold caches between two steps, cost ten times the copy).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "step_plan.h"

namespace nanovllm {

class StepRingWriter {
 public:
  // Header fields and message kinds (step_message.py's SEQ, KIND, NUM_TOKENS, NUM_ROWS; Kind).
  static constexpr int kSeq = 0, kKind = 1, kCounts = 2, kNumRows = 9, kHeaderInts = 16;
  static constexpr int32_t kStep = 1, kLogits = 2, kStop = 3;
  static constexpr int kLineInt64 = 8;

  // `control` and `slots` point into the mapped segment, which outlives this writer; `slot_ints`
  // is the header plus a payload of at least the plan buffer's size.
  StepRingWriter(int64_t* control, int32_t num_workers, int32_t* slots, int32_t num_slots, size_t slot_ints,
                 int32_t max_seqs);

  // Each returns false, writing nothing, while a worker still holds the slot the message needs
  // (the caller waits and retries); true once the message is published.
  bool try_publish_step(const StepPlan& plan);
  bool try_publish_rows(const int32_t* rows, int32_t num_rows);  // a LOGITS message
  bool try_publish_stop();

  int64_t next() const { return next_; }

 private:
  int32_t* claim(int32_t kind);  // the free slot's header, its number and kind written; or null
  void commit();

  int64_t* control_;
  int32_t num_workers_;
  int32_t* slots_;
  int32_t num_slots_;
  size_t slot_ints_;
  std::vector<PlanMirror> mirrors_;  // what each slot's block tables hold
  int64_t next_ = 1;
};

// A worker's end: waits on the published counter, reads a slot's header, acks.
class StepRingReader {
 public:
  StepRingReader(const int64_t* control, int32_t num_workers, int32_t worker_index, const int32_t* slots,
                 int32_t num_slots, size_t slot_ints);

  // Whether the next message is published (an acquire load: its slot's bytes are visible then).
  bool ready() const { return __atomic_load_n(control_, __ATOMIC_ACQUIRE) >= next_; }
  // The next message's header; throws if its slot holds another message number (out of step).
  const int32_t* header() const;
  int32_t slot() const { return static_cast<int32_t>(next_ % num_slots_); }
  // Done with the next message: release its slot (a release store of its number), move on.
  void ack();

 private:
  const int64_t* control_;
  int64_t* ack_;
  const int32_t* slots_;
  int32_t num_slots_;
  size_t slot_ints_;
  int64_t next_ = 1;
};

}  // namespace nanovllm
