// Per-sequence block tables over the BlockPool: prefix-cache hits on admission, slots for new
// tokens (with copy-on-write of shared partly filled blocks), caching of blocks as they fill,
// fork and free.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "block_pool.h"
#include "sequence.h"

namespace nanovllm {

// Extends seq.block_hashes to every full block of seq.tokens.
void hash_full_blocks(Sequence& seq, int32_t block_size);

class KVCacheManager {
 public:
  KVCacheManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching);

  BlockPool& pool() { return pool_; }
  const BlockPool& pool() const { return pool_; }
  int32_t block_size() const { return block_size_; }
  bool prefix_caching() const { return prefix_caching_; }

  // For a sequence with no blocks: the cached blocks its tokens can reuse (verified against
  // their token ids), never covering the last token. Does not modify anything.
  std::vector<int32_t> find_cached_prefix(Sequence& seq) const;

  // Takes the blocks `hits` returned for `seq` plus what `num_new_tokens` more need; false (and
  // nothing changed) when the pool cannot supply them.
  bool allocate_with_prefix(Sequence& seq, const std::vector<int32_t>& hits, int32_t num_new_tokens,
                            std::vector<std::pair<int32_t, int32_t>>& copies);

  // Makes room for `num_new_tokens` tokens after seq.num_computed: copies a shared partly filled
  // block first (recorded in `copies`), then allocates blocks as needed. False (and nothing
  // changed) when the pool cannot supply them.
  bool allocate_slots(Sequence& seq, int32_t num_new_tokens,
                      std::vector<std::pair<int32_t, int32_t>>& copies);

  // Offers the sequence's newly full, computed blocks to the prefix cache.
  void cache_full_blocks(Sequence& seq);

  // The child shares every block of the parent that holds computed tokens.
  void fork(const Sequence& parent, Sequence& child);

  // Frees the blocks past the sequence's computed tokens: slots of rejected drafts and of a draft
  // model's lookahead. They were allocated for it alone this step, never hashed.
  void trim(Sequence& seq);

  // Releases the blocks, tail first, so the tail is evicted before the head.
  void free(Sequence& seq);

  uint64_t new_epoch() { return ++epoch_counter_; }

 private:
  int32_t blocks_needed(const Sequence& seq, int32_t num_new_tokens) const;
  bool needs_copy(const Sequence& seq) const;

  BlockPool pool_;
  int32_t block_size_;
  bool prefix_caching_;
  uint64_t epoch_counter_ = 0;
};

}  // namespace nanovllm
