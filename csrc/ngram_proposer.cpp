#include "ngram_proposer.h"

#include <algorithm>

namespace nanovllm {

namespace {

// Never 0 (the empty key). Collisions only cost a draft: a hit is verified against the tokens.
uint64_t ngram_key(const int32_t* first, int32_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ static_cast<uint64_t>(n);
  for (int32_t i = 0; i < n; ++i) {
    h ^= static_cast<uint32_t>(first[i]);
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 31;
  }
  return h | 1;
}

}  // namespace

void NgramIndex::Table::insert(uint64_t key, int32_t end) {
  if (2 * (size + 1) > keys.size()) {
    std::vector<uint64_t> old_keys(std::max<size_t>(64, 2 * keys.size()), 0);
    std::vector<Ends> old_ends(old_keys.size());
    old_keys.swap(keys);
    old_ends.swap(ends);
    size = 0;
    const size_t mask = keys.size() - 1;
    for (size_t j = 0; j < old_keys.size(); ++j) {
      if (old_keys[j] == 0) continue;
      size_t i = old_keys[j] & mask;
      while (keys[i] != 0) i = (i + 1) & mask;
      keys[i] = old_keys[j];
      ends[i] = old_ends[j];
      ++size;
    }
  }
  const size_t mask = keys.size() - 1;
  for (size_t i = key & mask;; i = (i + 1) & mask) {
    if (keys[i] == key) {
      ends[i].last = end;
      return;
    }
    if (keys[i] == 0) {
      keys[i] = key;
      ends[i] = {end, end};
      ++size;
      return;
    }
  }
}

NgramIndex::Table::Ends NgramIndex::Table::find(uint64_t key) const {
  if (keys.empty()) return {};
  const size_t mask = keys.size() - 1;
  for (size_t i = key & mask;; i = (i + 1) & mask) {
    if (keys[i] == key) return ends[i];
    if (keys[i] == 0) return {};
  }
}

void NgramIndex::index_up_to(std::span<const int32_t> tokens, int32_t min_n, int32_t end) {
  for (int32_t e = indexed_; e < end; ++e) {
    for (size_t t = 0; t < tables_.size(); ++t) {
      const int32_t n = min_n + static_cast<int32_t>(t);
      if (e + 1 < n) break;
      tables_[t].insert(ngram_key(tokens.data() + e + 1 - n, n), e);
    }
  }
  indexed_ = std::max(indexed_, end);
}

void NgramIndex::propose(std::span<const int32_t> tokens, int32_t min_n, int32_t max_n, int32_t max_drafts,
                         std::vector<int32_t>& out) {
  const int32_t len = static_cast<int32_t>(tokens.size());
  if (max_drafts <= 0 || len < min_n + 1) return;
  tables_.resize(static_cast<size_t>(max_n - min_n + 1));
  // The suffix itself (ending at len - 1) must not match itself: index n-grams ending before it.
  index_up_to(tokens, min_n, len - 1);
  for (int32_t n = std::min(max_n, len - 1); n >= min_n; --n) {
    const int32_t* suffix = tokens.data() + len - n;
    const Table::Ends found = tables_[n - min_n].find(ngram_key(suffix, n));
    const int32_t e = len - 1 - found.last >= max_drafts ? found.last : found.first;
    if (e < 0 || !std::equal(suffix, suffix + n, tokens.data() + e + 1 - n)) continue;
    const int32_t stop = std::min(len, e + 1 + max_drafts);
    out.insert(out.end(), tokens.begin() + e + 1, tokens.begin() + stop);
    return;
  }
}

}  // namespace nanovllm
