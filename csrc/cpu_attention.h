// Paged attention on the CPU, straight over the paged KV cache, fp32 or bf16.
//
// One call covers a whole step of one layer: decode rows and prefill chunks (with or without a
// cached prefix). Each sequence's K/V rows are read in place, only up to what its queries can see,
// and once for all the query heads that share them (GQA). bf16 values are widened to fp32 as they
// are loaded; scores, softmax and the weighted sum accumulate in fp32.
#pragma once

#include <cstdint>

#include "cpu_dtype.h"

namespace nanovllm {

struct PagedAttentionArgs {
  const void* query;            // [num_tokens, num_heads, head_dim], dtype
  const void* k_cache;          // [num_blocks, block_size, num_kv_heads, head_dim], dtype
  const void* v_cache;          // same layout
  const int32_t* block_tables;  // [num_seqs, block_table_stride]
  const int32_t* context_lens;  // [num_seqs]: cached prefix + this step's tokens
  const int32_t* cu_seqlens_q;  // [num_seqs + 1]: sequence i's query rows
  void* out;                    // [num_tokens, num_heads, head_dim], dtype
  int64_t block_table_stride;
  int32_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  CpuDtype dtype;
};

// Query row j of sequence i sits at absolute position context_lens[i] - q_len + j and sees keys
// 0 .. that position. Work is split over up to `num_threads` threads by (sequence, KV head, tile of
// query rows); the calling thread is one of them.
void paged_attention(const PagedAttentionArgs& a, int num_threads);

struct KVWriteArgs {
  const char* key;              // [num_tokens] rows of row_bytes, key_stride bytes apart
  const char* value;            // same, value_stride bytes apart
  char* k_cache;                // [num_slots] rows of row_bytes, contiguous
  char* v_cache;
  const int32_t* slot_mapping;  // [num_tokens]; -1 = skip
  int64_t num_tokens, row_bytes, key_stride, value_stride;
};

// Copies each token's K and V row into its cache slot (the caller checked the slots' range).
void write_kv_cache(const KVWriteArgs& a);

}  // namespace nanovllm
