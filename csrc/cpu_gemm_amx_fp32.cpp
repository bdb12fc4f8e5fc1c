// gemm_panel_range's fp32 GEMM on AMX tiles, for a prefill's many rows: each fp32 value of x and of
// the weight split into three bf16 values that sum to it (v = v0 + v1 + v2, each the leading bits
// of what the ones before leave), and the six products of pieces that reach fp32's precision summed
// in fp32 by the tiles: x0 w0, x0 w1, x0 w2, x1 w1, x1 w0, x2 w0. Each is exact (8 x 8 bits); the
// three left out (x1 w2, x2 w1, x2 w2) come to below 2^-21 |x w| (x rounded: |x1| <= 2^-8 |x|,
// |x2| <= 2^-16 |x|; the weight truncated: |w1| < 2^-7 |w|, |w2| < 2^-14 |w|), a few fp32 roundings.
// The six multiplies of a 16 x 32 tile step take a sixth of the tiles' rate, still more than the
// FMA units' on the two cores (the "bf16x6" of Henry, Tang and Heinecke, "Leveraging the bfloat16
// Artificial Intelligence Datatype For Higher-Precision Computations", 2019). Each output sums its
// 6k products into one fp32 tile lane in order, where the FMA tiles sum 256-deep slices apart:
// within the (k + 8) fp32 roundings bound of either, but on long sums of one sign its error grows
// faster (k = 8192, all positive: ~47 roundings of the magnitudes' sum against ~6).
//
// Where the pieces cannot hold a value, the FMA tiles compute: a row of x holding a value that is not
// finite or that rounds past bf16's largest (~3.3961e38), and a panel pair whose weights hold one that
// is not finite (an infinity times a zero piece would give NaN where fp32 gives the infinity). The
// tiles read bf16 subnormals as zero: the pieces of values below ~2^-110 lose their tails (an absolute
// error below 2^-126 |w|), and a subnormal weight counts as zero. Which tiles a row takes depends on
// its GEMM's row count (kAmxFp32MinRows): a row's bits differ, within these bounds, between a GEMM of
// fewer rows and one of more.
//
// The weight stays as packed for the FMA tiles (pair-packed fp32, what a decode step streams): each
// pass splits one panel pair's slice into the tiles' bf16 pair layout, three planes, in a scratch
// that stays in L1 while every block of the chunk's rows multiplies by it; the rows are split once
// per chunk into A tiles.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <span>
#include <vector>

#include "cpu_amx.h"
#include "cpu_gemm.h"

namespace nanovllm {

#if defined(__x86_64__)
#define NANOVLLM_AMX_FP32 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

// GCC 12's AVX-512 conversions start from _mm*_undefined_*(), which -Wuninitialized reports once
// inlined (a known false positive), as in cpu_bf16_avx512.h.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace {

using amx::kTileDepth;
using amx::kTileRows;

constexpr int kPieces = 3;
constexpr int64_t kATile = kTileRows * kTileDepth;  // bf16 values of an A tile (1 KB)

// x rounded to bf16 (to nearest even; a subnormal read as zero, as the tiles read one), as fp32.
NANOVLLM_AMX_FP32 inline __m512 bf16_part(__m512 x) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The lanes of x the pieces hold: finite and below what rounds to bf16's infinity (NaN: none).
NANOVLLM_AMX_FP32 inline __mmask16 representable(__m512 x) {
  return _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(std::bit_cast<float>(0x7f7f8000u)), _CMP_LT_OQ);
}

// 16 values as three bf16 values each (as fp32: their low 16 bits zero) that sum to them, each piece
// the rounding of what the ones before leave. Lanes not representable() take zeros past the first
// piece (x - x0 would be NaN); their rows go to the FMA tiles.
NANOVLLM_AMX_FP32 inline void split(__m512 x, __m512 (&piece)[kPieces]) {
  piece[0] = bf16_part(x);
  const __m512 rest = _mm512_maskz_sub_ps(representable(x), x, piece[0]);
  piece[1] = bf16_part(rest);
  piece[2] = bf16_part(_mm512_sub_ps(rest, piece[1]));
}

// split's pieces by truncation: each the leading 8 bits of what the ones before leave, exact and
// without a conversion (a few operations where split takes twelve). The last piece's low bits are
// cleared too: they are zero but where what is left is subnormal, and split_panels packs two
// values' upper halves into a lane by shifting one and or-ing the other whole. Returns the lanes
// that are not finite (their panel pair goes to the FMA tiles).
NANOVLLM_AMX_FP32 inline __mmask16 split_truncated(__m512 x, __m512 (&piece)[kPieces]) {
  const __m512 high = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  piece[0] = _mm512_and_ps(x, high);
  const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(__builtin_inff()), _CMP_LT_OQ);
  const __m512 rest = _mm512_maskz_sub_ps(finite, x, piece[0]);
  piece[1] = _mm512_and_ps(rest, high);
  piece[2] = _mm512_and_ps(_mm512_sub_ps(rest, piece[1]), high);
  return static_cast<__mmask16>(~finite);
}

// The bf16 bits of two vectors of bf16 values (split's pieces), lo's 16 then hi's 16.
NANOVLLM_AMX_FP32 inline __m512i pack_halves(__m512 lo, __m512 hi) {
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // exact: both already bf16 values
}

// Rows [0, m) of x (fp32, rows x_stride apart, k deep) split into A tiles: per 16-row block and per
// 32 deep, the three pieces' tiles one after another ([blocks][kp / 32][3][16][32], kp = k rounded up
// to 32, zero past k and past m). The rows holding a value the pieces cannot (representable) are
// appended to `special`.
NANOVLLM_AMX_FP32 void split_rows(const float* x, int64_t x_stride, int64_t m, int64_t k, Bf16* out,
                                  std::vector<int64_t>& special) {
  const int64_t steps = (k + kTileDepth - 1) / kTileDepth;
  const int64_t rows = (m + kTileRows - 1) / kTileRows * kTileRows;
  for (int64_t r = 0; r < rows; ++r) {
    Bf16* dst = out + (r / kTileRows * steps * kPieces * kTileRows + r % kTileRows) * kTileDepth;
    __mmask16 held = 0xffff;
    for (int64_t s = 0; s < steps; ++s, dst += kPieces * kATile) {
      const int64_t d = s * kTileDepth;
      __m512 v[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      if (r < m) {
        const float* row = x + r * x_stride + d;
        for (int h = 0; h < 2; ++h) {
          const int64_t left = k - d - h * 16;
          const __mmask16 live = left >= 16 ? 0xffff : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
          v[h] = _mm512_maskz_loadu_ps(live, row + h * 16);
        }
      }
      held &= representable(v[0]) & representable(v[1]);
      __m512 lo[kPieces], hi[kPieces];
      split(v[0], lo);
      split(v[1], hi);
      for (int i = 0; i < kPieces; ++i) _mm512_storeu_si512(dst + i * kATile, pack_halves(lo[i], hi[i]));
    }
    if (r < m && held != 0xffff) special.push_back(r);
  }
}

// Depths [d0, d1) (d0 a multiple of 32) of np panels from p (pair-packed fp32: a pair's slice is
// [depth][2][16], a lone last panel's [depth][16]) split into B tiles: per 32 deep the three
// pieces' tiles of the np panels ([steps][3][16 k pairs][np][16][2], as amx::multiply reads a
// panel pair's), zero past k. Returns whether a weight among them is not finite.
NANOVLLM_AMX_FP32 bool split_panels(const float* packed, int64_t panels, int64_t k, int64_t p, int np, int64_t d0,
                                    int64_t d1, Bf16* out) {
  __mmask16 special = 0;
  const int64_t pair_row = np * kGemmPanel;  // floats of one depth of the panels' slice
  const int64_t step_values = kPieces * kTileDepth * np * kGemmPanel;
  for (int64_t d = d0; d < d1; d += 2) {
    Bf16* dst = out + (d - d0) / kTileDepth * step_values + (d - d0) % kTileDepth / 2 * np * 2 * kGemmPanel;
    const int64_t k0 = d / kGemmSliceDepth * kGemmSliceDepth;
    const float* slice = packed + gemm_slice_offset(panels, k, p, k0);
    for (int q = 0; q < np; ++q) {
      __m512 even[kPieces], odd[kPieces];
      const __m512 zero = _mm512_setzero_ps();
      special |= split_truncated(d < k ? _mm512_loadu_ps(slice + (d - k0) * pair_row + q * kGemmPanel) : zero, even);
      special |= split_truncated(d + 1 < k ? _mm512_loadu_ps(slice + (d + 1 - k0) * pair_row + q * kGemmPanel) : zero, odd);
      for (int i = 0; i < kPieces; ++i) {
        // Column c's pair in lane c: the even depth's bits low, the odd's high.
        const __m512i lanes = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even[i]), 16),
                                              _mm512_castps_si512(odd[i]));
        _mm512_storeu_si512(dst + i * kTileDepth * np * kGemmPanel + q * 2 * kGemmPanel, lanes);
      }
    }
  }
  return special != 0;
}

// One 32-deep step of C[2 * b + q] += the six piece products, B blocks (1 or 2) by P panels (1 or
// 2): a[b] the block's three piece tiles of the step, w the step's three B planes (split_panels).
// Pieces load in the order that reuses each the most: 14 tile loads for 24 multiplies at 2 x 2.
template <int B, int P>
NANOVLLM_AMX_FP32 inline void products(const Bf16* a0, const Bf16* a1, const Bf16* w) {
  constexpr int64_t kPlane = kTileDepth * P * kGemmPanel, kBStride = P * 2 * kGemmPanel * sizeof(Bf16);
  constexpr int64_t kAStride = kTileDepth * sizeof(Bf16);
  const auto load_a = [&](int i) NANOVLLM_AMX_FP32 {
    _tile_loadd(4, a0 + i * kATile, kAStride);
    if constexpr (B == 2) _tile_loadd(5, a1 + i * kATile, kAStride);
  };
  const auto load_b = [&](int i) NANOVLLM_AMX_FP32 {
    _tile_loadd(6, w + i * kPlane, kBStride);
    if constexpr (P == 2) _tile_loadd(7, w + i * kPlane + 2 * kGemmPanel, kBStride);
  };
  const auto multiply = []() NANOVLLM_AMX_FP32 {
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (P == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (B == 2) {
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (P == 2) _tile_dpbf16ps(3, 5, 7);
    }
  };
  load_a(0);
  load_b(2);
  multiply();  // x0 w2
  load_b(0);
  multiply();  // x0 w0
  load_b(1);
  multiply();  // x0 w1
  load_a(1);
  multiply();  // x1 w1
  load_b(0);
  multiply();  // x1 w0
  load_a(2);
  multiply();  // x2 w0
}

// Block pair (or block) tiles a, `steps` steps, against the pass's B planes w, from C sums loaded
// from `from` (or zero) into `to` (rows stride floats apart); between(s) after step s's multiplies.
template <int B, int P, typename Between>
NANOVLLM_AMX_FP32 void multiply_pass(const Bf16* const (&a)[2], int64_t steps, const Bf16* w, float* const (&from)[2],
                                     float* const (&to)[2], const int64_t (&to_stride)[2], const Between& between) {
  constexpr int64_t kCarryStride[2] = {2 * kGemmPanel, 2 * kGemmPanel};
  if (from[0] == nullptr) {
    amx::zero_sums<B, P>();
  } else {
    amx::load_sums<B, P>(from, kCarryStride);
  }
  constexpr int64_t kStepA = kPieces * kATile, kStepB = kPieces * kTileDepth * P * kGemmPanel;
  for (int64_t s = 0; s < steps; ++s) {
    products<B, P>(a[0] + s * kStepA, a[1] + s * kStepA, w + s * kStepB);
    between(s);
  }
  amx::store_sums<B, P>(to, to_stride);
}

// Share `call` of `calls` of the cache lines of `bytes` asked for into L2: the source of the pass
// after next (a panel pair's 64 depths, 8 KB), spread over this pass's steps. A MoE layer's experts
// come from memory once a step, and without it the split waited on its loads: a fifth of an fp32 MoE
// prefill's time.
inline void prefetch_share(std::span<const char> bytes, int64_t call, int64_t calls) {
  const int64_t lines = static_cast<int64_t>(bytes.size() + 63) / 64;
  for (int64_t line = call * lines / calls; line < (call + 1) * lines / calls; ++line) {
    _mm_prefetch(bytes.data() + line * 64, _MM_HINT_T1);
  }
}

// Depth of a pass: its B planes (6 KB a step for a pair; this pass's and the next's, 24 KB) stay in
// L1 beside the A tiles streaming by and the carried sums. 128 deep (48 KB of planes) ran 1.04-1.13x
// slower, 32 deep 1.1-1.2x slower (2048 x 1024 x 6144, 2048 x 3072 x 1024, 256 x 1024 x 3072; Intel
// Xeon with AMX, 2 threads, in turns).
constexpr int64_t kPassDepth = 64;

// Rows split and multiplied at a time: their A tiles (6 bytes a value) about 1 MB, in a core's L2
// while every panel pair's passes go by, and at least 64, over which each pass's split is shared
// (the split's cost is per chunk). At k = 1024 chunks of 160 rows ran 1.1x faster than of 256 (1.5
// MB); at k = 3072 the budget alone gives 32 rows, which ran 1.2x slower than 64. A GEMM of fewer than
// twice these rows takes them in one chunk (below): at k = 512, 512 rows in one chunk or in two of
// 256 ran within the noise of each other.
int64_t rows_per_chunk(int64_t kp) {
  constexpr int64_t kChunkBytes = 1024 * 1024, kMinRows = 64, kTwoBlocks = 2 * kTileRows;
  return std::max(kMinRows, kChunkBytes / (kp * kPieces * static_cast<int64_t>(sizeof(Bf16))) / kTwoBlocks * kTwoBlocks);
}

}  // namespace

NANOVLLM_AMX_FP32 void gemm_fp32_amx_panel_range(const GemmArgs& a, int64_t p0, int64_t p1) {
  if (p0 >= p1 || a.m == 0) return;
  const auto* packed = static_cast<const float*>(a.packed);
  const int64_t panels = gemm_panels(a.n), steps = (a.k + kTileDepth - 1) / kTileDepth, kp = steps * kTileDepth;
  // Near-equal chunks (whole blocks) of at least rows_per_chunk rows: a short last chunk would split
  // the weight again for a few rows (65 rows at k = 3072 as 64 + 1 took 2.2x the time of 64).
  const int64_t chunks = std::max<int64_t>(1, a.m / rows_per_chunk(kp));
  const int64_t chunk = ((a.m + chunks - 1) / chunks + kTileRows - 1) / kTileRows * kTileRows;
  constexpr int64_t kSums = kTileRows * 2 * kGemmPanel;  // one block's sums by a pair: 2 KB
  const int64_t plane_values = kPassDepth * kPieces * 2 * kGemmPanel;
  thread_local std::vector<Bf16> tiles_storage, planes_storage;
  thread_local std::vector<float> carry_storage, spill_storage;
  Bf16* const tiles = amx::aligned(tiles_storage, chunk * kp * kPieces);
  Bf16* const planes = amx::aligned(planes_storage, 2 * plane_values);  // two passes': this one's, the next's
  float* const carry = amx::aligned(carry_storage, chunk / kTileRows * kSums);
  float* const spill = amx::aligned(spill_storage, 2 * kSums);
  const int64_t passes = (kp + kPassDepth - 1) / kPassDepth, pairs = (p1 - p0 + 1) / 2;
  // Pass i of a chunk: panel pair i / passes, depths from i % passes.
  const auto pass_panels = [&](int64_t i) { return p0 + 2 * (i / passes); };
  const auto pass_np = [&](int64_t i) { return static_cast<int>(std::min<int64_t>(2, p1 - pass_panels(i))); };
  const auto pass_depth = [&](int64_t i) { return i % passes * kPassDepth; };
  // Steps [s0, s1) of pass i split into its planes; special[i % 2]: whether a weight of the pass is
  // not finite.
  bool special[2] = {false, false};
  const auto split_steps = [&](int64_t i, int64_t s0, int64_t s1) NANOVLLM_AMX_FP32 {
    const int64_t d0 = pass_depth(i), d1 = std::min(kp, d0 + kPassDepth);
    const int64_t from = d0 + s0 * kTileDepth, to = std::min(d1, d0 + s1 * kTileDepth);
    if (s0 == 0) special[i % 2] = false;
    if (from >= to) return;
    const int np = pass_np(i);
    special[i % 2] |= split_panels(packed, panels, a.k, pass_panels(i), np, from, to,
                                   planes + i % 2 * plane_values + s0 * kPieces * kTileDepth * np * kGemmPanel);
  };
  // Rows [r0, r0 + m) by panels [q0, q1) on the FMA tiles (rows or panel pairs the pieces cannot hold).
  const auto on_fma = [&](int64_t r0, int64_t m, int64_t q0, int64_t q1) {
    GemmArgs fma = a;
    fma.x = a.x + r0 * a.x_stride;
    fma.y = a.y + r0 * a.y_stride;
    fma.m = m;
    fma.amx = false;
    gemm_panel_range(fma, q0, q1);
  };
  std::vector<int64_t> special_rows;
  // Pass i's fp32 source: its panels' slice at its depths, one run of bytes.
  const auto pass_source = [&](int64_t i) -> std::span<const char> {
    const int64_t d0 = pass_depth(i), k0 = d0 / kGemmSliceDepth * kGemmSliceDepth;
    // d0 < k: a multiple of 32 below kp, k rounded up to 32.
    const int64_t pair_row = pass_np(i) * kGemmPanel, depth = std::min(a.k, d0 + kPassDepth) - d0;
    const float* at = packed + gemm_slice_offset(panels, a.k, pass_panels(i), k0) + (d0 - k0) * pair_row;
    return {reinterpret_cast<const char*>(at), static_cast<size_t>(depth * pair_row) * sizeof(float)};
  };
  _tile_loadconfig(&amx::kConfig);
  for (int64_t r0 = 0; r0 < a.m; r0 += chunk) {
    const int64_t m = std::min(chunk, a.m - r0), blocks = (m + kTileRows - 1) / kTileRows;
    special_rows.clear();
    split_rows(a.x + r0 * a.x_stride, a.x_stride, m, a.k, tiles, special_rows);
    float* const y = a.y + r0 * a.y_stride;
    amx::fence();
    if (pairs * passes > 1) prefetch_share(pass_source(1), 0, 1);
    split_steps(0, 0, kPassDepth / kTileDepth);
    bool pair_special = false;  // whether a weight of this pair's passes so far is not finite
    for (int64_t i = 0; i < pairs * passes; ++i) {
      const int64_t p = pass_panels(i), d0 = pass_depth(i), d1 = std::min(kp, d0 + kPassDepth);
      const int np = pass_np(i);
      const int64_t col0 = p * kGemmPanel, cols = std::min(np * kGemmPanel, a.n - col0);
      const int64_t pass_steps = (d1 - d0) / kTileDepth;
      const bool first = d0 == 0, last = d1 == kp;
      const Bf16* const w = planes + i % 2 * plane_values;
      pair_special = (first ? false : pair_special) || special[i % 2];
      amx::fence();
      for (int64_t b = 0; b < blocks; b += 2) {
        const int count = static_cast<int>(std::min<int64_t>(2, blocks - b));
        const Bf16* const at[2] = {tiles + ((b * steps + d0 / kTileDepth) * kPieces) * kATile,
                                   tiles + (((b + count - 1) * steps + d0 / kTileDepth) * kPieces) * kATile};
        // Where the sums come from and go: the carry between passes; after the last, y itself for a
        // block of 16 rows and whole panels, else the spill, copied out below.
        float* const carried[2] = {carry + b * kSums, carry + (b + 1) * kSums};
        float* const from[2] = {first ? nullptr : carried[0], first ? nullptr : carried[1]};
        float* to[2] = {carried[0], carried[1]};
        int64_t to_stride[2] = {2 * kGemmPanel, 2 * kGemmPanel};
        bool spilled[2] = {false, false};
        if (last) {
          for (int h = 0; h < count; ++h) {
            const int64_t first_row = (b + h) * kTileRows;
            spilled[h] = first_row + kTileRows > m || cols < np * kGemmPanel;
            to[h] = spilled[h] ? spill + h * kSums : y + first_row * a.y_stride + col0;
            to_stride[h] = spilled[h] ? 2 * kGemmPanel : a.y_stride;
          }
        }
        // The first block pair splits the next pass's planes a step at a time between its own steps:
        // the vector units' split runs while the tiles multiply.
        const int64_t next = i + 1 < pairs * passes ? i + 1 : -1;
        const int64_t calls = (blocks + 1) / 2 * pass_steps;
        const auto between = [&](int64_t s) NANOVLLM_AMX_FP32 {
          if (i + 2 < pairs * passes) prefetch_share(pass_source(i + 2), (b / 2 * pass_steps + s), calls);
          if (b > 0 || next < 0) return;
          split_steps(next, s, s + 1 == pass_steps ? kPassDepth / kTileDepth : s + 1);
        };
        if (count == 2 && np == 2) multiply_pass<2, 2>(at, pass_steps, w, from, to, to_stride, between);
        if (count == 2 && np == 1) multiply_pass<2, 1>(at, pass_steps, w, from, to, to_stride, between);
        if (count == 1 && np == 2) multiply_pass<1, 2>(at, pass_steps, w, from, to, to_stride, between);
        if (count == 1 && np == 1) multiply_pass<1, 1>(at, pass_steps, w, from, to, to_stride, between);
        if (!last) continue;
        amx::fence();
        for (int h = 0; h < count; ++h) {
          if (!spilled[h]) continue;
          const int64_t first_row = (b + h) * kTileRows, rows = std::min(kTileRows, m - first_row);
          for (int64_t r = 0; r < rows; ++r) {
            std::copy_n(spill + h * kSums + r * 2 * kGemmPanel, cols, y + (first_row + r) * a.y_stride + col0);
          }
        }
        amx::fence();  // the copy has read the spill before the next block pair's sums land in it
      }
      if (!last) continue;
      amx::fence();
      if (pair_special) {
        on_fma(r0, m, p, p + np);
        continue;
      }
      if (a.bias != nullptr) amx::finish_pair(y + col0, a.y_stride, a.bias + col0, nullptr, a.n, m, cols);
    }
    amx::fence();
    for (const int64_t r : special_rows) on_fma(r0 + r, 1, p0, p1);
  }
  _tile_release();
}

#pragma GCC diagnostic pop
#else
void gemm_fp32_amx_panel_range(const GemmArgs&, int64_t, int64_t) {}
#endif

}  // namespace nanovllm
