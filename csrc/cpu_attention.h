// Decode attention on the CPU, straight over the paged KV cache (fp32).
//
// The torch reference gathers every sequence's blocks into a padded copy before two einsums;
// this reads each K/V row in place, only up to the sequence's own context length, and reads it
// once for all the query heads that share it (GQA).
#pragma once

#include <cstdint>

namespace nanovllm {

struct DecodeAttentionArgs {
  const float* query;          // [num_seqs, num_heads, head_dim]
  const float* k_cache;        // [num_blocks, block_size, num_kv_heads, head_dim]
  const float* v_cache;        // same layout
  const int32_t* block_tables; // [num_seqs, block_table_stride]
  const int32_t* context_lens; // [num_seqs]
  float* out;                  // [num_seqs, num_heads, head_dim]
  int64_t block_table_stride;
  int32_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
};

// Splits the sequences over `num_threads` threads.
void paged_decode_attention(const DecodeAttentionArgs& a, int num_threads);

}  // namespace nanovllm
