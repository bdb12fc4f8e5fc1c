// Open-addressing map from block hash to block id, sized once for the pool.
// Keys are XXH64 outputs, already uniformly spread, so the low bits index the table directly.
// Linear probing with backward-shift deletion keeps lookups short without tombstones.
#pragma once

#include <bit>
#include <cstdint>
#include <vector>

namespace nanovllm {

class HashIndex {
 public:
  explicit HashIndex(size_t max_entries)
      : slots_(std::bit_ceil(std::max<size_t>(16, 2 * max_entries))),
        mask_(slots_.size() - 1) {}

  // Block id stored under `key`, or -1.
  int32_t find(uint64_t key) const {
    for (size_t i = key & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.value < 0) return -1;
      if (s.key == key) return s.value;
    }
  }

  // Inserts only when `key` is absent; returns whether it inserted.
  bool insert(uint64_t key, int32_t value) {
    for (size_t i = key & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.value < 0) {
        s = {key, value};
        ++size_;
        return true;
      }
      if (s.key == key) return false;
    }
  }

  void erase(uint64_t key) {
    size_t i = key & mask_;
    while (true) {
      if (slots_[i].value < 0) return;
      if (slots_[i].key == key) break;
      i = (i + 1) & mask_;
    }
    // Backward shift: pull later entries of the probe run into the hole when their home slot
    // does not lie cyclically in (hole, j].
    size_t hole = i;
    for (size_t j = (hole + 1) & mask_; slots_[j].value >= 0; j = (j + 1) & mask_) {
      const size_t home = slots_[j].key & mask_;
      const bool home_in_range = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!home_in_range) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Slot{};
    --size_;
  }

  size_t size() const { return size_; }

 private:
  struct Slot {
    uint64_t key = 0;
    int32_t value = -1;
  };
  std::vector<Slot> slots_;
  size_t mask_;
  size_t size_ = 0;
};

}  // namespace nanovllm
