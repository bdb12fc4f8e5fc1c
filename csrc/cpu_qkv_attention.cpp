#include "cpu_qkv_attention.h"

#include <cstring>

#include "cpu_fused_ops.h"

namespace nanovllm {

void qkv_attention(const QkvAttentionArgs& a, int num_threads) {
  if (a.tokens == 0) return;
  const PagedAttentionArgs& at = a.attn;
  const int64_t item = dtype_bytes(at.dtype);
  const int64_t q_row = static_cast<int64_t>(at.num_heads) * at.head_dim;
  const int64_t k_row = static_cast<int64_t>(at.num_kv_heads) * at.head_dim;
  const char* qkv = static_cast<const char*>(a.qkv);
  char* q = static_cast<char*>(a.scratch);
  char* k = q + a.tokens * q_row * item;
  const RotaryArgs turn{q, k, a.positions, a.inv_freq, a.tokens, at.num_heads, at.num_kv_heads, at.head_dim, q_row,
                        k_row, at.dtype, a.angles};
  if (a.q_norm != nullptr) {
    norm_rotary({qkv, nullptr, a.q_norm, q, nullptr, a.tokens * at.num_heads, at.head_dim, at.num_heads, a.qkv_stride,
                 a.eps, at.dtype},
                {qkv + q_row * item, nullptr, a.k_norm, k, nullptr, a.tokens * at.num_kv_heads, at.head_dim,
                 at.num_kv_heads, a.qkv_stride, a.eps, at.dtype},
                turn, num_threads);
  } else {
    for (int64_t t = 0; t < a.tokens; ++t) {
      std::memcpy(q + t * q_row * item, qkv + t * a.qkv_stride * item, q_row * item);
      std::memcpy(k + t * k_row * item, qkv + (t * a.qkv_stride + q_row) * item, k_row * item);
    }
    rotary(turn, num_threads);
  }
  write_kv_cache({k, qkv + (q_row + k_row) * item, static_cast<char*>(a.k_cache), static_cast<char*>(a.v_cache),
                  a.slot_mapping, a.slot_tokens, k_row * item, k_row * item, a.qkv_stride * item});
  PagedAttentionArgs attend = at;
  attend.query = q;
  attend.k_cache = a.k_cache;
  attend.v_cache = a.v_cache;
  paged_attention(attend, num_threads);
}

}  // namespace nanovllm
