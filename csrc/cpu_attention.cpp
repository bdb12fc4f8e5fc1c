#include "cpu_attention.h"
#include "cpu_attention_amx.h"

#include "cpu_attention_avx2.h"
#include "cpu_attention_bf16.h"
#include "cpu_isa.h"
#include "cpu_math.h"
#include "cpu_parallel.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace nanovllm {
namespace {

// Rows of query vectors per task: enough that one K/V row, once loaded, serves many queries
// (a prefill tile), few enough that the task's scores stay in cache.
constexpr int kQueryVectorsPerTask = 64;
// A prefill task (rows past one) of at least this many query vectors a KV head (a tile of 16) goes
// to AMX tiles where attention_amx_takes the call. A decode row stays on the vector path whatever
// its GQA group: it reads each key once, and the tiles would gather every key for one row.
constexpr int kAmxMinVectors = 16;
// Query vectors per prefill task on AMX tiles: each task gathers its keys and values into tiles,
// which more vectors share.
constexpr int kAmxVectorsPerTask = 256;
// A sequence of at most this many query rows stays on the vector path, whose rows get a decode
// row's arithmetic: a speculative verification's (num_speculative_tokens <= 64, config.py, and
// the row's own token), so that greedy speculation gives decoding's tokens, as docs/design.md
// promises. The AMX tiles round the softmax weights to bf16, and a bf16 Qwen3-shaped model (4
// query heads a KV head, head_dim 128) verifying 3 drafts chose the other of two tokens 0.004
// apart. Prompts and chunk tails this short cost little on the vector path.
constexpr int kDecodeExactRows = 65;
// Below this many multiply-adds a step is not worth waking a second thread for.
constexpr int64_t kMinWorkPerThread = 1 << 16;

// A row as fp32: fp32 rows are used in place, bf16 rows widened into `buf`.
[[gnu::always_inline]] inline const float* as_f32(const float* row, float*, int) { return row; }
[[gnu::always_inline]] inline const float* as_f32(const Bf16* __restrict row, float* __restrict buf, int n) {
#pragma omp simd
  for (int d = 0; d < n; ++d) buf[d] = widen(row[d]);
  return buf;
}

struct Task {
  int32_t seq, head_begin, head_end;  // KV heads [head_begin, head_end)
  int32_t row_begin, row_end;         // query rows, relative to the sequence's first one
  // A part of a lone decode row's keys, [key_begin, key_end), whose partial softmax (max, sum and
  // unnormalized values) goes to slot `part` of the step's partials, merged after all parts ran;
  // part -1: the task's rows see all their keys and it writes its output itself.
  int32_t key_begin = 0, key_end = 0, part = -1;
};

// The parts of a lone decode row split by keys: per part, each query vector's max score and sum of
// exponentials (2 floats) then its unnormalized values (head_dim floats), vectors in head order.
struct Partials {
  float* data = nullptr;
  int64_t floats_per_part = 0;
};

struct Scratch {
  std::vector<float> q, scores, acc, row;
  std::vector<Bf16> qb;  // the query vectors as stored, for the AVX512-BF16 scores
};

// Scores of query vectors [v, end) (rows of `q`, D apart) against one key, into column t of `sc`
// (rows L apart). Four, then two vectors per pass: each loaded key element feeds several products.
[[gnu::always_inline]] inline void score_key(const float* __restrict q, const float* __restrict k, int D, int v,
                                             int end, float* __restrict sc, int64_t L, int t) {
  for (; v + 4 <= end; v += 4) {
    const float* q0 = q + static_cast<int64_t>(v) * D;
    const float* q1 = q0 + D;
    const float* q2 = q1 + D;
    const float* q3 = q2 + D;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int d = 0; d < D; ++d) {
      s0 += q0[d] * k[d];
      s1 += q1[d] * k[d];
      s2 += q2[d] * k[d];
      s3 += q3[d] * k[d];
    }
    sc[v * L + t] = s0;
    sc[(v + 1) * L + t] = s1;
    sc[(v + 2) * L + t] = s2;
    sc[(v + 3) * L + t] = s3;
  }
  for (; v + 2 <= end; v += 2) {
    const float* q0 = q + static_cast<int64_t>(v) * D;
    const float* q1 = q0 + D;
    float s0 = 0.0f, s1 = 0.0f;
#pragma omp simd reduction(+ : s0, s1)
    for (int d = 0; d < D; ++d) {
      s0 += q0[d] * k[d];
      s1 += q1[d] * k[d];
    }
    sc[v * L + t] = s0;
    sc[(v + 1) * L + t] = s1;
  }
  if (v < end) {
    const float* q0 = q + static_cast<int64_t>(v) * D;
    float s0 = 0.0f;
#pragma omp simd reduction(+ : s0)
    for (int d = 0; d < D; ++d) s0 += q0[d] * k[d];
    sc[v * L + t] = s0;
  }
}

// acc[v .. end) += p[v, t] * value, the same blocking as score_key.
[[gnu::always_inline]] inline void accumulate_value(const float* __restrict p, const float* __restrict x, int D,
                                                    int v, int end, float* __restrict acc, int64_t L, int t) {
  for (; v + 4 <= end; v += 4) {
    const float p0 = p[v * L + t], p1 = p[(v + 1) * L + t], p2 = p[(v + 2) * L + t], p3 = p[(v + 3) * L + t];
    float* __restrict a0 = acc + static_cast<int64_t>(v) * D;
    float* __restrict a1 = a0 + D;
    float* __restrict a2 = a1 + D;
    float* __restrict a3 = a2 + D;
#pragma omp simd
    for (int d = 0; d < D; ++d) {
      a0[d] += p0 * x[d];
      a1[d] += p1 * x[d];
      a2[d] += p2 * x[d];
      a3[d] += p3 * x[d];
    }
  }
  for (; v < end; ++v) {
    const float p0 = p[v * L + t];
    float* __restrict a0 = acc + static_cast<int64_t>(v) * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) a0[d] += p0 * x[d];
  }
}

// Blocks of rows asked for ahead of their use: blocks sit anywhere in the cache, and a hardware
// prefetcher restarts at each one (and at each 4 KB page), so without this a pass over a
// sequence's blocks runs at memory latency, not bandwidth (measured ~3x below it). The portable
// loops ask for whole blocks two ahead: 64 decodes x 230 keys (8/4 heads x 32, 2 threads) 1.1-1.9
// ms against 2.1 ms one block ahead and 1.9 ms four ahead, Zen 4 (the tile path, whose requests
// are spread over its loads, asks one chunk ahead: RowFeed). Into L2, not L1: the block in use
// and two ahead (16 KB each for 8 bf16 heads of 64) overflow a 32 KB L1, and each prefetch
// evicted rows still to be read; into L2 decode attention ran 15-30% faster (32 x 1000 keys and
// 8 x 2000, bf16, 1 and 2 threads, Zen 4).
constexpr int64_t kPrefetchBlocks = 2;

// The rows the tile path's passes take at a time and ask for ahead: 16 whatever the block size,
// where it divides it (each chunk within a block), else a block. A block ahead of 128-token blocks
// (vLLM's CPU default) made every task's first burst of requests 128 rows and the values pass's
// 128 rows at a time: 32 decodes x 296 keys, 8 layers, from memory took 5.3-5.5 ms against 4.4 with
// 16 rows (4.7-4.8 ms with 16-token blocks; Intel Xeon with AMX).
constexpr int64_t tile_chunk(int64_t block_size) { return block_size % 16 == 0 ? 16 : block_size; }

// Every cache line of [p, p + bytes) asked for into L2 (a range need not start on a line).
[[gnu::always_inline]] inline void prefetch_bytes(const char* p, int64_t bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes);
  for (uintptr_t line = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; line < end; line += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(line), 0, 2);
  }
}

// Cache lines asked for from the tile kernels' inner loops, PerStep lines a step (each step's loads
// of the rows in use next to a request for rows ahead), the rest at the end of a KV head's turn
// (finish). Asking for a turn's share of the rows ahead at once, 16-32 requests before its loads,
// stalled the core while they drained (the prefetch instructions held 10% of a decode's samples
// with the KV in L3); fed a line a step, 32 sequences of 256 keys read from memory 1.2x faster and
// one of 3,000 keys 1.27x (bf16, 2 threads, Zen 3).
template <int PerStep>
struct LineFeed {
  const char* next = nullptr;
  const char* end = nullptr;

  [[gnu::always_inline]] void step() {
#pragma GCC unroll 8
    for (int i = 0; i < PerStep; ++i) {
      if (next >= end) return;
      __builtin_prefetch(next, 0, 2);
      next += 64;
    }
  }
  [[gnu::always_inline]] void finish() {
    for (; next < end; next += 64) __builtin_prefetch(next, 0, 2);
  }
};

// A tile pass's requests for the n rows at a time (within one block) it will read a chunk later:
// on each of the task's KV heads' turns a share. Where the task has every KV head, the n rows are
// one contiguous range cut into equal shares (of whole lines; the last turn takes the remainder),
// fed to the kernels by a LineFeed; a task of some heads (their slices of the rows, apart) asks for
// its share of the rows' slices at once.
template <typename T>
struct RowFeed {
  const PagedAttentionArgs& a;
  const int32_t* table;
  int64_t head_off;
  int n, heads;
  int64_t row_bytes, slice, share;

  RowFeed(const PagedAttentionArgs& args, const int32_t* block_table, int64_t head_offset, int rows, int task_heads)
      : a(args), table(block_table), head_off(head_offset), n(rows), heads(task_heads),
        row_bytes(static_cast<int64_t>(a.num_kv_heads) * a.head_dim * static_cast<int64_t>(sizeof(T))),
        slice(static_cast<int64_t>(heads) * a.head_dim * static_cast<int64_t>(sizeof(T))),
        share(n * row_bytes / heads / 64 * 64) {}

  // Row r's slice in `cache`, null at or past L.
  [[gnu::always_inline]] const char* rows(const void* cache, int64_t r, int64_t L) const {
    if (r >= L) return nullptr;
    return static_cast<const char*>(cache) +
           (static_cast<int64_t>(table[r / a.block_size]) * a.block_size + r % a.block_size) * row_bytes +
           head_off * static_cast<int64_t>(sizeof(T));
  }

  // Rows [i0, i1) of those from p (rows(...); none for null), their slices asked for at once.
  [[gnu::always_inline]] void ask(const char* p, int i0, int i1) const {
    if (p == nullptr) return;
    for (int i = i0; i < i1; ++i) prefetch_bytes(p + i * row_bytes, slice);
  }

  // Turn h's share of the rows from p (rows(...)), as a Feed (a LineFeed), empty where the rows
  // were asked for here. A share starts on a line (a cache need not be 64-byte aligned).
  template <typename Feed>
  [[gnu::always_inline]] Feed turn(const char* p, int h) const {
    if (p == nullptr) return {};
    if (slice == row_bytes) {
      const char* begin = p + h * share;
      const char* line = begin - (reinterpret_cast<uintptr_t>(begin) & 63);
      return {line, h == heads - 1 ? p + n * row_bytes : begin + share};
    }
    ask(p, n * h / heads, n * (h + 1) / heads);
    return {};
  }
};

// Rows [r, r + n) of a pass over keys below L, within one block, their slice of the task's KV heads
// (a task of fewer heads asks only for its own: its siblings run on other threads), at once.
template <typename T>
[[gnu::always_inline]] inline void prefetch_rows(const PagedAttentionArgs& a, const int32_t* table, int64_t r, int n,
                                                 int64_t L, int64_t head_off, int heads, const void* cache) {
  const RowFeed<T> feed(a, table, head_off, n, heads);
  feed.ask(feed.rows(cache, r, L), 0, n);
}

// At the start of block `t0 / bs` of a pass over keys below L: the blocks kPrefetchBlocks ahead
// (at the first block, also the ones before them), whole, as the portable loops walk them. The
// tile path asks for the rows ahead as it goes instead (RowFeed; asking for a whole block at its
// start stalled the core while the burst of requests drained: 32 x 1000 keys bf16 on one thread
// 6.6-7.4 ms against 8.5-9.3, fp32 32 x 200 20-30% faster; Zen 4).
template <typename T>
[[gnu::always_inline]] inline void prefetch_ahead(const PagedAttentionArgs& a, const int32_t* table, int64_t t0,
                                                  int64_t L, int64_t head_off, int heads, const void* cache) {
  const int64_t blocks = (L + a.block_size - 1) / a.block_size;
  const int64_t b = t0 / a.block_size;
  for (int64_t next = b == 0 ? 1 : b + kPrefetchBlocks; next <= b + kPrefetchBlocks && next < blocks; ++next)
    prefetch_rows<T>(a, table, next * a.block_size, a.block_size, L, head_off, heads, cache);
}

// acc += p . V for a task's vectors, each with its own visibility, p in rows `stride` apart. The
// cache is walked row by row, every KV head of the task per row: sequential reads, which the
// hardware prefetches (walking one head's slice of the rows instead, a 128-byte piece every
// kv_row, ran latency-bound).
template <typename T>
[[gnu::always_inline]] inline void weighted_values(const PagedAttentionArgs& a, const int32_t* table,
                                                   int64_t head_off, int heads, int per_head, int base, int64_t L,
                                                   int64_t stride, const float* __restrict sc,
                                                   float* __restrict acc, float* __restrict row) {
  const int group = a.num_heads / a.num_kv_heads;
  const int D = a.head_dim;
  const int bs = a.block_size;
  const int64_t kv_row = static_cast<int64_t>(a.num_kv_heads) * D;
  const T* v_cache = static_cast<const T*>(a.v_cache);
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    prefetch_ahead<T>(a, table, t0, L, head_off, heads, v_cache);
    const T* x = v_cache + static_cast<int64_t>(table[t0 / bs]) * bs * kv_row + head_off;
    const int n = static_cast<int>(std::min<int64_t>(bs, L - t0));
    for (int i = 0; i < n; ++i, x += kv_row) {
      const int t = static_cast<int>(t0) + i;
      const int first = std::max(0, t - base) * group;
      for (int h = 0; h < heads; ++h) {
        const float* xf = as_f32(x + static_cast<int64_t>(h) * D, row, D);
        accumulate_value(sc, xf, D, h * per_head + first, (h + 1) * per_head, acc, stride, t);
      }
    }
  }
}

// The largest of p[0, n), n >= 1: an elementwise max over sixteen lanes, which the compiler
// vectorizes for every target (a max reduction it left scalar, ~8% of a decode's attention).
[[gnu::always_inline]] inline float row_max(const float* __restrict p, int n) {
  float lane[16];
  std::fill(lane, lane + 16, p[0]);
  int t = 0;
  for (; t + 16 <= n; t += 16) {
    for (int j = 0; j < 16; ++j) lane[j] = p[t + j] > lane[j] ? p[t + j] : lane[j];
  }
  float m = p[0];
  for (int j = 0; j < 16; ++j) m = std::max(m, lane[j]);
  for (; t < n; ++t) m = std::max(m, p[t]);
  return m;
}

// Softmax of each score row (`stride` apart, column j holding key k0 + j) over the keys its vector
// sees (base + row + 1, row = (v % per_head) / group) below `width`, the rest of the row up to key
// `width` set to 0. With `stats`, a part of the keys (Task::part): the exponentials stay
// unnormalized and each vector's max and sum go to stats[2v], stats[2v + 1].
[[gnu::always_inline]] inline void softmax_visible(float* __restrict sc, int64_t stride, int V, int per_head,
                                                   int group, int base, int64_t width, int64_t k0 = 0,
                                                   float* __restrict stats = nullptr) {
  for (int v = 0; v < V; ++v) {
    float* p = sc + v * stride;
    const int n = static_cast<int>(std::min<int64_t>(base + (v % per_head) / group + 1, width) - k0);
    const float m = row_max(p, n);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < n; ++t) {
      p[t] = vec_exp(p[t] - m);
      sum += p[t];
    }
    if (stats != nullptr) {
      stats[2 * v] = m;
      stats[2 * v + 1] = sum;
    } else {
      const float inv = 1.0f / sum;
#pragma omp simd
      for (int t = 0; t < n; ++t) p[t] *= inv;
    }
    std::fill(p + n, p + width - k0, 0.0f);
  }
}

#if defined(__x86_64__)
// The tile path, once per instruction set (csrc/cpu_attention_tiles.h).
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace attn_avx2 {
struct Isa {
  using V = __m256;
  static constexpr int kLanes = 8;
  // Two query vectors a key load, over four keys at a time: eight accumulators, four keys and a
  // query chunk in 16 registers (eight keys for both would not fit).
  static constexpr int kScoreVectors = 2;
  static constexpr int kScoreAccumulators = 8;
  // At most 12 accumulators, the broadcast scores and a row chunk in 16 registers. Two vectors take
  // four chunks, two passes for a head of 64 (six then one and one: the one-chunk passes chained
  // each accumulator's FMAs key after key, 1.01-1.07x slower; Zen 3).
  static constexpr int kValueTile[5] = {0, 8, 4, 4, 2};
  static constexpr bool kSmoothFeed = false;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return avx2::load8(p); }
  static V load(const Bf16* p) { return avx2::load8(p); }
  static V bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static __m256 sum8(const V* a) { return avx2::sum_lanes8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]); }
  static __m128 sum4(const V* a) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // low | high halves
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
  }
  static void scores_bf16(const Bf16* q, const Bf16* k, int64_t kv_row, int D, float scale, float* out) {
    avx512_bf16::dot8(q, k, kv_row, D, scale, out);  // a call: its target is a superset of this one
  }
};
#include "cpu_attention_tiles.h"
}  // namespace attn_avx2
#pragma GCC pop_options

// GCC 12's AVX-512 extracts and widenings start from _mm*_undefined_*(), which -Wuninitialized
// reports once inlined (a known false positive), as in cpu_attention_bf16.h.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bf16")
namespace attn_avx512 {
// Taken where the CPU has AVX512-BF16 as well (Zen 4 and 5, Cooper Lake, Sapphire Rapids): the bf16
// scores inline. An AVX-512F CPU without it keeps the AVX2 tiles.
struct Isa {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kScoreVectors = 2;              // 16 accumulators and 8 keys of 32 registers
  static constexpr int kScoreAccumulators = 16;
  static constexpr int kValueTile[5] = {0, 8, 8, 4, 4};  // at most 16 accumulators
  static constexpr bool kSmoothFeed = true;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const Bf16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V bcast(const float* p) { return _mm512_set1_ps(*p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static __m256 sum8(const V* a) { return avx512_bf16::sum_lanes8(a); }
  static void scores_bf16(const Bf16* q, const Bf16* k, int64_t kv_row, int D, float scale, float* out) {
    avx512_bf16::dot8(q, k, kv_row, D, scale, out);
  }
};
#include "cpu_attention_tiles.h"
}  // namespace attn_avx512
#pragma GCC pop_options
#pragma GCC diagnostic pop
#endif

// The task's output rows from acc [heads * rows * group, D] (vector order as attend_task's).
template <typename T>
[[gnu::always_inline]] inline void write_task_output(const PagedAttentionArgs& a, const Task& task,
                                                     const float* __restrict acc) {
  const int group = a.num_heads / a.num_kv_heads;
  const int D = a.head_dim;
  const int rows = task.row_end - task.row_begin;
  const int per_head = rows * group;
  const int q_start = a.cu_seqlens_q[task.seq];
  T* out = static_cast<T*>(a.out);
  for (int h = 0; h < task.head_end - task.head_begin; ++h) {
    for (int r = 0; r < rows; ++r) {
      T* dst = out + (static_cast<int64_t>(q_start + task.row_begin + r) * a.num_heads +
                      static_cast<int64_t>(task.head_begin + h) * group) * D;
      const float* src = acc + (static_cast<int64_t>(h) * per_head + static_cast<int64_t>(r) * group) * D;
#pragma omp simd
      for (int d = 0; d < group * D; ++d) narrow(src[d], dst + d);
    }
  }
}

// Whether a call takes the tile path (AVX2 and FMA, head_dim and block_size multiples of 8): the
// only one that takes a part of a row's keys (Task::part).
bool takes_tiles(const PagedAttentionArgs& a) {
#if defined(__x86_64__)
  return a.head_dim % 8 == 0 && a.block_size % 8 == 0 && has_avx2_fma();
#else
  (void)a;
  return false;
#endif
}

// One task: query rows [row_begin, row_end) of one sequence for the query heads of KV heads
// [head_begin, head_end). Vector v = h * per_head + r * group + g is row row_begin + r, query head
// (head_begin + h) * group + g; it sees `base + r + 1` keys (a part, only those in [key_begin,
// key_end)), base = the absolute position of row row_begin. The cache is walked row by row, every
// KV head of the task per row, so a decode task (all heads of a sequence) reads each K/V row once,
// sequentially.
template <typename T>
[[gnu::always_inline]] inline void attend_task(const PagedAttentionArgs& a, const Task& task, Scratch& s,
                                               const Partials& partials) {
  const int group = a.num_heads / a.num_kv_heads;
  const int D = a.head_dim;
  const int bs = a.block_size;
  const int q_start = a.cu_seqlens_q[task.seq];
  const int q_len = a.cu_seqlens_q[task.seq + 1] - q_start;
  const int base = a.context_lens[task.seq] - q_len + task.row_begin;
  const int rows = task.row_end - task.row_begin;
  const int heads = task.head_end - task.head_begin;
  const int per_head = rows * group;
  const int V = heads * per_head;
  const int64_t L = task.part >= 0 ? task.key_end : base + rows;  // keys the last row sees (or the part's end)
  if (std::is_same_v<T, Bf16> && task.part < 0 && rows > 1 && per_head >= kAmxMinVectors && q_len > kDecodeExactRows &&
      attention_amx_takes(a)) {
    attend_rows_amx(a, task.seq, task.head_begin, task.head_end, task.row_begin, task.row_end);
    return;
  }
  const int32_t* table = a.block_tables + static_cast<int64_t>(task.seq) * a.block_table_stride;
  const int64_t kv_row = static_cast<int64_t>(a.num_kv_heads) * D;
  const int64_t head_off = static_cast<int64_t>(task.head_begin) * D;
  const T* query = static_cast<const T*>(a.query);

  // Score row stride (column j: key key_begin + j): room for the AVX2 path's 8-key chunks.
  const int64_t stride = (L - task.key_begin + 7) / 8 * 8;
  s.q.resize(static_cast<size_t>(V) * D);
  s.scores.resize(static_cast<size_t>(V) * stride);
  s.row.resize(D);
  // A part's slot: its stats (2 floats a vector), then its values, summed in place (zeros from the
  // allocation).
  float* part = task.part >= 0 ? partials.data + task.part * partials.floats_per_part : nullptr;
  if (part == nullptr) s.acc.assign(static_cast<size_t>(V) * D, 0.0f);
  float* __restrict qf = s.q.data();
  float* __restrict sc = s.scores.data();                                // [V, stride]
  float* __restrict acc = part != nullptr ? part + 2 * V : s.acc.data();  // [V, D]
  const bool tiles = takes_tiles(a);
  // A bf16 cache on AVX512-BF16 takes the query vectors as stored (qb), every other path scaled fp32 (qf).
  const bool bf16_scores = std::is_same_v<T, Bf16> && tiles && D % 32 == 0 && has_avx512_bf16();
  if (bf16_scores) s.qb.resize(static_cast<size_t>(V) * D);
  for (int h = 0; h < heads; ++h) {
    for (int r = 0; r < rows; ++r) {
      const T* src = query + (static_cast<int64_t>(q_start + task.row_begin + r) * a.num_heads +
                              static_cast<int64_t>(task.head_begin + h) * group) * D;
      const int64_t at = (static_cast<int64_t>(h) * per_head + static_cast<int64_t>(r) * group) * D;
      if (bf16_scores) {
        std::memcpy(s.qb.data() + at, src, sizeof(Bf16) * group * D);
        continue;
      }
      float* dst = qf + at;
#pragma omp simd
      for (int d = 0; d < group * D; ++d) dst[d] = widen(src[d]) * a.scale;
    }
  }

#if defined(__x86_64__)
  if (tiles) {
    const Bf16* qb = bf16_scores ? s.qb.data() : nullptr;
    if (D % 16 == 0 && has_avx512_bf16()) {
      attn_avx512::attend_tiles<T>(a, table, head_off, heads, per_head, base, L, stride, qf, qb, sc, acc,
                                   task.key_begin, part);
    } else {
      attn_avx2::attend_tiles<T>(a, table, head_off, heads, per_head, base, L, stride, qf, qb, sc, acc,
                                 task.key_begin, part);
    }
    if (part == nullptr) write_task_output<T>(a, task, acc);
    return;
  }
#endif
  // Scores. Key t is visible to a head's vectors from (t - base) * group on (all for t < base).
  const T* k_cache = static_cast<const T*>(a.k_cache);
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    prefetch_ahead<T>(a, table, t0, L, head_off, heads, a.k_cache);
    const T* k = k_cache + static_cast<int64_t>(table[t0 / bs]) * bs * kv_row + head_off;
    const int n = static_cast<int>(std::min<int64_t>(bs, L - t0));
    for (int i = 0; i < n; ++i, k += kv_row) {
      const int t = static_cast<int>(t0) + i;
      const int first = std::max(0, t - base) * group;
      for (int h = 0; h < heads; ++h) {
        const float* kf = as_f32(k + static_cast<int64_t>(h) * D, s.row.data(), D);
        score_key(qf, kf, D, h * per_head + first, (h + 1) * per_head, sc, L, t);
      }
    }
  }

  softmax_visible(sc, L, V, per_head, group, base, L);

  weighted_values<T>(a, table, head_off, heads, per_head, base, L, L, sc, acc, s.row.data());
  write_task_output<T>(a, task, acc);
}

// One copy per instruction set, picked when the library loads: AVX-512, AVX2 + FMA, baseline.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void run_f32(const PagedAttentionArgs& a, const Task* tasks, int64_t count, std::atomic<int64_t>& next,
             const Partials& partials) {
  Scratch s;
  for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
    attend_task<float>(a, tasks[i], s, partials);
  }
}

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void run_bf16(const PagedAttentionArgs& a, const Task* tasks, int64_t count, std::atomic<int64_t>& next,
              const Partials& partials) {
  Scratch s;
  for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
    attend_task<Bf16>(a, tasks[i], s, partials);
  }
}

// How many parts of its keys a step's only row, a decode on the tile path, is cut into: a power of
// two up to kMaxKeyParts with at least kMinChunksPerPart of the tile path's chunks (tile_chunk)
// each (part i from chunk chunks * i / parts), whatever the thread count (the output must not
// depend on it; the parts' sums merge in order).
constexpr int32_t kMaxKeyParts = 8;
constexpr int32_t kMinChunksPerPart = 8;

int32_t key_parts(int32_t chunks) {
  int32_t parts = 1;
  while (parts < kMaxKeyParts && chunks >= 2 * parts * kMinChunksPerPart) parts *= 2;
  return parts;
}

// A decode row is one task with every KV head (its K/V rows read once, sequentially). A step's only
// row, a decode on the tile path, is cut into parts of its keys (key_parts), each reading whole
// cache rows: with its KV heads split instead, two threads read halves of every row, 1.18-1.23x
// slower from memory (one sequence of 300-3000 keys, bf16, 2 threads, Zen 3). Otherwise, when there
// are fewer decode rows than threads and nothing else to do, a few tasks of consecutive KV heads (a
// lone decode row left the other threads idle). A prefill chunk is cut into tiles of rows per KV
// head, so a loaded K/V row serves many queries and long chunks spread over the threads. Prefill
// tiles go first: handing out the long tasks first balances the threads. `parts`: the key parts.
std::vector<Task> make_tasks(const PagedAttentionArgs& a, int num_threads, int64_t& work, int32_t& parts) {
  const int group = a.num_heads / a.num_kv_heads;
  const bool amx = attention_amx_takes(a);
  int32_t decodes = 0;
  for (int32_t seq = 0; seq < a.num_seqs; ++seq) decodes += a.cu_seqlens_q[seq + 1] - a.cu_seqlens_q[seq] == 1;
  const int32_t heads_split = decodes > 0 && decodes == a.num_seqs && decodes < num_threads
                                  ? std::min(a.num_kv_heads, (num_threads + decodes - 1) / decodes)
                                  : 1;
  std::vector<Task> prefill, decode;
  work = 0;
  parts = 0;
  for (int32_t seq = 0; seq < a.num_seqs; ++seq) {
    const int32_t q_len = a.cu_seqlens_q[seq + 1] - a.cu_seqlens_q[seq];
    const int32_t prefix = a.context_lens[seq] - q_len;
    if (q_len == 1) {
      work += prefix + 1;
      const auto chunk = static_cast<int32_t>(tile_chunk(a.block_size));
      const int32_t chunks = prefix / chunk + 1;
      const int32_t pieces = a.num_seqs == 1 && takes_tiles(a) ? key_parts(chunks) : 1;
      if (pieces > 1) {
        for (int32_t i = 0; i < pieces; ++i) {
          const int32_t begin = chunks * i / pieces * chunk;
          const int32_t end = std::min(prefix + 1, chunks * (i + 1) / pieces * chunk);
          decode.push_back({seq, 0, a.num_kv_heads, 0, 1, begin, end, parts++});
        }
        continue;
      }
      for (int32_t part = 0; part < heads_split; ++part) {
        decode.push_back({seq, a.num_kv_heads * part / heads_split, a.num_kv_heads * (part + 1) / heads_split, 0, 1});
      }
      continue;
    }
    const int per_task = amx && q_len > kDecodeExactRows ? kAmxVectorsPerTask : kQueryVectorsPerTask;
    const int tile = std::max(1, per_task / group);
    for (int32_t r = 0; r < q_len; r += tile) {
      const int32_t end = std::min(q_len, r + tile);
      work += static_cast<int64_t>(end - r) * (prefix + end);
      for (int32_t h = 0; h < a.num_kv_heads; ++h) prefill.push_back({seq, h, h + 1, r, end});
    }
  }
  work *= static_cast<int64_t>(a.num_heads) * a.head_dim * 2;  // multiply-adds: scores and values
  // Decode rows longest first too: the threads' last tasks are then the shortest (32 rows of 133-400
  // keys, 8 layers: 1.012-1.017x; Intel Xeon with AMX). A row cut into parts keeps their order, which
  // merge_parts sums them in.
  if (parts == 0) {
    const auto cost = [&a](const Task& t) {
      return static_cast<int64_t>(t.head_end - t.head_begin) * a.context_lens[t.seq];
    };
    std::stable_sort(decode.begin(), decode.end(), [&](const Task& x, const Task& y) { return cost(x) > cost(y); });
  }
  prefill.insert(prefill.end(), decode.begin(), decode.end());
  return prefill;
}

// The output row of a decode row split by keys, from its parts' partial softmaxes in order: each
// part's sums weighted by exp(its max - the row's max), over the parts' weighted sums of exponentials.
template <typename T>
void merge_parts(const PagedAttentionArgs& a, const std::vector<Task>& tasks, const Partials& partials) {
  const int64_t V = a.num_heads, D = a.head_dim;
  std::vector<float> row(D);
  T* out = static_cast<T*>(a.out) + static_cast<int64_t>(a.cu_seqlens_q[tasks.front().seq]) * V * D;
  for (int64_t v = 0; v < V; ++v) {
    float most = -std::numeric_limits<float>::infinity();
    for (const Task& t : tasks) most = std::max(most, partials.data[t.part * partials.floats_per_part + 2 * v]);
    float total = 0.0f;
    std::fill(row.begin(), row.end(), 0.0f);
    for (const Task& t : tasks) {
      const float* part = partials.data + t.part * partials.floats_per_part;
      const float weight = std::exp(part[2 * v] - most);
      total += weight * part[2 * v + 1];
      const float* sums = part + 2 * V + v * D;
      for (int64_t d = 0; d < D; ++d) row[d] += weight * sums[d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; ++d) narrow(row[d] * inv, out + v * D + d);
  }
}

}  // namespace

void paged_attention(const PagedAttentionArgs& a, int num_threads) {
  int64_t work = 0;
  int32_t parts = 0;
  const std::vector<Task> tasks = make_tasks(a, num_threads, work, parts);
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int64_t threads = std::clamp<int64_t>(std::min<int64_t>(num_threads, work / kMinWorkPerThread), 1,
                                              std::max<int64_t>(count, 1));
  std::vector<float> partial_floats;
  Partials partials;
  if (parts > 0) {
    partials.floats_per_part = static_cast<int64_t>(a.num_heads) * (2 + a.head_dim);
    partial_floats.resize(parts * partials.floats_per_part);
    partials.data = partial_floats.data();
  }
  const auto run = a.dtype == CpuDtype::kBFloat16 ? run_bf16 : run_f32;
  std::atomic<int64_t> next{0};
  parallel_team(threads, [&](int64_t, int64_t) { run(a, tasks.data(), count, next, partials); });
  if (parts == 0) return;
  // Only a step of one sequence is split: every task is one of its parts.
  if (a.dtype == CpuDtype::kBFloat16) {
    merge_parts<Bf16>(a, tasks, partials);
  } else {
    merge_parts<float>(a, tasks, partials);
  }
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
