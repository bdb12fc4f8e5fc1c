// Physical KV-cache blocks: ref counts, the free queue and the prefix-cache index.
//
// A free block (ref count 0) sits in one doubly linked free queue threaded through two index
// arrays, so a cached block that gets a prefix hit leaves the queue in O(1). Allocation takes
// the head. Freed blocks that hold a hash go to the tail (kept as cache, evicted least recently
// freed first); freed blocks without a hash go to the head, since they are worth nothing and
// should be reused before any cached block is evicted.
//
// Internal methods trust their arguments; the bindings validate.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "hash_index.h"

namespace nanovllm {

class BlockPool {
 public:
  BlockPool(int32_t num_blocks, int32_t block_size);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t block_size() const { return block_size_; }
  int32_t num_free() const { return num_free_; }
  int32_t num_used() const { return num_blocks_ - num_free_; }
  int32_t num_cached() const { return static_cast<int32_t>(index_.size()); }

  // Takes the head of the free queue (evicting its hash). Caller checks num_free() > 0.
  int32_t allocate();
  // Adds a reference; a free block leaves the free queue.
  void touch(int32_t block);
  // Drops a reference; at zero the block joins the free queue.
  void free(int32_t block);

  // Offers a full, computed block to the prefix cache. Returns false (and leaves the block
  // unhashed) if it already has a hash or another block holds this hash.
  bool register_block(int32_t block, uint64_t hash, std::span<const int32_t> tokens);
  // The cached block with this hash whose token ids equal `tokens`, or -1.
  int32_t lookup(uint64_t hash, std::span<const int32_t> tokens) const;
  // Drops every cached hash that no sequence is using.
  void reset_prefix_cache();

  int32_t ref_count(int32_t block) const { return ref_[block]; }
  bool has_hash(int32_t block) const { return hashed_[block] != 0; }
  uint64_t hash_of(int32_t block) const { return hash_[block]; }
  std::vector<int32_t> free_queue() const;

 private:
  void unlink(int32_t block);
  void push_head(int32_t block);
  void push_tail(int32_t block);
  void drop_hash(int32_t block);

  int32_t num_blocks_;
  int32_t block_size_;
  int32_t num_free_ = 0;
  std::vector<int32_t> ref_;
  std::vector<int32_t> prev_, next_;  // free queue links; -1 ends
  int32_t head_ = -1, tail_ = -1;
  std::vector<uint64_t> hash_;
  std::vector<uint8_t> hashed_;
  std::vector<int32_t> tokens_;  // token ids of each hashed block, to verify hits
  HashIndex index_;
};

}  // namespace nanovllm
