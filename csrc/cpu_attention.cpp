#include "cpu_attention.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <thread>
#include <vector>

namespace nanovllm {
namespace {

// `omp simd` (compiled with -fopenmp-simd: no OpenMP runtime) lets the compiler reassociate the
// reduction and call the vector expf; target_clones builds an AVX2 copy picked at load time.
inline float dot(const float* __restrict a, const float* __restrict b, int n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// One sequence, all heads: scores, softmax, weighted sum of V. A block holds block_size rows of
// num_kv_heads * head_dim contiguous floats, so walking it row by row (all heads at once) reads
// memory sequentially; each K/V head vector is read once for the query heads sharing it.
__attribute__((target_clones("avx2,fma", "default")))
void attend(const DecodeAttentionArgs& a, int seq, std::vector<float>& scores) {
  const int heads = a.num_heads;
  const int kv_heads = a.num_kv_heads;
  const int group = heads / kv_heads;
  const int D = a.head_dim;
  const int ctx = a.context_lens[seq];
  const int bs = a.block_size;
  const int32_t* table = a.block_tables + static_cast<int64_t>(seq) * a.block_table_stride;
  const int64_t row_stride = static_cast<int64_t>(kv_heads) * D;
  const float* q = a.query + static_cast<int64_t>(seq) * heads * D;
  float* out = a.out + static_cast<int64_t>(seq) * heads * D;
  std::fill(out, out + static_cast<int64_t>(heads) * D, 0.0f);
  if (ctx <= 0) return;
  scores.resize(static_cast<size_t>(heads) * ctx);
  float* sc = scores.data();  // [heads, ctx]

  // Walk the context block by block, so a row's address is a pointer bump, not a division.
  for (int t0 = 0; t0 < ctx; t0 += bs) {
    const float* k = a.k_cache + static_cast<int64_t>(table[t0 / bs]) * bs * row_stride;
    const int n = std::min(bs, ctx - t0);
    for (int i = 0; i < n; ++i, k += row_stride) {
      for (int h = 0; h < heads; ++h) {
        sc[static_cast<size_t>(h) * ctx + t0 + i] = dot(q + static_cast<int64_t>(h) * D, k + (h / group) * D, D) * a.scale;
      }
    }
  }
  for (int h = 0; h < heads; ++h) {
    float* s = sc + static_cast<size_t>(h) * ctx;
    float m = s[0];
    for (int t = 1; t < ctx; ++t) m = std::max(m, s[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < ctx; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int t = 0; t < ctx; ++t) s[t] *= inv;
  }
  for (int t0 = 0; t0 < ctx; t0 += bs) {
    const float* v = a.v_cache + static_cast<int64_t>(table[t0 / bs]) * bs * row_stride;
    const int n = std::min(bs, ctx - t0);
    for (int i = 0; i < n; ++i, v += row_stride) {
      for (int h = 0; h < heads; ++h) {
        const float p = sc[static_cast<size_t>(h) * ctx + t0 + i];
        const float* __restrict vh = v + (h / group) * D;
        float* __restrict o = out + static_cast<int64_t>(h) * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) o[d] += p * vh[d];
      }
    }
  }
}

void run_range(const DecodeAttentionArgs& a, int64_t begin, int64_t end) {
  std::vector<float> scores;
  for (int64_t seq = begin; seq < end; ++seq) attend(a, static_cast<int>(seq), scores);
}

}  // namespace

void paged_decode_attention(const DecodeAttentionArgs& a, int num_threads) {
  const int64_t tasks = a.num_seqs;
  const int64_t threads = std::clamp<int64_t>(num_threads, 1, std::max<int64_t>(tasks, 1));
  std::vector<std::jthread> workers;
  workers.reserve(threads - 1);
  for (int64_t i = 1; i < threads; ++i) {
    workers.emplace_back([&a, i, tasks, threads] { run_range(a, tasks * i / threads, tasks * (i + 1) / threads); });
  }
  run_range(a, 0, tasks / threads);
}

}  // namespace nanovllm
