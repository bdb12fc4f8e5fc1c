// Prompt-lookup ("n-gram") drafts for speculative decoding: the tokens that followed an earlier
// occurrence of the sequence's longest suffix n-gram, n in [min_n, max_n]: the latest one when
// enough tokens follow it (recent text predicts best), else the earliest (vLLM's choice), which has
// the most (in a repeating run the latest ends right before the suffix: one token would follow).
//
// Each sequence keeps one open-addressing table per n, from an n-gram's hash to the positions where
// its first and latest occurrences end. Positions are indexed lazily, as the sequence grows, so a step costs
// a few inserts and at most max_n - min_n + 1 look-ups per sequence, whatever its length.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace nanovllm {

class NgramIndex {
 public:
  // Appends to `out` up to `max_drafts` tokens (none when no suffix n-gram occurred before).
  void propose(std::span<const int32_t> tokens, int32_t min_n, int32_t max_n, int32_t max_drafts,
               std::vector<int32_t>& out);

 private:
  struct Table {
    struct Ends {
      int32_t first = -1, last = -1;  // the n-gram's last position, in its first and latest occurrence
    };
    std::vector<uint64_t> keys;  // 0: empty
    std::vector<Ends> ends;
    size_t size = 0;

    void insert(uint64_t key, int32_t end);
    Ends find(uint64_t key) const;  // {-1, -1}: absent
  };

  void index_up_to(std::span<const int32_t> tokens, int32_t min_n, int32_t end);

  std::vector<Table> tables_;  // tables_[n - min_n]
  int32_t indexed_ = 0;        // n-grams ending before this position are in the tables
};

}  // namespace nanovllm
