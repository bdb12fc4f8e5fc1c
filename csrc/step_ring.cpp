#include "step_ring.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace nanovllm {

StepRingWriter::StepRingWriter(int64_t* control, int32_t num_workers, int32_t* slots, int32_t num_slots,
                               size_t slot_ints, int32_t max_seqs)
    : control_(control), num_workers_(num_workers), slots_(slots), num_slots_(num_slots), slot_ints_(slot_ints),
      mirrors_(num_slots, PlanMirror(max_seqs)) {}

int32_t* StepRingWriter::claim(int32_t kind) {
  const int64_t oldest = next_ - num_slots_;  // the message the slot held: every worker acked it?
  if (oldest > 0) {
    for (int32_t w = 0; w < num_workers_; ++w) {
      if (__atomic_load_n(control_ + kLineInt64 * (1 + w), __ATOMIC_ACQUIRE) < oldest) return nullptr;
    }
  }
  int32_t* header = slots_ + static_cast<size_t>(next_ % num_slots_) * slot_ints_;
  header[kSeq] = static_cast<int32_t>(next_ & 0x7FFFFFFF);
  header[kKind] = kind;
  return header;
}

void StepRingWriter::commit() {
  // Release: a worker that sees the number also sees the slot's bytes written before it.
  __atomic_store_n(control_, next_, __ATOMIC_RELEASE);
  ++next_;
}

bool StepRingWriter::try_publish_step(const StepPlan& plan) {
  if (plan.buffer().size() + kHeaderInts > slot_ints_ || plan.num_seqs() > mirrors_[0].rows()) {
    throw std::length_error("the plan is larger than the ring's slots (engine options differ?)");
  }
  int32_t* header = claim(kStep);
  if (header == nullptr) return false;
  plan.copy_used(header + kCounts, header + kHeaderInts, mirrors_[next_ % num_slots_]);
  commit();
  return true;
}

bool StepRingWriter::try_publish_rows(const int32_t* rows, int32_t num_rows) {
  if (static_cast<size_t>(num_rows) + kHeaderInts > slot_ints_) throw std::length_error("too many rows for a slot");
  int32_t* header = claim(kLogits);
  if (header == nullptr) return false;
  header[kNumRows] = num_rows;
  std::memcpy(header + kHeaderInts, rows, static_cast<size_t>(num_rows) * sizeof(int32_t));
  commit();
  return true;
}

bool StepRingWriter::try_publish_stop() {
  if (claim(kStop) == nullptr) return false;
  commit();
  return true;
}

StepRingReader::StepRingReader(const int64_t* control, int32_t num_workers, int32_t worker_index,
                               const int32_t* slots, int32_t num_slots, size_t slot_ints)
    : control_(control),
      ack_(const_cast<int64_t*>(control) + StepRingWriter::kLineInt64 * (1 + worker_index)),
      slots_(slots), num_slots_(num_slots), slot_ints_(slot_ints) {
  if (worker_index < 0 || worker_index >= num_workers) throw std::out_of_range("worker index outside the ring");
}

const int32_t* StepRingReader::header() const {
  const int32_t* h = slots_ + static_cast<size_t>(next_ % num_slots_) * slot_ints_;
  if (h[StepRingWriter::kSeq] != static_cast<int32_t>(next_ & 0x7FFFFFFF)) {
    throw std::runtime_error("shared-memory ring out of step: slot " + std::to_string(slot()) + " holds message " +
                             std::to_string(h[StepRingWriter::kSeq]) + ", expected " + std::to_string(next_));
  }
  return h;
}

void StepRingReader::ack() {
  __atomic_store_n(ack_, next_, __ATOMIC_RELEASE);
  ++next_;
}

}  // namespace nanovllm
