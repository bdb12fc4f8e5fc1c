// The attention kernel's tile path (eight keys' scores at a time, softmax, values summed in
// registers), written once over an instruction-set type `Isa` and included by
// csrc/cpu_attention.cpp once per instruction set, each time inside that set's namespace and
// `#pragma GCC target` region, so every function here is compiled for it. Deliberately no include
// guard.
//
// Why not the portable loops: they take one dot product per (query vector, key), reduce it across
// lanes on its own and store the score with a stride; here eight keys are dotted at once, lanes
// accumulating along head_dim, and one transpose-and-add turns the eight accumulators into eight
// contiguous scores (2.5-3x faster per key with the data in cache, AVX2 on Zen 4); and the values'
// accumulators stay in registers across a chunk's rows (tile_chunk). Summation order differs from the portable
// loops (fp32 rounding only). Two query vectors share each key's loads (a GQA group's vectors read
// the same keys; AVX2 in two passes of four keys, its 16 registers short of 16 accumulators: bf16
// 1.12-1.16x with the KV in cache, Zen 3). On AVX-512 (16 floats a register) a head of 64 takes
// half the loads and FMAs a key: 1.2-1.5x the AVX2 tiles with the KV in cache (Zen 5).
//
// Isa provides: V (a vector of kLanes floats), zero/load (float, or bf16 widened)/bcast/fma/store,
// sum8(acc) (the lane sums of acc[0..7] as one __m256), kScoreVectors (query vectors scored per key
// load: 1 or 2), kScoreAccumulators (the most score accumulators its registers hold; past 8 per
// vector, sum4(acc): the lane sums of acc[0..3] as one __m128), kValueTile[nv] (chunks of kLanes columns a value pass takes at once for nv = 1..4
// vectors, what its registers hold) and scores_bf16(q, k, kv_row, D, scale, out) (one bf16 vector as
// stored against eight keys, the AVX512-BF16 dot products).

using V = Isa::V;
constexpr int kLanes = Isa::kLanes;
// The rows ahead, asked for as the kernels load rows (RowFeed, LineFeed). Where Isa::kSmoothFeed, a
// line per 64 bytes the loops load (kLoadsPerLine loads of kLanes columns), so that requests and
// loads interleave evenly: a turn's requests in bursts of 8-16 lines (the bf16 scores' share at the
// turn's end) held the core's line buffers while the loads behind them waited, and the memory
// idled while the core computed (bf16 decode attention from memory 1.17-1.19x faster fed evenly,
// 2 threads; Intel Xeon with AMX). Else a step per inner step (a step of the scores loads kLanes columns of
// four or eight keys, one of the values a key's chunks) of what spreads a turn's share over the
// steps at two query vectors a KV head (AVX2, measured on Zen 3).
template <typename T>
constexpr int kLoadsPerLine = std::max(1, 64 / (kLanes * static_cast<int>(sizeof(T))));
template <typename T>
using Feed = LineFeed<Isa::kSmoothFeed ? 1 : kLanes * static_cast<int>(sizeof(T)) / 16>;

// The feed's step before load `load` of an inner step.
template <typename T>
[[gnu::always_inline]] inline void feed_load(Feed<T>& feed, int load) {
  if (Isa::kSmoothFeed ? load % kLoadsPerLine<T> == 0 : load == 0) feed.step();
}

// out[v * out_stride + j] = q_v . k_j for NV scaled query vectors (q + v * D) and the KP keys k,
// k + kv_row, ... (D a multiple of kLanes; KP 8, or 4 where the set has a 4-key sum), the feed
// stepped as they load (feed_load).
template <int NV, int KP, typename T, typename I = Isa>  // I: only the sets with 4-key passes have sum4
inline void dot_keys(const float* __restrict q, const T* __restrict k, int64_t kv_row, int D, float* __restrict out,
                     int64_t out_stride, Feed<T>& feed) {
  V acc[NV][KP];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
    for (int j = 0; j < KP; ++j) acc[v][j] = Isa::zero();
  }
  for (int d = 0; d < D; d += kLanes) {
    V kv[KP];
#pragma GCC unroll 8
    for (int j = 0; j < KP; ++j) {
      feed_load<T>(feed, j);
      kv[j] = Isa::load(k + j * kv_row + d);
    }
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const V qv = Isa::load(q + static_cast<int64_t>(v) * D + d);
#pragma GCC unroll 8
      for (int j = 0; j < KP; ++j) acc[v][j] = Isa::fma(qv, kv[j], acc[v][j]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    if constexpr (KP == 8) {
      _mm256_storeu_ps(out + v * out_stride, Isa::sum8(acc[v]));
    } else {
      _mm_storeu_ps(out + v * out_stride, I::sum4(acc[v]));
    }
  }
}

// The same for the eight keys k, k + kv_row, ..., k + 7 * kv_row: in one pass where NV x 8
// accumulators fit the set's registers (Isa::kScoreAccumulators), else in two of four keys, so that
// every key's load (a bf16 one widened) still feeds all NV vectors.
template <int NV, typename T>
inline void dot8(const float* __restrict q, const T* __restrict k, int64_t kv_row, int D, float* __restrict out,
                 int64_t out_stride, Feed<T>& feed) {
  if constexpr (NV * 8 <= Isa::kScoreAccumulators) {
    dot_keys<NV, 8>(q, k, kv_row, D, out, out_stride, feed);
  } else {
    dot_keys<NV, 4>(q, k, kv_row, D, out, out_stride, feed);
    dot_keys<NV, 4>(q, k + 4 * kv_row, kv_row, D, out + 4, out_stride, feed);
  }
}

// acc[v][c * kLanes ..] += sum over keys i < n of p[v * p_stride + i] * x_i[c * kLanes ..] for NV
// vectors and W chunks of columns, accumulators held in registers across the keys (x_i = x + i *
// x_stride); the feed stepped as they load (feed_load).
template <int NV, int W, typename T>
inline void weighted_chunk(const float* __restrict p, int64_t p_stride, const T* __restrict x, int64_t x_stride, int n,
                           float* __restrict acc, int64_t acc_stride, Feed<T>& feed) {
  V a[NV][W];
  for (int v = 0; v < NV; ++v)
    for (int c = 0; c < W; ++c) a[v][c] = Isa::load(acc + v * acc_stride + c * kLanes);
  for (int i = 0; i < n; ++i, x += x_stride) {
    V pv[NV];
    for (int v = 0; v < NV; ++v) pv[v] = Isa::bcast(p + v * p_stride + i);
    for (int c = 0; c < W; ++c) {
      feed_load<T>(feed, c);
      const V xv = Isa::load(x + c * kLanes);
      for (int v = 0; v < NV; ++v) a[v][c] = Isa::fma(pv[v], xv, a[v][c]);
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int c = 0; c < W; ++c) Isa::store(acc + v * acc_stride + c * kLanes, a[v][c]);
}

// The same over all D columns (D % kLanes == 0): the widest chunks the registers hold, then four,
// then one at a time.
template <int NV, typename T>
inline void weighted_rows(const float* __restrict p, int64_t p_stride, const T* __restrict x, int64_t x_stride, int n,
                          int D, float* __restrict acc, int64_t acc_stride, Feed<T>& feed) {
  constexpr int W = Isa::kValueTile[NV];
  int d = 0;
  for (; d + W * kLanes <= D; d += W * kLanes) {
    weighted_chunk<NV, W>(p, p_stride, x + d, x_stride, n, acc + d, acc_stride, feed);
  }
  if constexpr (W > 4) {
    for (; d + 4 * kLanes <= D; d += 4 * kLanes) {
      weighted_chunk<NV, 4>(p, p_stride, x + d, x_stride, n, acc + d, acc_stride, feed);
    }
  }
  for (; d < D; d += kLanes) weighted_chunk<NV, 1>(p, p_stride, x + d, x_stride, n, acc + d, acc_stride, feed);
}

// Scores, softmax and weighted values of one task: the same results as attend_task's portable loops
// up to fp32 rounding. qf holds the task's V scaled query vectors, sc is [V, stride] (column j: key
// k0 + j) with stride >= L - k0 rounded up to 8, acc [V, D] zeros. qb, when not null, holds the same
// vectors unscaled in bf16 instead (qf is then not filled), and the scores take Isa::scores_bf16.
// Keys [k0, L) (k0 a multiple of tile_chunk(block size)); with `stats`, a part of a row's keys:
// the values unnormalized, each vector's max score and sum of exponentials into stats
// (softmax_visible).
template <typename T>
void attend_tiles(const PagedAttentionArgs& a, const int32_t* table, int64_t head_off, int heads, int per_head,
                  int base, int64_t L, int64_t stride, const float* qf, const Bf16* qb, float* sc, float* acc,
                  int64_t k0, float* stats) {
  const int group = a.num_heads / a.num_kv_heads;
  const int D = a.head_dim;
  const int bs = a.block_size;
  const int V = heads * per_head;
  const int64_t kv_row = static_cast<int64_t>(a.num_kv_heads) * D;
  const T* k_cache = static_cast<const T*>(a.k_cache) + head_off;
  // Eight keys at a time (bs % 8 == 0: never across blocks). Past L, the last chunk reads rows of
  // its block this pass does not take (unwritten, or the next part's): their scores land past L's
  // column and are never used.
  // Each pass asks for the rows a chunk (tile_chunk: 16 rows, or a block) ahead as it goes, a share
  // on each KV head's turn (RowFeed), fed to the kernels a line a step where the task has every KV
  // head and the kernel takes the feed (else asked for at the turn's start or end). The scores
  // pass's last chunk of steps (all of them in a pass shorter than a chunk) asks for the values
  // pass's first rows instead of keys past L. Measured (Zen 3, bf16, 16-token blocks, 2 threads;
  // RESULTS.md "Decode attention at the memory's rate"): one block ahead instead of two
  // 1.05-1.06x, the values' first rows asked for by the scores pass 1.02-1.04x more, the lines fed
  // from the loops 1.20-1.28x from memory.
  const int64_t ahead = tile_chunk(bs);
  const int64_t L8 = k0 + (L - k0 + 7) / 8 * 8;  // the scores pass's end
  const int64_t handoff = std::max(k0, L8 - ahead);  // its first step that asks for value rows
  const RowFeed<T> rows8(a, table, head_off, 8, heads);
  for (int64_t r = k0; r < k0 + ahead; r += 8) prefetch_rows<T>(a, table, r, 8, L, head_off, heads, a.k_cache);
  for (int64_t t0 = k0; t0 < L; t0 += 8) {
    const char* next = t0 < handoff ? rows8.rows(a.k_cache, t0 + ahead, L)
                                    : rows8.rows(a.v_cache, k0 + (t0 - handoff), L);
    const T* k = k_cache + (static_cast<int64_t>(table[t0 / bs]) * bs + t0 % bs) * kv_row;
    const int first = static_cast<int>(std::max<int64_t>(0, t0 - base)) * group;  // vectors that see key t0
    for (int h = 0; h < heads; ++h) {
      Feed<T> feed = rows8.template turn<Feed<T>>(next, h);
      const T* kh = k + static_cast<int64_t>(h) * D;
      const int end = (h + 1) * per_head;
      int v = h * per_head + first;
      if constexpr (std::is_same_v<T, Bf16>) {
        if (qb != nullptr) {
          // A GQA group's vectors two at a time on each key load (their 16 sums reduced at once), a
          // step of the feed a key (64 bytes a load).
          for (; v + 2 <= end; v += 2) {
            const Bf16* q0 = qb + static_cast<int64_t>(v) * D;
            float* s0 = sc + v * stride + t0 - k0;
            avx512_bf16::dot8x2(q0, q0 + D, kh, kv_row, D, a.scale, s0, s0 + stride, [&] { feed.step(); });
          }
          for (; v < end; ++v) {
            Isa::scores_bf16(qb + static_cast<int64_t>(v) * D, kh, kv_row, D, a.scale, sc + v * stride + t0 - k0);
          }
          feed.finish();
          continue;
        }
      }
      if constexpr (Isa::kScoreVectors == 2) {
        for (; v + 2 <= end; v += 2) {
          dot8<2>(qf + static_cast<int64_t>(v) * D, kh, kv_row, D, sc + v * stride + t0 - k0, stride, feed);
        }
      }
      for (; v < end; ++v) {
        dot8<1>(qf + static_cast<int64_t>(v) * D, kh, kv_row, D, sc + v * stride + t0 - k0, stride, feed);
      }
      feed.finish();
    }
  }
  softmax_visible(sc, stride, V, per_head, group, base, L, k0, stats);
  // Values a chunk at a time: each head's vectors, four at a time, add up the chunk's rows in
  // registers (the portable loop loaded and stored every accumulator once per key). A vector's
  // scores past the keys it sees are 0 (softmax_visible), so every vector takes every key of the
  // pass. The chunk was asked for ahead, so walking it head by head reads from cache.
  const T* v_cache = static_cast<const T*>(a.v_cache) + head_off;
  const RowFeed<T> block(a, table, head_off, static_cast<int>(ahead), heads);
  for (int64_t t0 = k0; t0 < L; t0 += ahead) {
    const T* x = v_cache + (static_cast<int64_t>(table[t0 / bs]) * bs + t0 % bs) * kv_row;
    const int n = static_cast<int>(std::min<int64_t>(ahead, L - t0));
    const char* next = block.rows(a.v_cache, t0 + ahead, L);
    for (int h = 0; h < heads; ++h) {
      Feed<T> feed = block.template turn<Feed<T>>(next, h);
      for (int v = h * per_head; v < (h + 1) * per_head; v += 4) {
        const float* pv = sc + v * stride + t0 - k0;
        const T* xh = x + static_cast<int64_t>(h) * D;
        float* av = acc + static_cast<int64_t>(v) * D;
        switch (std::min(4, (h + 1) * per_head - v)) {
          case 1: weighted_rows<1>(pv, stride, xh, kv_row, n, D, av, D, feed); break;
          case 2: weighted_rows<2>(pv, stride, xh, kv_row, n, D, av, D, feed); break;
          case 3: weighted_rows<3>(pv, stride, xh, kv_row, n, D, av, D, feed); break;
          default: weighted_rows<4>(pv, stride, xh, kv_row, n, D, av, D, feed); break;
        }
      }
      feed.finish();
    }
  }
}
