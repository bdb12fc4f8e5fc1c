#include "block_pool.h"

#include <algorithm>
#include <cstring>

namespace nanovllm {

BlockPool::BlockPool(int32_t num_blocks, int32_t block_size)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      ref_(num_blocks, 0),
      prev_(num_blocks, -1),
      next_(num_blocks, -1),
      hash_(num_blocks, 0),
      hashed_(num_blocks, 0),
      tokens_(static_cast<size_t>(num_blocks) * block_size, 0),
      index_(num_blocks) {
  for (int32_t b = 0; b < num_blocks; ++b) push_tail(b);
}

void BlockPool::unlink(int32_t b) {
  const int32_t p = prev_[b], n = next_[b];
  (p >= 0 ? next_[p] : head_) = n;
  (n >= 0 ? prev_[n] : tail_) = p;
  prev_[b] = next_[b] = -1;
  --num_free_;
}

void BlockPool::push_head(int32_t b) {
  prev_[b] = -1;
  next_[b] = head_;
  (head_ >= 0 ? prev_[head_] : tail_) = b;
  head_ = b;
  ++num_free_;
}

void BlockPool::push_tail(int32_t b) {
  next_[b] = -1;
  prev_[b] = tail_;
  (tail_ >= 0 ? next_[tail_] : head_) = b;
  tail_ = b;
  ++num_free_;
}

void BlockPool::drop_hash(int32_t b) {
  if (!hashed_[b]) return;
  index_.erase(hash_[b]);
  hashed_[b] = 0;
}

int32_t BlockPool::allocate() {
  const int32_t b = head_;
  unlink(b);
  drop_hash(b);
  ref_[b] = 1;
  return b;
}

void BlockPool::touch(int32_t b) {
  if (ref_[b] == 0) unlink(b);
  ++ref_[b];
}

void BlockPool::free(int32_t b) {
  if (--ref_[b] > 0) return;
  if (hashed_[b]) {
    push_tail(b);
  } else {
    push_head(b);
  }
}

bool BlockPool::register_block(int32_t b, uint64_t hash, std::span<const int32_t> tokens) {
  if (hashed_[b] || !index_.insert(hash, b)) return false;
  hashed_[b] = 1;
  hash_[b] = hash;
  std::copy(tokens.begin(), tokens.end(), tokens_.begin() + static_cast<size_t>(b) * block_size_);
  return true;
}

int32_t BlockPool::lookup(uint64_t hash, std::span<const int32_t> tokens) const {
  const int32_t b = index_.find(hash);
  if (b < 0) return -1;
  const int32_t* stored = tokens_.data() + static_cast<size_t>(b) * block_size_;
  return std::memcmp(stored, tokens.data(), tokens.size_bytes()) == 0 ? b : -1;
}

void BlockPool::reset_prefix_cache() {
  for (int32_t b = 0; b < num_blocks_; ++b) {
    if (ref_[b] == 0) drop_hash(b);
  }
}

std::vector<int32_t> BlockPool::free_queue() const {
  std::vector<int32_t> out;
  out.reserve(num_free_);
  for (int32_t b = head_; b >= 0; b = next_[b]) out.push_back(b);
  return out;
}

}  // namespace nanovllm
