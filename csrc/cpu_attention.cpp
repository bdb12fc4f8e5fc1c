#include "cpu_attention.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

namespace nanovllm {
namespace {

using Bf16 = uint16_t;  // the upper half of an IEEE float

// Rows of query vectors per task: enough that one K/V row, once loaded, serves many queries
// (a prefill tile), few enough that the task's scores stay in cache.
constexpr int kQueryVectorsPerTask = 64;
// Below this many multiply-adds a step is not worth waking a second thread for.
constexpr int64_t kMinWorkPerThread = 1 << 16;

inline float widen(float x) { return x; }
inline float widen(Bf16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }

inline void narrow(float x, float* dst) { *dst = x; }
inline void narrow(float x, Bf16* dst) {
  // Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays a (quiet) NaN.
  const uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *dst = static_cast<Bf16>((u >> 16) | 0x40u);
    return;
  }
  *dst = static_cast<Bf16>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// A row as fp32: fp32 rows are used in place, bf16 rows widened into `buf`.
[[gnu::always_inline]] inline const float* as_f32(const float* row, float*, int) { return row; }
[[gnu::always_inline]] inline const float* as_f32(const Bf16* __restrict row, float* __restrict buf, int n) {
#pragma omp simd
  for (int d = 0; d < n; ++d) buf[d] = widen(row[d]);
  return buf;
}

struct Task {
  int32_t seq, kv_head, row_begin, row_end;  // rows relative to the sequence's first query row
};

struct Scratch {
  std::vector<float> q, scores, acc, k_row, v_row;
};

// One task: query rows [row_begin, row_end) of one sequence, for the `group` query heads of one
// KV head. Vector v = r * group + g is row row_begin + r, head kv_head * group + g; it sees
// `base + r + 1` keys, base = the absolute position of row row_begin.
template <typename T>
[[gnu::always_inline]] inline void attend_task(const PagedAttentionArgs& a, const Task& task, Scratch& s) {
  const int group = a.num_heads / a.num_kv_heads;
  const int D = a.head_dim;
  const int bs = a.block_size;
  const int q_start = a.cu_seqlens_q[task.seq];
  const int q_len = a.cu_seqlens_q[task.seq + 1] - q_start;
  const int base = a.context_lens[task.seq] - q_len + task.row_begin;
  const int rows = task.row_end - task.row_begin;
  const int V = rows * group;
  const int L = base + rows;  // keys the last row sees
  const int32_t* table = a.block_tables + static_cast<int64_t>(task.seq) * a.block_table_stride;
  const int64_t kv_row = static_cast<int64_t>(a.num_kv_heads) * D;
  const int64_t head_off = static_cast<int64_t>(task.kv_head) * D;
  const T* query = static_cast<const T*>(a.query);
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);

  s.q.resize(static_cast<size_t>(V) * D);
  s.scores.resize(static_cast<size_t>(V) * L);
  s.acc.assign(static_cast<size_t>(V) * D, 0.0f);
  s.k_row.resize(D);
  s.v_row.resize(D);
  float* __restrict qf = s.q.data();
  float* __restrict sc = s.scores.data();  // [V, L]
  float* __restrict acc = s.acc.data();    // [V, D]
  for (int r = 0; r < rows; ++r) {
    const T* src = query + (static_cast<int64_t>(q_start + task.row_begin + r) * a.num_heads +
                            static_cast<int64_t>(task.kv_head) * group) * D;
    float* dst = qf + static_cast<int64_t>(r) * group * D;
#pragma omp simd
    for (int d = 0; d < group * D; ++d) dst[d] = widen(src[d]) * a.scale;
  }

  // Scores. Key t is visible to vectors from (t - base) * group on (all of them for t < base).
  for (int t0 = 0; t0 < L; t0 += bs) {
    const T* k = k_cache + static_cast<int64_t>(table[t0 / bs]) * bs * kv_row + head_off;
    const int n = std::min(bs, L - t0);
    for (int i = 0; i < n; ++i, k += kv_row) {
      const int t = t0 + i;
      const float* __restrict kf = as_f32(k, s.k_row.data(), D);
      int v = std::max(0, t - base) * group;
      // Four query vectors per pass: each loaded key element feeds four products.
      for (; v + 4 <= V; v += 4) {
        const float* q0 = qf + static_cast<int64_t>(v) * D;
        const float* q1 = q0 + D;
        const float* q2 = q1 + D;
        const float* q3 = q2 + D;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int d = 0; d < D; ++d) {
          s0 += q0[d] * kf[d];
          s1 += q1[d] * kf[d];
          s2 += q2[d] * kf[d];
          s3 += q3[d] * kf[d];
        }
        sc[static_cast<int64_t>(v) * L + t] = s0;
        sc[static_cast<int64_t>(v + 1) * L + t] = s1;
        sc[static_cast<int64_t>(v + 2) * L + t] = s2;
        sc[static_cast<int64_t>(v + 3) * L + t] = s3;
      }
      for (; v < V; ++v) {
        const float* q0 = qf + static_cast<int64_t>(v) * D;
        float s0 = 0.0f;
#pragma omp simd reduction(+ : s0)
        for (int d = 0; d < D; ++d) s0 += q0[d] * kf[d];
        sc[static_cast<int64_t>(v) * L + t] = s0;
      }
    }
  }

  // Softmax over each vector's own visible keys.
  for (int v = 0; v < V; ++v) {
    float* p = sc + static_cast<int64_t>(v) * L;
    const int n = base + v / group + 1;
    float m = p[0];
    for (int t = 1; t < n; ++t) m = std::max(m, p[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < n; ++t) {
      p[t] = std::exp(p[t] - m);
      sum += p[t];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int t = 0; t < n; ++t) p[t] *= inv;
  }

  // Weighted sum of V, with the same visibility.
  for (int t0 = 0; t0 < L; t0 += bs) {
    const T* vrow = v_cache + static_cast<int64_t>(table[t0 / bs]) * bs * kv_row + head_off;
    const int n = std::min(bs, L - t0);
    for (int i = 0; i < n; ++i, vrow += kv_row) {
      const int t = t0 + i;
      const float* __restrict vf = as_f32(vrow, s.v_row.data(), D);
      int v = std::max(0, t - base) * group;
      for (; v + 4 <= V; v += 4) {
        const float p0 = sc[static_cast<int64_t>(v) * L + t];
        const float p1 = sc[static_cast<int64_t>(v + 1) * L + t];
        const float p2 = sc[static_cast<int64_t>(v + 2) * L + t];
        const float p3 = sc[static_cast<int64_t>(v + 3) * L + t];
        float* __restrict a0 = acc + static_cast<int64_t>(v) * D;
        float* __restrict a1 = a0 + D;
        float* __restrict a2 = a1 + D;
        float* __restrict a3 = a2 + D;
#pragma omp simd
        for (int d = 0; d < D; ++d) {
          a0[d] += p0 * vf[d];
          a1[d] += p1 * vf[d];
          a2[d] += p2 * vf[d];
          a3[d] += p3 * vf[d];
        }
      }
      for (; v < V; ++v) {
        const float p0 = sc[static_cast<int64_t>(v) * L + t];
        float* __restrict a0 = acc + static_cast<int64_t>(v) * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) a0[d] += p0 * vf[d];
      }
    }
  }

  T* out = static_cast<T*>(a.out);
  for (int r = 0; r < rows; ++r) {
    T* dst = out + (static_cast<int64_t>(q_start + task.row_begin + r) * a.num_heads +
                    static_cast<int64_t>(task.kv_head) * group) * D;
    const float* src = acc + static_cast<int64_t>(r) * group * D;
    for (int d = 0; d < group * D; ++d) narrow(src[d], dst + d);
  }
}

// One copy per instruction set, picked when the library loads: AVX-512, AVX2 + FMA, baseline.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void run_f32(const PagedAttentionArgs& a, const Task* tasks, int64_t count, std::atomic<int64_t>& next) {
  Scratch s;
  for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) attend_task<float>(a, tasks[i], s);
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void run_bf16(const PagedAttentionArgs& a, const Task* tasks, int64_t count, std::atomic<int64_t>& next) {
  Scratch s;
  for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) attend_task<Bf16>(a, tasks[i], s);
}

// Prefill tiles first: they are the long tasks, and handing them out first balances the threads.
std::vector<Task> make_tasks(const PagedAttentionArgs& a, int64_t& work) {
  const int group = a.num_heads / a.num_kv_heads;
  const int tile = std::max(1, kQueryVectorsPerTask / group);
  std::vector<Task> prefill, decode;
  work = 0;
  for (int32_t seq = 0; seq < a.num_seqs; ++seq) {
    const int32_t q_len = a.cu_seqlens_q[seq + 1] - a.cu_seqlens_q[seq];
    auto& list = q_len > 1 ? prefill : decode;
    for (int32_t r = 0; r < q_len; r += tile) {
      const int32_t end = std::min(q_len, r + tile);
      work += static_cast<int64_t>(end - r) * (a.context_lens[seq] - q_len + end) * a.num_kv_heads;
      for (int32_t h = 0; h < a.num_kv_heads; ++h) list.push_back({seq, h, r, end});
    }
  }
  work *= static_cast<int64_t>(group) * a.head_dim * 2;
  prefill.insert(prefill.end(), decode.begin(), decode.end());
  return prefill;
}

}  // namespace

void paged_attention(const PagedAttentionArgs& a, int num_threads) {
  int64_t work = 0;
  const std::vector<Task> tasks = make_tasks(a, work);
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int64_t threads = std::clamp<int64_t>(std::min<int64_t>(num_threads, work / kMinWorkPerThread), 1,
                                              std::max<int64_t>(count, 1));
  const auto run = a.dtype == CpuDtype::kBFloat16 ? run_bf16 : run_f32;
  std::atomic<int64_t> next{0};
  std::vector<std::jthread> workers;
  workers.reserve(threads - 1);
  for (int64_t i = 1; i < threads; ++i) workers.emplace_back([&] { run(a, tasks.data(), count, next); });
  run(a, tasks.data(), count, next);
}

void write_kv_cache(const KVWriteArgs& a) {
  for (int64_t i = 0; i < a.num_tokens; ++i) {
    const int64_t slot = a.slot_mapping[i];
    if (slot < 0) continue;
    std::memcpy(a.k_cache + slot * a.row_bytes, a.key + i * a.key_stride, a.row_bytes);
    std::memcpy(a.v_cache + slot * a.row_bytes, a.value + i * a.value_stride, a.row_bytes);
  }
}

}  // namespace nanovllm
