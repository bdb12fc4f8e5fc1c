// What the GEMMs on AMX tiles share (csrc/cpu_gemm_amx.cpp on bf16 weights, the quantized GEMM's
// path on int8 / int4 ones): the tile configuration and the rows of x as A tiles. A tile multiply
// C (16 x 16 fp32) += A (16 rows x 32 bf16) B (16 k pairs x 16 columns x 2 bf16) takes its B in the
// bf16 pair layout of csrc/cpu_gemm.h: a panel's k pairs, 64 bytes each.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_bf16_avx512.h"
#include "cpu_dtype.h"
#include "cpu_gemm.h"

namespace nanovllm::amx {

inline constexpr int64_t kTileRows = 16;
inline constexpr int64_t kTileDepth = 32;  // bf16 values in an A tile's row; k pairs x 2 in a B tile's

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes: C0..C3 fp32 16 x 16, A4/A5 and B6/B7 bf16 16 x 32. Loaded per
// call (oneDNN's kernels, on the same threads, load their own) and released after.
inline constexpr TileConfig kConfig = [] {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.bytes_per_row[t] = 64;
    c.rows[t] = kTileRows;
  }
  return c;
}();

// GCC's tile intrinsics are asm statements that do not tell the compiler which memory they read or
// write: a fence between them and the plain loads and stores of the same scratch keeps those in order.
inline void fence() { asm volatile("" ::: "memory"); }

// count T of a thread's scratch `storage`, 64-byte aligned: a tile row split over two cache lines
// loads several times slower (3-6x, B tiles from L1 to L3). The scratch only grows: resized down and
// up again (a MoE layer's experts of alternating row counts), a vector zero-fills what it regains.
template <typename T>
T* aligned(std::vector<T>& storage, int64_t count) {
  const auto size = static_cast<size_t>(count) + 64 / sizeof(T);
  if (storage.size() < size) storage.resize(size);
  const auto at = reinterpret_cast<uintptr_t>(storage.data());
  return reinterpret_cast<T*>((at + 63) / 64 * 64);
}

// Rows [0, m) of x (k a multiple of 32) in blocks of 16, the last zero-padded, each block [k / 32][16
// rows][32]: one contiguous 1 KB A tile after another. Read from x itself a tile would take 16 rows
// a power-of-two stride apart, a few L1 sets for all of them.
inline void pack_rows(const Bf16* x, int64_t x_stride, int64_t m, int64_t k, Bf16* out) {
  const int64_t steps = k / kTileDepth;
  for (int64_t r = 0; r < (m + kTileRows - 1) / kTileRows * kTileRows; ++r) {
    Bf16* dst = out + (r / kTileRows * steps * kTileRows + r % kTileRows) * kTileDepth;
    for (int64_t s = 0; s < steps; ++s, dst += kTileRows * kTileDepth) {
      if (r < m) {
        // A constant size, copied inline: std::copy_n called memmove for each 64 bytes (3% of a MoE
        // bf16 prefill, the call's small-size path waiting on the row's first load).
        std::memcpy(dst, x + r * x_stride + s * kTileDepth, kTileDepth * sizeof(Bf16));
      } else {
        std::fill_n(dst, kTileDepth, Bf16{0});
      }
    }
  }
}

#if defined(__x86_64__)
#define NANOVLLM_AMX_TILES [[gnu::target("amx-tile,amx-bf16")]]

// The C tiles of B row blocks (1 or 2) by P panels (1 or 2) zeroed: C[2 * b + q].
template <int B, int P>
NANOVLLM_AMX_TILES inline void zero_sums() {
  _tile_zero(0);
  if constexpr (P == 2) _tile_zero(1);
  if constexpr (B == 2) {
    _tile_zero(2);
    if constexpr (P == 2) _tile_zero(3);
  }
}

// C[2 * b + q] += block b's A tiles (a[b], `steps` in a row, 1 KB each; advanced past them) times
// panel q's B tiles from `w`: P panels in the pair layout, k pairs of the P panels interleaved (a
// panel's 64-byte k pairs P * 64 bytes apart). Tile numbers are immediates: each (B, P) its own code.
//
// With `stream`, B comes from memory: each step first asks for the next step's B lines into L2 (the
// last step for `then`'s, the B that follows this run: the next slice's, or none). A tile load waits
// for its lines, and the multiplies behind it wait for the load, so a thread that only demands its
// weights leaves the memory idle while its tiles multiply; the hardware prefetcher alone does not
// run far enough ahead. At 32 rows (four multiplies a step) the Qwen3-shaped layers' GEMMs ran
// 1.14-1.2x faster with it, 64 rows 1.1x, 8 rows 1.05x (weights from memory, 2 threads, Intel Xeon
// with AMX); asked for into L1 instead, 1.05x at most, and further ahead no better.
template <int B, int P>
NANOVLLM_AMX_TILES inline void multiply(const Bf16* (&a)[2], const Bf16* w, int64_t steps, bool stream = false,
                                        const Bf16* then = nullptr) {
  constexpr int64_t kPairRow = 16 * 2, kStride = P * kPairRow * 2, kATile = kTileRows * kTileDepth;
  constexpr int64_t kStepBytes = kTileDepth / 2 * kStride;
  for (int64_t d = 0; d < steps; ++d, a[0] += kATile, a[1] += kATile) {
    const Bf16* b = w + d * kTileDepth / 2 * P * kPairRow;
    const char* next = d + 1 < steps ? reinterpret_cast<const char*>(b) + kStepBytes : reinterpret_cast<const char*>(then);
    if (stream && next != nullptr) {
      for (int64_t line = 0; line < kStepBytes; line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
    }
    _tile_loadd(6, b, kStride);
    _tile_loadd(4, a[0], kTileDepth * 2);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (P == 2) _tile_loadd(7, b + kPairRow, kStride);
    if constexpr (P == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (B == 2) {
      _tile_loadd(5, a[1], kTileDepth * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (P == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// A panel pair's m rows of products (`cols` columns, rows `stride` apart) plus the bias (nullable),
// then, where y_bf16 is set, rounded into it (rows n apart). An AMX CPU has AVX512-BF16. The GEMMs'
// epilogue on the tiles' products: gemm_bf16_amx_panel_range's bf16 output and bias, the fp32 one's bias.
// `stream`: whole 64-byte lines of y_bf16 are written past the caches (an output larger than they
// hold: each line's write would first read it from memory). `round`: without y_bf16, the fp32
// products are stored rounded to bf16's precision (GemmBf16Args::round_y).
NANOVLLM_AVX512BF16 inline void finish_pair(float* out, int64_t stride, const float* bias, Bf16* y_bf16, int64_t n,
                                              int64_t m, int64_t cols, bool stream = false, bool round = false) {
  if (stream && y_bf16 != nullptr && bias == nullptr && cols == 2 * 16 &&
      reinterpret_cast<uintptr_t>(y_bf16) % 64 == 0 && n % 32 == 0) {
    for (int64_t r = 0; r < m; ++r) {
      const float* row = out + r * stride;
      __m256i* line = reinterpret_cast<__m256i*>(y_bf16 + r * n);
      _mm256_stream_si256(line, bf16x16::narrow(_mm512_loadu_ps(row)));
      _mm256_stream_si256(line + 1, bf16x16::narrow(_mm512_loadu_ps(row + 16)));
    }
    _mm_sfence();  // the streamed lines reach memory before a later load of another thread's
    return;
  }
  for (int64_t r = 0; r < m; ++r) {
    float* row = out + r * stride;
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 live = bf16x16::lanes(cols - c);
      __m512 v = _mm512_maskz_loadu_ps(live, row + c);
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, bias + c));
      if (y_bf16 != nullptr) {
        bf16x16::store(y_bf16 + r * n + c, v, live);
      } else {
        _mm512_mask_storeu_ps(row + c, live, round ? bf16x16::round(v) : v);
      }
    }
  }
}

// GCC 12's AVX-512 max and extracts start from _mm512_undefined_*(), which -Wmaybe-uninitialized
// reports once inlined (a known false positive), as in cpu_bf16_avx512.h.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// Rows [0, m) of a panel pair's products (`cols` columns from column col0, rows `stride` floats
// apart) compared into best[row] (GemmBf16Args::best): a larger value than the row's best so far
// takes its place with the first column holding it; NaNs are passed over.
NANOVLLM_AVX512BF16 inline void best_of_pair(const float* out, int64_t stride, int64_t m, int64_t cols, int64_t col0,
                                               RowBest* best) {
  const __mmask16 live0 = bf16x16::lanes(cols), live1 = cols > 16 ? bf16x16::lanes(cols - 16) : 0;
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < m; ++r) {
    const float* row = out + r * stride;
    const __m512 v0 = _mm512_maskz_loadu_ps(live0, row), v1 = _mm512_maskz_loadu_ps(live1, row + 16);
    const __mmask16 ok0 = _mm512_mask_cmp_ps_mask(live0, v0, v0, _CMP_ORD_Q);
    const __mmask16 ok1 = _mm512_mask_cmp_ps_mask(live1, v1, v1, _CMP_ORD_Q);
    const float most = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_blend_ps(ok0, lowest, v0),
                                                          _mm512_mask_blend_ps(ok1, lowest, v1)));
    RowBest& b = best[r];
    if (!(most > b.value || (b.index < 0 && most == b.value))) continue;  // -inf: taken once seen
    const __m512 target = _mm512_set1_ps(most);
    const __mmask16 at0 = _mm512_mask_cmp_ps_mask(ok0, v0, target, _CMP_EQ_OQ);
    const __mmask16 at1 = _mm512_mask_cmp_ps_mask(ok1, v1, target, _CMP_EQ_OQ);
    if (at0 != 0) {
      b = {most, col0 + __builtin_ctz(at0)};
    } else if (at1 != 0) {
      b = {most, col0 + 16 + __builtin_ctz(at1)};
    }
  }
}
#pragma GCC diagnostic pop

// C[2 * b + q] loaded from y[b] + q * 16, rows stride[b] floats apart: store_sums' inverse.
template <int B, int P>
NANOVLLM_AMX_TILES inline void load_sums(float* const (&y)[2], const int64_t (&stride)[2]) {
  _tile_loadd(0, y[0], stride[0] * 4);
  if constexpr (P == 2) _tile_loadd(1, y[0] + 16, stride[0] * 4);
  if constexpr (B == 2) {
    _tile_loadd(2, y[1], stride[1] * 4);
    if constexpr (P == 2) _tile_loadd(3, y[1] + 16, stride[1] * 4);
  }
}

// C[2 * b + q] stored at y[b] + q * 16, rows stride[b] floats apart.
template <int B, int P>
NANOVLLM_AMX_TILES inline void store_sums(float* const (&y)[2], const int64_t (&stride)[2]) {
  _tile_stored(0, y[0], stride[0] * 4);
  if constexpr (P == 2) _tile_stored(1, y[0] + 16, stride[0] * 4);
  if constexpr (B == 2) {
    _tile_stored(2, y[1], stride[1] * 4);
    if constexpr (P == 2) _tile_stored(3, y[1] + 16, stride[1] * 4);
  }
}

#endif

}  // namespace nanovllm::amx
