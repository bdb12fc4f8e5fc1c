#include "kv_cache_manager.h"

#include <algorithm>
#include <span>

#include "xxhash64.h"

namespace nanovllm {

KVCacheManager::KVCacheManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching)
    : pool_(num_blocks, block_size), block_size_(block_size), prefix_caching_(enable_prefix_caching) {}

namespace {

std::span<const int32_t> block_tokens(const Sequence& seq, size_t k, int32_t block_size) {
  return {seq.tokens.data() + k * block_size, static_cast<size_t>(block_size)};
}

void hash_blocks_up_to(Sequence& seq, size_t num_blocks, int32_t block_size) {
  for (size_t k = seq.block_hashes.size(); k < num_blocks; ++k) {
    const bool has_parent = k > 0;
    const uint64_t parent = has_parent ? seq.block_hashes[k - 1] : 0;
    seq.block_hashes.push_back(hash_block_tokens(has_parent, parent, block_tokens(seq, k, block_size)));
  }
}

}  // namespace

void hash_full_blocks(Sequence& seq, int32_t block_size) {
  hash_blocks_up_to(seq, seq.tokens.size() / block_size, block_size);
}

std::vector<int32_t> KVCacheManager::find_cached_prefix(Sequence& seq) const {
  std::vector<int32_t> hits;
  if (!prefix_caching_ || !seq.use_prefix_cache) return hits;
  // The last token is always computed: it has to produce the logits of the next one.
  const size_t max_blocks = static_cast<size_t>(seq.num_tokens() - 1) / block_size_;
  hash_blocks_up_to(seq, max_blocks, block_size_);
  for (size_t k = 0; k < max_blocks; ++k) {
    const int32_t b = pool_.lookup(seq.block_hashes[k], block_tokens(seq, k, block_size_));
    if (b < 0) break;
    hits.push_back(b);
  }
  return hits;
}

int32_t KVCacheManager::blocks_needed(const Sequence& seq, int32_t num_new_tokens) const {
  const int32_t total = (seq.num_computed + num_new_tokens + block_size_ - 1) / block_size_;
  return total - static_cast<int32_t>(seq.block_table.size());
}

bool KVCacheManager::needs_copy(const Sequence& seq) const {
  // Only the partly filled last block can be shared and written into: every block after it is
  // allocated fresh for this sequence.
  if (seq.num_computed % block_size_ == 0) return false;
  return pool_.ref_count(seq.block_table[seq.num_computed / block_size_]) > 1;
}

bool KVCacheManager::allocate_with_prefix(Sequence& seq, const std::vector<int32_t>& hits,
                                          int32_t num_new_tokens,
                                          std::vector<std::pair<int32_t, int32_t>>& copies) {
  int32_t hits_on_free_blocks = 0;
  for (const int32_t b : hits) hits_on_free_blocks += pool_.ref_count(b) == 0;
  const int32_t hit_tokens = static_cast<int32_t>(hits.size()) * block_size_;
  const int32_t total = (hit_tokens + num_new_tokens + block_size_ - 1) / block_size_;
  const int32_t fresh = total - static_cast<int32_t>(hits.size());
  if (hits_on_free_blocks + fresh > pool_.num_free()) return false;
  for (const int32_t b : hits) pool_.touch(b);
  seq.block_table.assign(hits.begin(), hits.end());
  seq.num_computed = hit_tokens;
  seq.num_registered_blocks = static_cast<int32_t>(hits.size());
  seq.table_epoch = new_epoch();
  return allocate_slots(seq, num_new_tokens, copies);
}

bool KVCacheManager::allocate_slots(Sequence& seq, int32_t num_new_tokens,
                                    std::vector<std::pair<int32_t, int32_t>>& copies) {
  const bool copy = needs_copy(seq);
  const int32_t fresh = blocks_needed(seq, num_new_tokens);
  if (fresh + (copy ? 1 : 0) > pool_.num_free()) return false;
  if (copy) {
    int32_t& entry = seq.block_table[seq.num_computed / block_size_];
    const int32_t private_block = pool_.allocate();
    copies.emplace_back(entry, private_block);
    pool_.free(entry);
    entry = private_block;
    seq.table_epoch = new_epoch();
  }
  for (int32_t i = 0; i < fresh; ++i) seq.block_table.push_back(pool_.allocate());
  return true;
}

void KVCacheManager::cache_full_blocks(Sequence& seq) {
  if (!prefix_caching_) return;
  const size_t full = static_cast<size_t>(seq.num_computed) / block_size_;
  if (full <= static_cast<size_t>(seq.num_registered_blocks)) return;
  hash_blocks_up_to(seq, full, block_size_);
  for (size_t k = seq.num_registered_blocks; k < full; ++k) {
    pool_.register_block(seq.block_table[k], seq.block_hashes[k], block_tokens(seq, k, block_size_));
  }
  seq.num_registered_blocks = static_cast<int32_t>(full);
}

void KVCacheManager::fork(const Sequence& parent, Sequence& child) {
  child.tokens = parent.tokens;
  child.num_prompt_tokens = parent.num_prompt_tokens;
  child.num_computed = parent.num_computed;
  const size_t computed_blocks = (static_cast<size_t>(parent.num_computed) + block_size_ - 1) / block_size_;
  child.block_table.assign(parent.block_table.begin(),
                           parent.block_table.begin() + std::min(computed_blocks, parent.block_table.size()));
  child.block_hashes = parent.block_hashes;
  child.num_registered_blocks = parent.num_registered_blocks;
  child.stop = parent.stop;
  child.table_epoch = new_epoch();
  for (const int32_t b : child.block_table) pool_.touch(b);
}

void KVCacheManager::trim(Sequence& seq) {
  const size_t keep = (static_cast<size_t>(seq.num_computed) + block_size_ - 1) / block_size_;
  if (seq.block_table.size() <= keep) return;
  while (seq.block_table.size() > keep) {
    pool_.free(seq.block_table.back());
    seq.block_table.pop_back();
  }
  seq.table_epoch = new_epoch();  // a plan row holding the longer table must be rewritten
}

void KVCacheManager::free(Sequence& seq) {
  for (auto it = seq.block_table.rbegin(); it != seq.block_table.rend(); ++it) pool_.free(*it);
  seq.block_table.clear();
  seq.num_computed = 0;
  seq.num_registered_blocks = 0;
  seq.table_epoch = new_epoch();
}

}  // namespace nanovllm
