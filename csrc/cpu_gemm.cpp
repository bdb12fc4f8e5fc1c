#include "cpu_gemm.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_attention_avx2.h"
#include "cpu_gate_up_act.h"
#include "cpu_isa.h"
#include "cpu_parallel.h"
#include "cpu_sampler.h"

#define NANOVLLM_AVX512_BF16 __attribute__((target("avx512f,avx512bf16")))
#define NANOVLLM_AVX512F __attribute__((target("avx512f")))

namespace nanovllm {
namespace {

// Cache blocking (BLIS's kc and mc): a tile's slice of one weight panel (kKc deep) stays in L1
// while the tile walks the kMc rows of x below it; those rows' kKc columns (kMc x kKc floats,
// 144 KB) stay in L2 for every panel of the thread.
constexpr int64_t kKc = kGemmSliceDepth;
constexpr int64_t kMc = 144;
// A slice is prefetched this many slices ahead of its use in the thread's walk (within a pass the
// next panel's slice follows this one in memory): at decode batches the weights stream from DRAM, and one
// slice ahead arrived too late (8 layers + LM head of the Qwen3-shaped model at 32 rows: 79 ms
// with none, 66 one ahead, 56 two ahead; 16 rows: 40 -> 32 ms, ~16 GB/s, the machine's peak).
constexpr int64_t kPrefetchSlices = 2;
// Below a full tile of rows the AVX-512 pair tiles stream the weights past a few multiply-adds each,
// and the hardware prefetcher alone read them faster: the software prefetch then took 15-37% off the
// GEMM's read rate at 1-8 rows (Zen 4, fp32 and bf16 pairs, weights from DRAM). From 12 rows it pays
// (up to 24% at 16 rows with the weights in L3). The AVX2 tiles on bf16 weights ask at every row
// count: on Zen 3 the Qwen3-shaped layers' one-row GEMMs ran 1.24-1.32x faster with it alone, 1.18-1.22x
// at 4 rows, 1.08-1.14x at 8, and the engine's bf16 batch-1 step 1.07x (its MoE twin's 1.18x). On fp32
// weights they ask from kPrefetchMinRowsF32: below it (1-3 rows, as few multiply-adds a line as the
// AVX-512 tiles do) the hardware prefetcher alone read the layers as fast or 3-6% faster; from it
// the Qwen3-shaped layers ran 1.06-1.15x faster at 4-11 rows and a MoE decode's experts (~4 rows
// each) 1.04-1.08x (Zen 3, weights from DRAM).
constexpr int64_t kPrefetchMinRows = 12;
constexpr int64_t kPrefetchMinRowsF32 = 4;

// pairs: the slices of panels 2j and 2j + 1 interleaved unit by unit (cpu_gemm.h), a unit being
// one fp32 weight per column ([depth][2][16]) or a bf16 k pair ([depth / 2][2][16][2], k even); a
// last odd panel alone ([depth][16], [depth / 2][16][2]).
template <typename T>
void pack_typed(const T* w, int64_t n, int64_t k, int64_t w_stride, T* packed, bool pairs) {
  constexpr int64_t unit = sizeof(T) == 2 ? 2 : 1;
  const int64_t panels = gemm_panels(n);
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t first = pairs ? p - p % 2 : p;  // the panel whose slice starts the tile's stream
    const int64_t group = pairs && first + 1 < panels ? 2 : 1;
    for (int64_t c = 0; c < kGemmPanel; ++c) {
      const int64_t row = p * kGemmPanel + c;
      for (int64_t i = 0; i < k; ++i) {
        const int64_t k0 = i - i % kKc, d = i - k0;
        const int64_t at =
            pairs ? ((d / unit * group + p - first) * kGemmPanel + c) * unit + d % unit : d * kGemmPanel + c;
        // Rows past n pad the last panel with zeros.
        packed[gemm_slice_offset(panels, k, first, k0) + at] = row < n ? w[row * w_stride + i] : T{0};
      }
    }
  }
}

#if defined(__x86_64__)
// The register tiles: c[R x cols] (+)= a[R x kc] * b[kc x 16], a the tile's rows packed by pack_rows
// (element (r, i) at a[i * R + r * kUnit]; a single row is its own packing), b a panel's
// slice. The first pass over k (accumulate = false) starts from the bias (or zero) instead of c.
// Each prefetches prefetch_rows rows of 16 weights from `prefetch` on the way.

// AVX2 + FMA: fp32 rows of x; fp32 weights, or bf16 ones widened in registers.
template <typename TW>
struct WidenedTiles {
  using X = float;
  using W = TW;
  static constexpr int kRows = 6;  // 6 x 16 outputs: 12 of the 16 ymm registers
  static constexpr int kUnit = 1;
  static constexpr int kPanels = 1;
  static constexpr int64_t kPrefetchFromRows = std::is_same_v<TW, Bf16> ? 1 : kPrefetchMinRowsF32;

  template <int R, int P>
  static NANOVLLM_AVX2 void tile(const float* a, const TW* b, int64_t kc, float* c, int64_t ldc,
                                 int cols, bool accumulate, const float* bias, const TW* prefetch,
                                 int64_t prefetch_rows) {
    static_assert(P == 1);
    __m256 lo[R], hi[R];
    // Every loop over r unrolled, or the accumulators live on the stack instead of in registers.
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < kc; ++i) {
      if (i < prefetch_rows) _mm_prefetch(reinterpret_cast<const char*>(prefetch + i * kGemmPanel), _MM_HINT_T0);
      const __m256 b0 = avx2::load8(b + i * kGemmPanel);
      const __m256 b1 = avx2::load8(b + i * kGemmPanel + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(a + i * R + r);
        lo[r] = _mm256_fmadd_ps(x, b0, lo[r]);
        hi[r] = _mm256_fmadd_ps(x, b1, hi[r]);
      }
    }
    alignas(32) float bias16[kGemmPanel] = {};
    if (!accumulate && bias != nullptr) std::copy_n(bias, cols, bias16);
    const __m256 bias_lo = _mm256_load_ps(bias16), bias_hi = _mm256_load_ps(bias16 + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      float* out = c + r * ldc;
      if (cols == kGemmPanel) {
        const __m256 base_lo = accumulate ? _mm256_loadu_ps(out) : bias_lo;
        const __m256 base_hi = accumulate ? _mm256_loadu_ps(out + 8) : bias_hi;
        _mm256_storeu_ps(out, _mm256_add_ps(lo[r], base_lo));
        _mm256_storeu_ps(out + 8, _mm256_add_ps(hi[r], base_hi));
      } else {  // the last panel of an n that 16 does not divide
        alignas(32) float row[kGemmPanel];
        _mm256_store_ps(row, _mm256_add_ps(lo[r], bias_lo));
        _mm256_store_ps(row + 8, _mm256_add_ps(hi[r], bias_hi));
        for (int j = 0; j < cols; ++j) out[j] = accumulate ? out[j] + row[j] : row[j];
      }
    }
  }
};

// The AVX-512 pair tiles' accumulators, R rows x P panels, into c (+= or from the bias; `cols`
// counts the columns of all P panels, the last ones masked).
template <int R, int P>
NANOVLLM_AVX512F inline void store_tile(const __m512 (&acc)[P][R], float* c, int64_t ldc, int cols, bool accumulate,
                                        const float* bias) {
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) {
    const int n = std::clamp(cols - p * static_cast<int>(kGemmPanel), 0, static_cast<int>(kGemmPanel));
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
    const __m512 start = !accumulate && bias != nullptr ? _mm512_maskz_loadu_ps(keep, bias + p * kGemmPanel)
                                                        : _mm512_setzero_ps();
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      float* out = c + r * ldc + p * kGemmPanel;
      const __m512 base = accumulate ? _mm512_maskz_loadu_ps(keep, out) : start;
      _mm512_mask_storeu_ps(out, keep, _mm512_add_ps(acc[p][r], base));
    }
  }
}

// AVX512-BF16: bf16 rows of x on pair-packed bf16 weights, each vdpbf16ps two products per fp32
// lane (twice an FMA's), summed in fp32. Up to two panels per tile (P, 32 columns: 24
// accumulators), so that each broadcast of x feeds two dot products: with one panel the loads set
// the pace (one per vdpbf16ps). 6 x 4 and 8 x 3 tiles measured no better on Zen 4.
struct Bf16PairTiles {
  using X = Bf16;
  using W = Bf16;
  static constexpr int kRows = 12;
  static constexpr int kUnit = 2;  // a k pair
  static constexpr int kPanels = 2;
  static constexpr int64_t kPrefetchFromRows = kPrefetchMinRows;

  // P panels starting at an even one, their slices interleaved k pair by k pair (pack_typed);
  // `cols` counts the columns of all. The prefetch region may span P slices.
  template <int R, int P>
  static NANOVLLM_AVX512_BF16 void tile(const Bf16* a, const Bf16* b, int64_t kc, float* c,
                                        int64_t ldc, int cols, bool accumulate, const float* bias,
                                        const Bf16* prefetch, int64_t prefetch_rows) {
    __m512 acc[P][R];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) acc[p][r] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < kc; i += 2) {  // one k pair: 16 columns x 2 weights, one cache line a panel
      __m512bh w[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        if (i + p * kc < prefetch_rows) {
          _mm_prefetch(reinterpret_cast<const char*>(prefetch + (i + p * kc) * kGemmPanel), _MM_HINT_T0);
        }
        w[p] = (__m512bh)_mm512_loadu_si512(b + (i * P + 2 * p) * kGemmPanel);  // interleaved panels
      }
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, a + i * R + 2 * r, sizeof(pair));
        const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) acc[p][r] = _mm512_dpbf16_ps(acc[p][r], x, w[p]);
      }
    }
    store_tile<R, P>(acc, c, ldc, cols, accumulate, bias);
  }
};

// AVX-512: fp32 rows of x on pair-packed fp32 weights (panels 2j and 2j + 1 interleaved k by k),
// two zmm of 16 columns per row: each broadcast of x feeds two FMAs. With one panel a tile (12 x 16)
// issued a load per FMA, and on Zen 5, whose full-width FMA units do twice Zen 4's work a cycle,
// ran at 250-330 GF/s against oneDNN's ~370-410; 12 x 32 ran 1.12-1.32x faster (one process).
// The next pair's slice (32 KB) is asked for into L2, not L1: beside the slice in use (32 KB) it
// overflowed a 48 KB L1 and evicted rows the tile's other row tiles still read (32 rows by 1024 x
// 2048 fp32 from memory 1.1x faster, Intel Xeon with AMX; 256 rows unchanged; not measured on AMD).
struct Fp32PairTiles {
  using X = float;
  using W = float;
  static constexpr int kRows = 12;
  static constexpr int kUnit = 1;
  static constexpr int kPanels = 2;
  static constexpr int64_t kPrefetchFromRows = kPrefetchMinRows;

  template <int R, int P>
  static NANOVLLM_AVX512F void tile(const float* a, const float* b, int64_t kc, float* c, int64_t ldc,
                                    int cols, bool accumulate, const float* bias, const float* prefetch,
                                    int64_t prefetch_rows) {
    __m512 acc[P][R];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) acc[p][r] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < kc; ++i) {
      __m512 w[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        if (i + p * kc < prefetch_rows) {
          _mm_prefetch(reinterpret_cast<const char*>(prefetch + (i + p * kc) * kGemmPanel), _MM_HINT_T1);
        }
        w[p] = _mm512_loadu_ps(b + (i * P + p) * kGemmPanel);
      }
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512 x = _mm512_set1_ps(a[i * R + r]);
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) acc[p][r] = _mm512_fmadd_ps(x, w[p], acc[p][r]);
      }
    }
    store_tile<R, P>(acc, c, ldc, cols, accumulate, bias);
  }
};

// Units (4 bytes each) [j, j + 8) of 4 rows, src[r] the row r's first unit, to the tile's layout
// (unit (r, j) at dst[j * rt + r]): a 4 x 8 transpose in ymm registers, 20 instructions for the 64
// loads and stores of the unit-by-unit copy, which took 12% of an fp32 prefill's time.
NANOVLLM_AVX2 inline void transpose_4x8(const float* const (&src)[4], int64_t j, float* dst, int64_t rt) {
  const __m256 a = _mm256_loadu_ps(src[0] + j), b = _mm256_loadu_ps(src[1] + j);
  const __m256 c = _mm256_loadu_ps(src[2] + j), d = _mm256_loadu_ps(src[3] + j);
  const __m256 ab_lo = _mm256_unpacklo_ps(a, b), ab_hi = _mm256_unpackhi_ps(a, b);
  const __m256 cd_lo = _mm256_unpacklo_ps(c, d), cd_hi = _mm256_unpackhi_ps(c, d);
  // Each holds column q in its low half and column q + 4 in its high half, rows 0..3.
  const __m256 cols[4] = {_mm256_shuffle_ps(ab_lo, cd_lo, 0x44), _mm256_shuffle_ps(ab_lo, cd_lo, 0xEE),
                          _mm256_shuffle_ps(ab_hi, cd_hi, 0x44), _mm256_shuffle_ps(ab_hi, cd_hi, 0xEE)};
  for (int q = 0; q < 4; ++q) {
    _mm_storeu_ps(dst + (j + q) * rt, _mm256_castps256_ps128(cols[q]));
    _mm_storeu_ps(dst + (j + q + 4) * rt, _mm256_extractf128_ps(cols[q], 1));
  }
}

// Rows [0, rows) of x, kc deep, copied tile by tile (as tile_first cuts them) so that each
// tile reads one contiguous stream: a tile of rt rows holds kc / U groups of [rt][U] (U = Tiles::kUnit
// elements multiplied together: 1, or a bf16 k pair), i.e. element (r, i) at i * rt + r * U, each
// address a constant offset from the tile's start. In place, the rows of a tile would lie a
// power-of-two stride apart and evict each other from L1. A unit is 4 bytes either way (an fp32
// value, a bf16 pair): moved as a float's bits, never computed on.
template <typename Tiles>
NANOVLLM_AVX2 void pack_rows(const typename Tiles::X* x, int64_t lda, int64_t rows, int64_t kc,
                             typename Tiles::X* out) {
  constexpr int64_t kUnit = Tiles::kUnit;
  static_assert(kUnit * sizeof(typename Tiles::X) == sizeof(float));
  const int64_t units = kc / kUnit;
  // Row r's first unit; a bf16 row may start 2 bytes into a float (an odd lda): unaligned loads.
  const auto row = [&](int64_t r) { return reinterpret_cast<const float*>(x + r * lda); };
  const auto copy_unit = [](const float* from, float* to) { std::memcpy(to, from, sizeof(float)); };
  auto* packed = reinterpret_cast<float*>(out);
  const int64_t tiles = tile_count(rows, Tiles::kRows);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r0 = tile_first(t, rows, tiles), rt = tile_first(t + 1, rows, tiles) - r0;
    float* tile = packed + r0 * units;
    int64_t r = 0;
    for (; r + 4 <= rt; r += 4) {
      const float* const src[4] = {row(r0 + r), row(r0 + r + 1), row(r0 + r + 2), row(r0 + r + 3)};
      int64_t j = 0;
      for (; j + 8 <= units; j += 8) transpose_4x8(src, j, tile + r, rt);
      for (; j < units; ++j) {
        for (int q = 0; q < 4; ++q) copy_unit(src[q] + j, tile + j * rt + r + q);
      }
    }
    for (; r < rt; ++r) {
      const float* src = row(r0 + r);
      for (int64_t j = 0; j < units; ++j) copy_unit(src + j, tile + j * rt + r);
    }
  }
}

template <typename Tiles, int P>
void panel_rows(const typename Tiles::X* x, int64_t rows, const typename Tiles::W* b, int64_t kc,
                float* c, int64_t ldc, int cols, bool accumulate, const float* bias,
                const typename Tiles::W* prefetch, int64_t prefetch_rows) {
  const int64_t share = tile_count(prefetch_rows, tile_count(rows, Tiles::kRows));  // of the prefetch, each tile's
  row_tiles<Tiles::kRows>(rows, [&]<int R>(int64_t t, int64_t r) {
    Tiles::template tile<R, P>(x + r * kc, b, kc, c + r * ldc, ldc, cols, accumulate, bias,
                               prefetch + std::min(t * share, prefetch_rows) * kGemmPanel,
                               std::clamp<int64_t>(prefetch_rows - t * share, 0, share));
  });
}

// panel_rows for np (1 .. Tiles::kPanels) panels.
template <typename Tiles, int P = Tiles::kPanels, typename... Args>
void panels_rows(int64_t np, Args... args) {
  if constexpr (P > 1) {
    if (np < P) return panels_rows<Tiles, P - 1>(np, args...);
  }
  panel_rows<Tiles, P>(args...);
}

// The GEMM's operands as the walk below reads them.
template <typename Tiles>
struct Operands {
  const typename Tiles::X* x;
  const typename Tiles::W* packed;
  const float* bias;
  float* y;
  int64_t m, n, k, x_stride, y_stride;
};

// The thread's panels [p0, p1): each kc slice of a panel is loaded once per kMc rows of x.
template <typename Tiles>
void gemm_panels_range(const Operands<Tiles>& a, int64_t p0, int64_t p1) {
  if (p0 >= p1) return;  // a team wider than its panels (PanelShare's pairs): nothing to pack rows for
  const int64_t panels = gemm_panels(a.n);
  // The slice kPrefetchSlices after (k0, m0, p) in this walk, and its rows; none past the end.
  const auto ahead = [&](int64_t k0, int64_t m0, int64_t p) -> std::pair<const typename Tiles::W*, int64_t> {
    int64_t q = p + kPrefetchSlices;
    if (q >= p1) {  // into the next pass over the panels: the next rows, else the next slice depth
      q = p0 + (q - p1) % (p1 - p0);
      if (m0 + kMc >= a.m) k0 += kKc;
      if (k0 >= a.k) return {a.packed, 0};
    }
    return {a.packed + gemm_slice_offset(panels, a.k, q, k0), std::min(kKc, a.k - k0)};
  };
  thread_local std::vector<typename Tiles::X> rows;
  rows.resize(kMc * kKc);
  for (int64_t k0 = 0; k0 < a.k; k0 += kKc) {
    const int64_t kc = std::min(kKc, a.k - k0);
    for (int64_t m0 = 0; m0 < a.m; m0 += kMc) {
      const int64_t mc = std::min(kMc, a.m - m0);
      const typename Tiles::X* xs = a.x + m0 * a.x_stride + k0;
      if (mc > 1) {  // copied once per block, read by every panel of the thread
        pack_rows<Tiles>(xs, a.x_stride, mc, kc, rows.data());
        xs = rows.data();
      }
      for (int64_t p = p0; p < p1; p += Tiles::kPanels) {
        const int64_t np = std::min<int64_t>(Tiles::kPanels, p1 - p);  // the thread's last panel may be alone
        const int64_t col0 = p * kGemmPanel;
        const int cols = static_cast<int>(std::min(np * kGemmPanel, a.n - col0));
        const auto [next, next_rows] = ahead(k0, m0, p + np - 1);
        const auto* b = a.packed + gemm_slice_offset(panels, a.k, p, k0);
        float* c = a.y + m0 * a.y_stride + col0;
        const float* bias = a.bias == nullptr ? nullptr : a.bias + col0;
        // The prefetch covers the next tile's np slices, as far as the packed weight goes.
        const int64_t left = a.packed + panels * a.k * kGemmPanel - next;
        const int64_t next_all = mc < Tiles::kPrefetchFromRows ? 0 : std::min(next_rows * np, left / kGemmPanel);
        panels_rows<Tiles>(np, xs, mc, b, kc, c, a.y_stride, cols, k0 > 0, bias, next, next_all);
      }
    }
  }
}
#endif

}  // namespace

void gemm_pack(const void* w, CpuDtype dtype, int64_t n, int64_t k, int64_t w_stride, void* packed, bool pairs) {
  if (dtype == CpuDtype::kFloat32) {
    pack_typed(static_cast<const float*>(w), n, k, w_stride, static_cast<float*>(packed), pairs);
  } else {
    pack_typed(static_cast<const Bf16*>(w), n, k, w_stride, static_cast<Bf16*>(packed), pairs);
  }
}

void gemm_panel_range(const GemmArgs& a, int64_t p0, int64_t p1) {
#if defined(__x86_64__)
  if (a.pairs && a.amx && a.m >= kAmxFp32MinRows && has_amx_bf16()) {
    gemm_fp32_amx_panel_range(a, p0, p1);
  } else if (a.pairs) {
    gemm_panels_range<Fp32PairTiles>({a.x, static_cast<const float*>(a.packed), a.bias, a.y, a.m, a.n, a.k,
                                        a.x_stride, a.y_stride},
                                       p0, p1);
  } else if (a.packed_dtype == CpuDtype::kFloat32) {
    gemm_panels_range<WidenedTiles<float>>({a.x, static_cast<const float*>(a.packed), a.bias, a.y, a.m, a.n, a.k,
                                            a.x_stride, a.y_stride},
                                           p0, p1);
  } else {
    gemm_panels_range<WidenedTiles<Bf16>>({a.x, static_cast<const Bf16*>(a.packed), a.bias, a.y, a.m, a.n, a.k,
                                           a.x_stride, a.y_stride},
                                          p0, p1);
  }
#else
  (void)a;
  (void)p0;
  (void)p1;
#endif
}

namespace {
// Columns [p0, p1) panels of the fp32 product y (m rows y_stride apart, n columns) rounded into out.
void narrow_panels(const float* y, int64_t y_stride, Bf16* out, int64_t m, int64_t n, int64_t p0, int64_t p1) {
  const int64_t c0 = p0 * kGemmPanel, c1 = std::min(n, p1 * kGemmPanel);
  if (c0 >= c1) return;
  for (int64_t r = 0; r < m; ++r) narrow_n(y + r * y_stride + c0, out + r * n + c0, c1 - c0);
}

// The same columns rounded to bf16's precision in place (GemmBf16Args::round_y).
void round_panels(float* y, int64_t y_stride, int64_t m, int64_t n, int64_t p0, int64_t p1) {
  const int64_t c0 = p0 * kGemmPanel, c1 = std::min(n, p1 * kGemmPanel);
  for (int64_t r = 0; r < m; ++r) {
    float* row = y + r * y_stride;
    for (int64_t c = c0; c < c1; ++c) row[c] = round_to<Bf16>(row[c]);
  }
}
}  // namespace

bool amx_takes(const GemmBf16Args& a) {
#if defined(__x86_64__)
  return a.amx && a.k % 32 == 0 && has_amx_bf16();
#else
  (void)a;
  return false;
#endif
}

void gemm_bf16_panel_range(const GemmBf16Args& a, int64_t p0, int64_t p1) {
#if defined(__x86_64__)
  if (amx_takes(a)) {
    gemm_bf16_amx_panel_range(a, p0, p1);
    return;
  }
  assert(a.best == nullptr);  // AMX tiles only (GemmBf16Args::best)
  gemm_panels_range<Bf16PairTiles>({a.x, a.packed, a.bias, a.y, a.m, a.n, a.k, a.x_stride, a.y_stride}, p0, p1);
  if (a.y_bf16 != nullptr) narrow_panels(a.y, a.y_stride, a.y_bf16, a.m, a.n, p0, p1);
  if (a.round_y) round_panels(a.y, a.y_stride, a.m, a.n, p0, p1);
  if (a.act != nullptr) {
    for (int64_t r = 0; r < a.m; ++r) silu_mul_panels_x16(a.y + r * a.y_stride, a.act + r * (a.n / 2), p0, p1);
  }
#else
  (void)a;
  (void)p0;
  (void)p1;
#endif
}

namespace {
// The threads an m x k x n GEMM's panel pairs are worth.
int64_t panel_pairs_team(int64_t n, int64_t m, int64_t k, int num_threads) {
  return rows_team((gemm_panels(n) + 1) / 2, m * k * 2 * kGemmPanel, num_threads);
}

// The n columns' panels split over the team by PanelShare (at even panels, where the pair layouts'
// tiles start), on panel_pairs_team's threads: run(p0, p1), or run(p0, p1, thread) (thread i's
// panels come before thread i + 1's).
template <typename Run>
void parallel_panel_pairs(int64_t n, int64_t m, int64_t k, int num_threads, const Run& run) {
  const int64_t panels = gemm_panels(n);
  parallel_team(panel_pairs_team(n, m, k, num_threads), [&run, panels](int64_t i, int64_t team) {
    const PanelShare share(panels, i, team);
    if constexpr (std::is_invocable_v<Run, int64_t, int64_t, int64_t>) {
      run(share.begin, share.end, i);
    } else {
      run(share.begin, share.end);
    }
  });
}

// run(p0, p1) on each thread's panels of a GEMM of gemm_panel_range's layout.
template <typename Run>
void parallel_gemm_panels(const GemmArgs& a, int num_threads, const Run& run) {
  if (a.pairs) {
    parallel_panel_pairs(a.n, a.m, a.k, num_threads, run);
  } else {  // the AVX2 tiles take any panel range: a finer split
    parallel_rows(gemm_panels(a.n), a.m * a.k * kGemmPanel, num_threads, run);
  }
}
}  // namespace

void gemm(const GemmArgs& a, int num_threads) {
  parallel_gemm_panels(a, num_threads, [&a](int64_t p0, int64_t p1) { gemm_panel_range(a, p0, p1); });
}

void gemm_bf16(const GemmBf16Args& a, int num_threads) {
  parallel_panel_pairs(a.n, a.m, a.k, num_threads, [&a](int64_t p0, int64_t p1) { gemm_bf16_panel_range(a, p0, p1); });
}

void gemm_narrowed(const GemmArgs& a, Bf16* y_bf16, int num_threads) {
  parallel_gemm_panels(a, num_threads, [&a, y_bf16](int64_t p0, int64_t p1) {
    gemm_panel_range(a, p0, p1);
    narrow_panels(a.y, a.y_stride, y_bf16, a.m, a.n, p0, p1);
  });
}

void gemm_bf16_narrowed(const GemmBf16Args& a, Bf16* y_bf16, int num_threads) {
  GemmBf16Args narrowed = a;
  narrowed.y_bf16 = y_bf16;
  parallel_panel_pairs(a.n, a.m, a.k, num_threads,
                       [&narrowed](int64_t p0, int64_t p1) { gemm_bf16_panel_range(narrowed, p0, p1); });
}

void gemm_logits(const GemmLogitsArgs& a, int num_threads) {
  if (a.m == 0) return;
  // bf16 rows: the logits rounded as a bf16 F.linear's output.
  const bool bf16_rows = a.x_dtype == CpuDtype::kBFloat16;
  // The rows as the GEMM takes them: converted where x is the other dtype (fp32 rows rounded to bf16,
  // as cpu/gemm.py's bf16_rows; bf16 rows widened, exactly).
  const auto rows = [&a, bf16_rows]<typename To>(std::vector<To>& storage) {
    return bf16_rows ? rows_as<To>(static_cast<const Bf16*>(a.x), a.m, a.k, a.x_stride, storage)
                     : rows_as<To>(static_cast<const float*>(a.x), a.m, a.k, a.x_stride, storage);
  };
  if (a.pairs && a.packed_dtype == CpuDtype::kBFloat16) {
    std::vector<Bf16> narrowed;
    const auto [x, stride] = rows(narrowed);
    GemmBf16Args g{x, static_cast<const Bf16*>(a.packed), nullptr, a.y, a.m, a.n, a.k, stride, a.y_stride};
    g.round_y = bf16_rows;
    parallel_panel_pairs(a.n, a.m, a.k, num_threads, [&](int64_t p0, int64_t p1) { gemm_bf16_panel_range(g, p0, p1); });
    return;
  }
  std::vector<float> widened;
  const auto [x, stride] = rows(widened);
  const GemmArgs g{x, a.packed, nullptr, a.y, a.m, a.n, a.k, stride, a.y_stride, a.packed_dtype, a.pairs};
  parallel_gemm_panels(g, num_threads, [&](int64_t p0, int64_t p1) {
    gemm_panel_range(g, p0, p1);
    if (bf16_rows) round_panels(a.y, a.y_stride, a.m, a.n, p0, p1);
  });
}

void gemm_greedy(const GemmLogitsArgs& a, int64_t* ids, int num_threads) {
  if (a.m == 0) return;
  const bool bf16_pairs = a.x_dtype == CpuDtype::kBFloat16 && a.pairs && a.packed_dtype == CpuDtype::kBFloat16;
  GemmBf16Args g{bf16_pairs ? static_cast<const Bf16*>(a.x) : nullptr, static_cast<const Bf16*>(a.packed), nullptr,
                 nullptr, a.m, a.n, a.k, a.x_stride, a.n};
  g.round_y = true;
  if (bf16_pairs && amx_takes(g)) {
    // Each thread's best of its panels, then the threads' in column order.
    const int64_t team = panel_pairs_team(a.n, a.m, a.k, num_threads);
    std::vector<RowBest> parts(team * a.m);
    parallel_panel_pairs(a.n, a.m, a.k, num_threads, [&](int64_t p0, int64_t p1, int64_t i) {
      GemmBf16Args mine = g;
      mine.best = parts.data() + i * a.m;
      gemm_bf16_panel_range(mine, p0, p1);
    });
    for (int64_t r = 0; r < a.m; ++r) {
      RowBest b;
      for (int64_t i = 0; i < team; ++i) {
        const RowBest& c = parts[i * a.m + r];
        if (c.index >= 0 && (b.index < 0 || c.value > b.value)) b = c;
      }
      ids[r] = std::max<int64_t>(b.index, 0);
    }
    return;
  }
  const auto logits = std::make_unique_for_overwrite<float[]>(a.m * a.n);
  GemmLogitsArgs full = a;
  full.y = logits.get();
  full.y_stride = a.n;
  gemm_logits(full, num_threads);
  argmax_rows({logits.get(), a.m, a.n, a.n}, ids, num_threads);
}

}  // namespace nanovllm
