// One layer's attention on the CPU between its qkv projection and its output projection: Qwen3's
// per-head q/k RMSNorm (when the model has it), rotary, the K/V cache write and paged attention,
// in one call. Each is the kernel the separate calls run (csrc/cpu_fused_ops.h,
// csrc/cpu_attention.h), in the same order, so the results are the same bits; what one call saves
// is the Python around six (~10 us each, ~0.4 ms of a ~6 ms batch-1 decode step of 8 layers).
#pragma once

#include <cstdint>

#include "cpu_attention.h"

namespace nanovllm {

struct QkvAttentionArgs {
  const void* qkv;              // [tokens] rows of (num_heads + 2 * num_kv_heads) * head_dim: q | k | v
  const void* q_norm;           // [head_dim], or null (no q/k norm; k_norm null too)
  const void* k_norm;           // [head_dim]
  const int32_t* positions;     // [tokens]
  const float* inv_freq;        // [head_dim / 2]
  void* scratch;                // [tokens, num_heads + num_kv_heads, head_dim]: q, then k, as attended
  const int32_t* slot_mapping;  // [slot_tokens]: where each row's K/V goes (-1 = skip)
  void* k_cache;                // [num_blocks, block_size, num_kv_heads, head_dim]
  void* v_cache;
  int64_t tokens, qkv_stride, slot_tokens;
  float eps;
  PagedAttentionArgs attn;      // the rest of the attention; its query and caches are set from the above
  const float* angles = nullptr;  // nullable: the tokens' rotary cos and sin (RotaryArgs::angles)
};

void qkv_attention(const QkvAttentionArgs& a, int num_threads);

}  // namespace nanovllm
