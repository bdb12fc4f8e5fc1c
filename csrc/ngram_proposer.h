// Prompt-lookup ("n-gram") drafts for speculative decoding: the tokens that followed the most
// recent earlier occurrence of the sequence's longest suffix n-gram, n in [min_n, max_n].
//
// Each sequence keeps one open-addressing table per n, from an n-gram's hash to the position where
// its latest occurrence ends. Positions are indexed lazily, as the sequence grows, so a step costs
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
    std::vector<uint64_t> keys;  // 0: empty
    std::vector<int32_t> ends;   // the n-gram's last position
    size_t size = 0;

    void insert(uint64_t key, int32_t end);
    int32_t find(uint64_t key) const;  // -1: absent
  };

  void index_up_to(std::span<const int32_t> tokens, int32_t min_n, int32_t end);

  std::vector<Table> tables_;  // tables_[n - min_n]
  int32_t indexed_ = 0;        // n-grams ending before this position are in the tables
};

}  // namespace nanovllm
