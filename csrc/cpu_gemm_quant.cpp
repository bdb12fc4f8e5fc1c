#include "cpu_gemm_quant.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_amx.h"
#include "cpu_bf16_avx512.h"
#include "cpu_dtype.h"
#include "cpu_gemm.h"
#include "cpu_isa.h"
#include "cpu_parallel.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace nanovllm {
namespace {

// Slice depth and row block as the fp32 GEMM (csrc/cpu_gemm.cpp): a dequantized slice, 256 x 16
// floats, is 16 KB of L1.
constexpr int64_t kQuantKc = 256;
constexpr int64_t kQuantMc = 144;
// The most rows any instruction set's in-register path takes (each says its own, kDirectRows).
constexpr int64_t kMaxDirectRows = 12;
// The most rows the bf16 int4 path reorders for two steps a decode (RowPrep::quads): a decode batch.
constexpr int64_t kQuadMaxRows = 64;
// From this many rows bf16 activations go to AMX tiles where the process has them (amx_path). The
// Qwen3-shaped MLP's 6144 x 1024 int4 / int8 weights from memory (Intel Xeon with AMX, 2 threads):
// 1.1x / 1.6x the vdpbf16ps path's speed at 2 rows, 1.7x / 1.3x at 4, 3x at 8, 4x at 32; 0.86x at one.
// (int4 at up to kVnniMaxRows rows goes to AVX512-VNNI instead, where the CPU has it.)
// int8 takes the int8 tiles from one row where they take its shape (amx_int_path): the Qwen3-shaped
// layers at one row 1.04-1.09x faster from memory than the fp32 path, the decode step of one
// sequence 1.01-1.07x the tokens/s, and a row's bits the same at 1 to kAmxIntMaxRows rows.
constexpr int64_t kAmxMinRows = 2;
// Up to this many rows, int8 weights against bf16 rows go to the AMX int8 tiles (amx_int_path). A
// 6144 x 1024 int8 weight (2 threads, Intel Xeon with AMX, L3-warm) against the bf16 tiles: 32 rows
// 230 against 320 us, 64 rows 394 against 459, 128 rows 784 against 734, 512 rows 3.55 against 3.03 ms
// (past ~100 rows each slice's rows no longer stay in L1, and the totals of every pair grow with them).
constexpr int64_t kAmxIntMaxRows = 64;
// From kAmxInt4MinRows to kAmxInt4MaxRows rows int4 goes to the int8 tiles too (its nibbles widened to
// bytes: three operations per 64 weights, where bf16 pairs take twice the bytes and more). The
// Qwen3-shaped layers' int4 GEMMs from memory against the bf16 tiles (2 threads, Intel Xeon with AMX,
// in turns): 5 rows 1.29-1.57x faster, 8 rows 1.17-1.54x, 12 rows 1.09-1.39x, 16 rows 1.08-1.29x,
// 20 rows 1.11x, 24 rows 0.96-1.04x, 32 rows 0.90-0.93x: the scaling of a group of 128 takes two sums
// a value, which more rows make the larger part. Against AVX512-VNNI (int16_vnni_path, whose
// vpdpwssd per row bound it from 3 rows), from memory / one layer cache-warm: 1 row 0.92x / 0.98x,
// 2 rows 0.89x / 0.97x, 3 rows 1.02x / 1.13x, 4 rows 1.25x / 1.56x.
constexpr int64_t kAmxInt4MinRows = 3, kAmxInt4MaxRows = 20;
// Up to this many bf16 rows go to AVX512-VNNI as 16-bit integers against int4 (int16_vnni_path), not
// to AMX tiles: the nibbles decoded once for every row's vpdpwssd, where the tiles decode them to bf16
// pairs for 16 rows and use a few. The Qwen3-shaped layers' int4 GEMMs from memory (2 threads, Intel
// Xeon with AMX, old and new in turns): 2 rows 1.32-1.44x faster, 3 rows 1.16-1.29x, 4 rows 1.0-1.16x;
// the engine's int4 decode of 2 sequences 1.25x the tokens/s, of 4 1.04x; a MoE decode's int4 experts
// (~4 rows each at 32 tokens) 1.08x.
constexpr int kVnniMaxRows = 4;
// How far ahead, in panels, a one-row pass asks for its weights. At one row a core read int4 weights
// from memory at 8-13 GB/s, half its rate on cached ones: the hardware prefetcher alone kept too few
// lines in flight. The AVX-512 bf16 path asks for a panel's lines at its start (24 int4 weights of the
// Qwen3-shaped layers, 41 MB in turn, 1.00-1.25x faster, Zen 5; 8 ahead no better). The AVX2
// fp32 in-register path (one row), the int16 paths and the AVX-512 bf16 path's one int4 row ask a
// line per line they read, inside their loops, going on past the thread's last panel into its first
// of the next slice (panel_ahead): from memory on Zen 3 (2 threads) the int16 int4 path read the
// Qwen3-shaped layers 1.14x faster than when asking at a panel's start, the fp32 path's int8 1.23x
// faster than with none (asking at a panel's start: 0.81-0.89x); 2 or 8 ahead the same. The bf16
// path's one int4 row on the Intel Xeon with AMX: a 6144 x 1024 weight from memory 1.24x faster than
// asked for at each panel's start (240 -> 192 us; 2, 8 or 16 ahead no better); int8 no faster.
constexpr int64_t kPrefetchPanels = 4;

// Every cache line of [begin, end) asked for into L2 (the AVX-512 bf16 path, a panel at a time).
inline void prefetch_l2(const uint8_t* begin, const uint8_t* end) {
  for (const uint8_t* line = begin; line < end; line += 64) __builtin_prefetch(line, 0, 2);
}

// int4 rows come in pairs: K is padded to even in the packed weight.
int64_t padded_depth(int64_t k, int bits) { return bits == 4 ? (k + 1) / 2 * 2 : k; }

// Where panel p's slice at depth k0 begins, in bytes (k0 and every slice depth even for int4).
int64_t slice_bytes(int64_t panels, int64_t kp, int64_t p, int64_t k0, int bits) {
  return (k0 * panels + p * std::min(kQuantKc, kp - k0)) * kGemmPanel * bits / 8;
}

// Where a one-row pass over panels [p0, p1) of each slice in turn asks ahead while at panel p of the
// slice at k0: kPrefetchPanels panels on in that order (past p1 into the next slice's), or p itself
// at the weight's end.
const uint8_t* panel_ahead(const QuantGemmArgs& a, int64_t k0, int64_t p, int64_t p0, int64_t p1) {
  const int64_t panels = gemm_panels(a.n), kp = padded_depth(a.k, a.bits), on = p + kPrefetchPanels;
  if (on < p1) return a.packed + slice_bytes(panels, kp, on, k0, a.bits);
  if (k0 + kQuantKc < a.k) return a.packed + slice_bytes(panels, kp, p0 + std::min(on - p1, p1 - p0 - 1), k0 + kQuantKc, a.bits);
  return a.packed + slice_bytes(panels, kp, p, k0, a.bits);
}

// The input-column ranges that lie in one group and one slice, in order; first[s] is slice s's first.
struct Segments {
  std::vector<int64_t> start;  // count() + 1 entries, the last = k
  std::vector<int64_t> first;  // slices + 1 entries
  std::vector<int64_t> group;  // count() entries: the group each lies in
  int64_t count() const { return static_cast<int64_t>(start.size()) - 1; }

  Segments(int64_t k, int64_t group_size) {
    for (int64_t k0 = 0; k0 < k; k0 += kQuantKc) {
      first.push_back(static_cast<int64_t>(start.size()));
      const int64_t end = std::min(k, k0 + kQuantKc);
      for (int64_t s = k0; s < end; s = std::min(end, (s / group_size + 1) * group_size)) {
        start.push_back(s);
        group.push_back(s / group_size);
      }
    }
    first.push_back(static_cast<int64_t>(start.size()));
    start.push_back(k);
  }
};

// The one-row path on bf16 activations without AVX512-BF16 (int16_path): a power-of-two scale per
// block of input columns, the largest of these sizes that divides both k and the group size. The
// kernels turn a block's integer sums into fp32 once, and at one row they run close to their bound
// in operations as much as in bytes: blocks of 128 (one per group of 128) instead of 32 read the
// Qwen3-shaped decode's int4 weights 1.07-1.08x faster from memory (2 threads, Zen 3). The cost: a
// value's rounding is relative to the largest of 128, not 32, around it.
constexpr int64_t kInt16Blocks[] = {128, 64, 32};
constexpr int64_t kInt16MaxBlock = kInt16Blocks[0];

int64_t int16_block_size(int64_t k, int64_t group_size) {
  for (const int64_t b : kInt16Blocks) {
    if (k % b == 0 && group_size % b == 0) return b;
  }
  return 0;
}

// One block of n bf16 values as 16-bit integers times a power of two, returned (NaN where the block
// holds a NaN or infinity: every output NaN, as in fp32; 0 for a block of zeros, whose integers any
// scale leaves 0, so that the row's largest scale is a value's, RowPrep), and their sum.
float int16_block(const Bf16* x, int64_t n, int16_t* q, int32_t& sum) {
  float most = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::fabs(widen(x[i]));
    finite = finite && v <= std::numeric_limits<float>::max();
    most = std::max(most, v);
  }
  int e = 0;
  std::frexp(most, &e);  // most < 2^e: x * 2^(15 - e) fits 16 bits
  // x times a power of two is exact (ldexp, not a product with 2^(15 - e): for blocks below 2^-113
  // that factor is no float); rounded half away from zero, |q| < 2^15 + 1/2.
  sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = finite ? std::ldexp(widen(x[i]), 15 - e) : 0.0f;
    q[i] = static_cast<int16_t>(std::clamp(static_cast<int32_t>(v + (v < 0.0f ? -0.5f : 0.5f)), -32767, 32767));
    sum += q[i];
  }
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  return most > 0.0f ? std::ldexp(1.0f, e - 15) : 0.0f;
}

// Eight of a row's 16-bit integers in the order the int4 int16 path's lanes take (RowPrep::xq).
void int16_pairs(const int16_t* q, int32_t* out) {
  const auto pair = [](int16_t lo, int16_t hi) {
    return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(lo)) |
                                static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16);
  };
  for (int lane = 0; lane < 4; ++lane) {
    out[lane] = pair(q[0], q[4]);
    out[lane + 4] = pair(q[2], q[6]);
    out[lane + 8] = pair(q[1], q[5]);
    out[lane + 12] = pair(q[3], q[7]);
  }
}

// What every panel's pass reads of the rows, made once per call.
struct RowPrep {
  // Each row's sum of x over each segment, for the zero points of the in-register paths (the fp32
  // one takes at most kMaxDirectRows rows; the buffered path reads none).
  std::vector<float> xsum;
  // For the fp32 int4 in-register path, the rows (padded_depth apart) with each odd column less 16
  // times the even one before it: the weights it reads per pair of depths are a byte and its high
  // nibble (dot_segment).
  std::vector<float> pairs;
  // On the bf16 int4 path, the bf16 rows with each quad of columns reordered x0 x2 x1 x3, the pairs
  // QuadDecoder's lanes take (rows x_stride apart); empty where quads would straddle a segment.
  std::vector<uint16_t> quads;
  // On the int16 path, the bf16 row as 16-bit integers times a power of two per xq_block columns
  // (xq_scale, int16_block_size): exact for every value within 2^7 of its block's largest, the rest
  // within 2^-16 of it (a bf16 output rounds at 2^-9). For int4, per 8 columns two registers' worth
  // of 16-bit pairs, the pairs the kernel's lanes take: (x0, x4) four times then (x2, x6) four
  // times, and (x1, x5), (x3, x7) the same; for int8 the integers in order. xsum then sums these values.
  // Every row's (int16_vnni_path takes a few): row r's integers from xq + r * xq_stride, its scales
  // from xq_scale + r * (k / xq_block), its segments' sums from xsum + r * segments.
  std::unique_ptr<int32_t[]> xq;
  int64_t xq_block = 0;  // 0: not the int16 path
  int64_t xq_stride = 0;
  // Each row's xq_scale values are relative to its own largest (here), which the kernels apply last.
  std::vector<float> xq_row_scale;
  std::vector<float> xq_scale;

  // amx: the AMX path takes these rows, which sums them itself (panels_amx): none of this is made.
  RowPrep(const QuantGemmArgs& a, const Segments& segs, bool int16, bool amx);
};

}  // namespace

// --- the kernel body, once per instruction set ---------------------------------------------------

namespace quant_portable {
namespace {
// Plain C++ on 16 single floats: what any compiler vectorizes for the baseline instruction set.
struct Isa {
  using V = float;
  static constexpr int kVecs = 16;
  static constexpr int kDirectRows = 4;
  static constexpr int direct_tile_rows(int) { return 4; }
  static constexpr int kTileRows = 4;
  static V zero() { return 0.0f; }
  static V bcast(const float* p) { return *p; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V fnma(V a, V b, V c) { return c - a * b; }
  static void int8(const int8_t* p, V* out) {
    for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(p[i]);
  }
  static void int4(const uint8_t* p, V* lo, V* hi) {
    for (int i = 0; i < 16; ++i) {
      lo[i] = static_cast<float>(p[i] & 15);
      hi[i] = static_cast<float>(p[i] >> 4);
    }
  }
  static void int4_bytes(const uint8_t* p, V* whole, V* high) {
    for (int i = 0; i < 16; ++i) {
      whole[i] = static_cast<float>(p[i]);
      high[i] = static_cast<float>(p[i] >> 4);
    }
  }
};
#include "cpu_gemm_quant_tiles.h"
}  // namespace
}  // namespace quant_portable

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace quant_avx2 {
namespace {
// Two ymm registers per 16-column row: tiles of 6 rows keep 12 of the 16 as accumulators. Up to 12
// rows decode each slice once per tile (two tiles of 4 ran 1.17x faster than the dequantized
// buffer at 8 rows, int8 1.27x; three of 4 1.05x at 12 rows, int8's two of 6 1.25x).
struct Isa {
  using V = __m256;
  static constexpr int kVecs = 2;
  static constexpr int kDirectRows = 12;
  // int4's decode needs two more registers than int8's: 6 rows of int4 spilled (two tiles of 3 ran
  // 1.05x faster), 6 of int8 did not (3 + 3 ran 0.8x).
  static constexpr int direct_tile_rows(int bits) { return bits == 4 ? 5 : 6; }
  static constexpr int kTileRows = 6;
  static V zero() { return _mm256_setzero_ps(); }
  static V bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static void int8(const int8_t* p, V* out) {
    for (int v = 0; v < 2; ++v) {
      out[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v))));
    }
  }
  static void int4(const uint8_t* p, V* lo, V* hi) {
    for (int v = 0; v < 2; ++v) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v)));
      lo[v] = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
      hi[v] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    }
  }
  static void int4_bytes(const uint8_t* p, V* whole, V* high) {
    for (int v = 0; v < 2; ++v) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v)));
      whole[v] = _mm256_cvtepi32_ps(b);
      high[v] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    }
  }
};
#include "cpu_gemm_quant_tiles.h"

// RowPrep::xq of a bf16 row (k a multiple of block, itself a multiple of 32): int16_block's
// integers, scales and sums, in int16_pairs' order for int4 (bits 4), in order for int8. Blocks whose
// largest value is normal and not tiny take this vector form of its rule (the scale read off the
// largest value's exponent bits); the rest take int16_block itself.
void int16_row(const Bf16* x, int64_t k, int64_t block, int bits, int32_t* xq, float* scale, int32_t* sums) {
  const __m256i magnitude = _mm256_set1_epi16(0x7fff);
  const __m256i spread_a = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2), spread_b = _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3);
  const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f);
  const __m256i top = _mm256_set1_epi32(32767), bottom = _mm256_set1_epi32(-32767);
  // Where the integers of column d go: 2 int32 (a pair each) per column for int4, half one for int8.
  const auto out_at = [xq, bits](int64_t d) { return bits == 4 ? xq + d * 2 : xq + d / 2; };
  for (int64_t b = 0; b < k / block; ++b) {
    const Bf16* xb = x + b * block;
    // The largest magnitude's bits: bf16 magnitudes order as integers.
    __m256i m16 = _mm256_setzero_si256();
    for (int64_t i = 0; i < block; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + i));
      m16 = _mm256_max_epi16(m16, _mm256_and_si256(h, magnitude));
    }
    __m128i m = _mm_max_epi16(_mm256_castsi256_si128(m16), _mm256_extracti128_si256(m16, 1));
    m = _mm_max_epi16(m, _mm_srli_si128(m, 8));
    m = _mm_max_epi16(m, _mm_srli_si128(m, 4));
    m = _mm_max_epi16(m, _mm_srli_si128(m, 2));
    const int exponent = _mm_extract_epi16(m, 0) >> 7;  // biased; the largest value < 2^(exponent - 126)
    if (exponent < 15 || exponent > 254) {  // zero, tiny, infinite or NaN
      int16_t q[kInt16MaxBlock];
      scale[b] = int16_block(xb, block, q, sums[b]);
      if (bits == 4) {
        for (int64_t d = 0; d < block; d += 8) int16_pairs(q + d, out_at(b * block + d));
      } else {
        std::memcpy(out_at(b * block), q, block * sizeof(int16_t));
      }
      continue;
    }
    scale[b] = std::bit_cast<float>(static_cast<uint32_t>(exponent - 14) << 23);  // 2^(e - 15), e as frexp's
    const __m256 up = _mm256_castsi256_ps(_mm256_set1_epi32((268 - exponent) << 23));  // 2^(15 - e)
    __m256i sum = _mm256_setzero_si256();
    for (int64_t d = 0; d < block; d += 8) {
      const __m128i bf = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xb + d));
      const __m256 y = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf), 16)), up);
      __m256i q = _mm256_cvttps_epi32(_mm256_add_ps(y, _mm256_or_ps(_mm256_and_ps(y, sign), half)));
      q = _mm256_max_epi32(_mm256_min_epi32(q, top), bottom);
      sum = _mm256_add_epi32(sum, q);
      const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      int32_t* out = out_at(b * block + d);
      if (bits != 4) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), q16);
        continue;
      }
      const __m256i pairs = _mm256_castsi128_si256(_mm_unpacklo_epi16(q16, _mm_srli_si128(q16, 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(pairs, spread_a));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8), _mm256_permutevar8x32_epi32(pairs, spread_b));
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_srli_si128(s4, 8));
    s4 = _mm_add_epi32(s4, _mm_srli_si128(s4, 4));
    sums[b] = _mm_cvtsi128_si32(s4);
  }
}

// Columns (0, 2, 4, 6) and (1, 3, 5, 7), summed over both halves, as columns 0-7 in order.
inline __m256 in_order(__m256 even, __m256 odd) {
  const __m128 e = _mm_add_ps(_mm256_castps256_ps128(even), _mm256_extractf128_ps(even, 1));
  const __m128 o = _mm_add_ps(_mm256_castps256_ps128(odd), _mm256_extractf128_ps(odd, 1));
  return _mm256_set_m128(_mm_unpackhi_ps(e, o), _mm_unpacklo_ps(e, o));
}

// A panel's group scales for a segment of the one-row int16 paths, in column order, and what its
// zero points (zero_offset added) take off its sums: scale x zero point x the segment's activation
// sum x `share` (int4's kernel sums each column over two halves of lanes at the slice's end: half
// from each). The kernels take it off once the segment's blocks are in: the sums of unsigned int4
// weights are several times their value after it, and a slice's sums with each segment's terms left
// on read 1e-6 of |x| |w| off where per segment they read 1e-7.
struct GroupTerms {
  __m256 scale[2];
  __m256 zero_term[2];
  GroupTerms(const QuantGemmArgs& a, int64_t p, int64_t group, float xsum, float share) {
    const int64_t at = (group * gemm_panels(a.n) + p) * kGemmPanel;
    const __m256 offset = _mm256_set1_ps(a.zero_offset), shared_sum = _mm256_set1_ps(share * xsum);
    for (int v = 0; v < 2; ++v) {
      scale[v] = _mm256_loadu_ps(a.scales + at + 8 * v);
      __m256 z = offset;
      if (a.zeros != nullptr) {
        const __m128i z8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a.zeros + at + 8 * v));
        z = _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(z8)), offset);
      }
      zero_term[v] = _mm256_mul_ps(_mm256_mul_ps(scale[v], z), shared_sum);
    }
  }
};

// The end of a panel's slice on the int16 paths: row r's 16 sums (columns 0-7, 8-15) times the
// row's scale (RowPrep::xq_row_scale), plus the bias on the first slice, into its row of y (added to
// what earlier slices left).
inline void finish_slice(const QuantGemmArgs& a, const RowPrep& rows, int64_t p, int64_t k0, const __m256* sums,
                         int64_t r = 0) {
  const int64_t col0 = p * kGemmPanel;
  const int cols = static_cast<int>(std::min(kGemmPanel, a.n - col0));
  const __m256 row_scale = _mm256_set1_ps(rows.xq_row_scale[r]);
  V out[kVecs] = {_mm256_mul_ps(sums[0], row_scale), _mm256_mul_ps(sums[1], row_scale)};
  if (k0 == 0 && a.bias != nullptr) {
    V bias[kVecs];
    load_bias(a, col0, cols, true, bias);
    for (int v = 0; v < kVecs; ++v) out[v] = _mm256_add_ps(out[v], bias[v]);
  }
  put(a.y + r * a.y_stride + col0, out, cols, k0 > 0);
}

// The int16 path (int16_path): one row of bf16 activations as RowPrep::xq against int4 panels. Eight
// depths of a panel are four of its 16-byte rows, two registers A (rows j, j + 1) and B (j + 2, j + 3);
// interleaving their 16-bit words puts two bytes of one column pair in each 32-bit lane, rows j and
// j + 2 in the low half, j + 1 and j + 3 in the high half. Masks and shifts leave each nibble of those
// bytes as a 16-bit integer in place (the even column's high nibble kept 16 times over, its sums
// scaled back at the block's end), and vpmaddwd multiplies each pair with the activations' and adds
// them: 14 operations per 64 weights and no byte shuffles (with a byte shuffle per 32 weights, 17
// operations: 1.3x the weights a core, one row in L2, Zen 3). Sums of a block of Block depths stay
// exact in int32 (at most 2 x 16 x 15 x 32767 x Block / 8 < 2^31 for Block 128) and go to fp32 at the
// block's end, times the activations' scale and the group's scales (in the lanes' column order), into
// one set of sums per panel slice, each segment's zero points taken off at its end; the two halves'
// depths and the column pairs are put back in order at the slice's end.
template <int64_t Block>
void panels_int16(const QuantGemmArgs& a, const Segments& segs, const RowPrep& rows, int64_t p0, int64_t p1) {
  static_assert(Block % 32 == 0 && Block <= 128, "the int32 sums of a block must not overflow");
  const int64_t panels = gemm_panels(a.n);
  const __m256i low = _mm256_set1_epi16(0x000f), high = _mm256_set1_epi16(0x00f0);
  const __m256i even_lanes = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  const __m256i odd_lanes = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
  // Lanes holding the column pair (c, c + 1) at depths d and d + 4 (d + 2 and d + 6 in the high half):
  // the even column's nibbles times xa (low) and xb (high, times 16), the odd one's the same.
  const auto dot8 = [&](__m256i t, __m256i& even, __m256i& even16, __m256i& odd, __m256i xa, __m256i xb) {
    even = _mm256_add_epi32(even, _mm256_madd_epi16(_mm256_and_si256(t, low), xa));
    even16 = _mm256_add_epi32(even16, _mm256_madd_epi16(_mm256_and_si256(t, high), xb));
    odd = _mm256_add_epi32(odd, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(t, 8), low), xa));
    odd = _mm256_add_epi32(odd, _mm256_madd_epi16(_mm256_srli_epi16(t, 12), xb));
    // Left to itself GCC reassociates the unrolled sums, holding every product first, and spills.
    asm("" : "+x"(even), "+x"(even16), "+x"(odd));
  };
  for (int64_t k0 = 0, slice = 0; k0 < a.k; k0 += kQuantKc, ++slice) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* w = a.packed + slice_bytes(panels, a.k, p, k0, 4);
      const uint8_t* ahead = panel_ahead(a, k0, p, p0, p1);
      // Columns (0, 2, 4, 6 | the same) and (1, 3, 5, 7 | ...) of 0-7, then of 8-15.
      __m256 sums[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t sg = segs.first[slice]; sg < segs.first[slice + 1]; ++sg) {
        const GroupTerms g(a, p, segs.group[sg], rows.xsum[sg], 0.5f);
        // sums[i]'s lanes: the even (i even) or odd columns of g.scale[i / 2]'s eight.
        const auto lanes = [&](__m256 v, int i) { return _mm256_permutevar8x32_ps(v, i % 2 ? odd_lanes : even_lanes); };
        const __m256 scales[4] = {lanes(g.scale[0], 0), lanes(g.scale[0], 1), lanes(g.scale[1], 2), lanes(g.scale[1], 3)};
        for (int64_t b0 = segs.start[sg]; b0 < segs.start[sg + 1]; b0 += Block) {
          const uint8_t* wb = w + (b0 - k0) * (kGemmPanel / 2);
          const uint8_t* pb = ahead + (b0 - k0) * (kGemmPanel / 2);
          const __m256i* xb = reinterpret_cast<const __m256i*>(rows.xq.get()) + b0 / 4;
          __m256i even0 = _mm256_setzero_si256(), even16_0 = even0, odd0 = even0;
          __m256i even1 = even0, even16_1 = even0, odd1 = even0;
          for (int64_t st0 = 0; st0 < Block / 8; st0 += 4) {
#pragma GCC unroll 4
            for (int64_t st = st0; st < st0 + 4; ++st) {
              __builtin_prefetch(pb + 4 * kGemmPanel * st, 0, 2);
              const __m256i rows_a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 4 * kGemmPanel * st));
              const __m256i rows_b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 4 * kGemmPanel * st + 32));
              const __m256i xa = _mm256_loadu_si256(xb + 2 * st), xh = _mm256_loadu_si256(xb + 2 * st + 1);
              dot8(_mm256_unpacklo_epi16(rows_a, rows_b), even0, even16_0, odd0, xa, xh);
              dot8(_mm256_unpackhi_epi16(rows_a, rows_b), even1, even16_1, odd1, xa, xh);
            }
          }
          // The activations' scale first: its product with a group's scale may leave fp32's range where
          // the block's sums times it do not.
          const __m256 xs = _mm256_set1_ps(rows.xq_scale[b0 / Block]);
          const __m256i ints[4] = {_mm256_add_epi32(even0, _mm256_srai_epi32(even16_0, 4)), odd0,
                                   _mm256_add_epi32(even1, _mm256_srai_epi32(even16_1, 4)), odd1};
          for (int i = 0; i < 4; ++i) {
            sums[i] = _mm256_fmadd_ps(scales[i], _mm256_mul_ps(xs, _mm256_cvtepi32_ps(ints[i])), sums[i]);
          }
        }
        for (int i = 0; i < 4; ++i) sums[i] = _mm256_sub_ps(sums[i], lanes(g.zero_term[i / 2], i));
      }
      const __m256 ordered[2] = {in_order(sums[0], sums[1]), in_order(sums[2], sums[3])};
      finish_slice(a, rows, p, k0, ordered);
    }
  }
}

// A panel row of int8 weights as 16 16-bit integers.
inline __m256i widened(const uint8_t* row) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
}

// The int16 path for int8 panels: two rows (depths d, d + 1) widened to 16-bit integers and their
// words interleaved put a column's two weights in a 32-bit lane (columns 0-3 and 8-11 in one
// register, 4-7 and 12-15 in the other), multiplied with the pair (x_d, x_d+1) by vpmaddwd: 8
// operations per 32 weights against the fp32 decode's 12, for when the weights arrive faster than
// the fp32 decode takes them. Blocks, group scales and zero points as panels_int16 (a block's sums at
// most 2 x 128 x 32767 x Block / 2 < 2^31 for Block 128).
template <int64_t Block>
void panels_int16_int8(const QuantGemmArgs& a, const Segments& segs, const RowPrep& rows, int64_t p0, int64_t p1) {
  static_assert(Block % 32 == 0 && Block <= 128, "the int32 sums of a block must not overflow");
  const int64_t panels = gemm_panels(a.n);
  for (int64_t k0 = 0, slice = 0; k0 < a.k; k0 += kQuantKc, ++slice) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* w = a.packed + slice_bytes(panels, a.k, p, k0, 8);
      const uint8_t* ahead = panel_ahead(a, k0, p, p0, p1);
      __m256 f_lo = _mm256_setzero_ps(), f_hi = _mm256_setzero_ps();  // columns 0-3 | 8-11, 4-7 | 12-15
      for (int64_t sg = segs.first[slice]; sg < segs.first[slice + 1]; ++sg) {
        const GroupTerms g(a, p, segs.group[sg], rows.xsum[sg], 1.0f);
        const __m256 scale_lo = _mm256_permute2f128_ps(g.scale[0], g.scale[1], 0x20);
        const __m256 scale_hi = _mm256_permute2f128_ps(g.scale[0], g.scale[1], 0x31);
        for (int64_t b0 = segs.start[sg]; b0 < segs.start[sg + 1]; b0 += Block) {
          const uint8_t* wb = w + (b0 - k0) * kGemmPanel;
          const uint8_t* pb = ahead + (b0 - k0) * kGemmPanel;
          const int32_t* xb = rows.xq.get() + b0 / 2;
          __m256i lo0 = _mm256_setzero_si256(), hi0 = lo0, lo1 = lo0, hi1 = lo0;
          for (int64_t st0 = 0; st0 < Block / 4; st0 += 8) {
#pragma GCC unroll 8
            for (int64_t st = st0; st < st0 + 8; ++st) {
              __builtin_prefetch(pb + 4 * kGemmPanel * st, 0, 2);
              const uint8_t* r = wb + 4 * kGemmPanel * st;
              const __m256i w0 = widened(r), w1 = widened(r + kGemmPanel);
              const __m256i w2 = widened(r + 2 * kGemmPanel), w3 = widened(r + 3 * kGemmPanel);
              const __m256i x01 = _mm256_set1_epi32(xb[2 * st]), x23 = _mm256_set1_epi32(xb[2 * st + 1]);
              lo0 = _mm256_add_epi32(lo0, _mm256_madd_epi16(_mm256_unpacklo_epi16(w0, w1), x01));
              hi0 = _mm256_add_epi32(hi0, _mm256_madd_epi16(_mm256_unpackhi_epi16(w0, w1), x01));
              lo1 = _mm256_add_epi32(lo1, _mm256_madd_epi16(_mm256_unpacklo_epi16(w2, w3), x23));
              hi1 = _mm256_add_epi32(hi1, _mm256_madd_epi16(_mm256_unpackhi_epi16(w2, w3), x23));
              // As in panels_int16: keep GCC from reassociating the sums into a tree that spills.
              asm("" : "+x"(lo0), "+x"(hi0), "+x"(lo1), "+x"(hi1));
            }
          }
          const __m256 xs = _mm256_set1_ps(rows.xq_scale[b0 / Block]);  // first, as in panels_int16
          f_lo = _mm256_fmadd_ps(scale_lo, _mm256_mul_ps(xs, _mm256_cvtepi32_ps(_mm256_add_epi32(lo0, lo1))), f_lo);
          f_hi = _mm256_fmadd_ps(scale_hi, _mm256_mul_ps(xs, _mm256_cvtepi32_ps(_mm256_add_epi32(hi0, hi1))), f_hi);
        }
        f_lo = _mm256_sub_ps(f_lo, _mm256_permute2f128_ps(g.zero_term[0], g.zero_term[1], 0x20));
        f_hi = _mm256_sub_ps(f_hi, _mm256_permute2f128_ps(g.zero_term[0], g.zero_term[1], 0x31));
      }
      const __m256 ordered[2] = {_mm256_permute2f128_ps(f_lo, f_hi, 0x20), _mm256_permute2f128_ps(f_lo, f_hi, 0x31)};
      finish_slice(a, rows, p, k0, ordered);
    }
  }
}

// The int16 path's int4 kernel on AVX512-VNNI CPUs (int16_vnni_path): panels_int16's lanes, the two
// 256-bit halves of its step (the words of rows A and B interleaved low, and high) side by side in one
// 512-bit register (one vpermw of the 64 bytes A | B), each half against the same activations
// broadcast, and vpdpwssd multiplying and adding in one instruction. The vdpbf16ps path it replaces
// for one row was bound by its dot products (one every two cycles on Sapphire Rapids against two
// vpdpwssd a cycle): the Qwen3-shaped layers' int4 weights at one row 1.13-1.29x faster, 24-29 GB/s
// against 21-24 (2 threads, Intel Xeon with AMX). The sums of a block and its scaling are
// panels_int16's, in the same lanes, so the results are its bits.
#define NANOVLLM_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")))

// vpermw's word index taking z = A | B to unpacklo_epi16(A, B) | unpackhi_epi16(A, B).
constexpr std::array<int16_t, 32> kVnniOrder = [] {
  std::array<int16_t, 32> order{};
  for (int half = 0; half < 2; ++half) {
    for (int lane = 0; lane < 2; ++lane) {
      for (int k = 0; k < 8; ++k) {
        order[16 * half + 8 * lane + k] = static_cast<int16_t>((k % 2 ? 16 : 0) + 8 * lane + 4 * half + k / 2);
      }
    }
  }
  return order;
}();

NANOVLLM_VNNI512 inline __m512 halves(__m256 lo, __m256 hi) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// GCC 12's AVX-512 broadcasts and conversions start from _mm*_undefined_*(), which
// -Wmaybe-uninitialized reports once inlined (a known false positive), as in cpu_attention_bf16.h.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <int64_t Block, int R>
NANOVLLM_VNNI512 void panels_int16_vnni(const QuantGemmArgs& a, const Segments& segs, const RowPrep& rows, int64_t p0,
                                        int64_t p1) {
  static_assert(Block % 32 == 0 && Block <= 128, "the int32 sums of a block must not overflow");
  static_assert(R >= 1 && R <= kVnniMaxRows);
  const int64_t panels = gemm_panels(a.n), blocks = a.k / Block;
  const __m512i low = _mm512_set1_epi16(0x000f), high = _mm512_set1_epi16(0x00f0);
  const __m256i even_lanes = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  const __m256i odd_lanes = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
  const __m512i order = _mm512_loadu_si512(kVnniOrder.data());
  // A group's terms in the lanes of the even (odd) columns: cols 0-7 low, 8-15 high (panels_int16's sums[0, 2] / [1, 3]).
  const auto lanes = [&](const __m256 (&v)[2], bool odd) {
    return halves(_mm256_permutevar8x32_ps(v[0], odd ? odd_lanes : even_lanes),
                  _mm256_permutevar8x32_ps(v[1], odd ? odd_lanes : even_lanes));
  };
  for (int64_t k0 = 0, slice = 0; k0 < a.k; k0 += kQuantKc, ++slice) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* w = a.packed + slice_bytes(panels, a.k, p, k0, 4);
      const uint8_t* ahead = panel_ahead(a, k0, p, p0, p1);
      __m512 sums_even[R], sums_odd[R];
      for (int r = 0; r < R; ++r) sums_even[r] = sums_odd[r] = _mm512_setzero_ps();
      for (int64_t sg = segs.first[slice]; sg < segs.first[slice + 1]; ++sg) {
        const GroupTerms g(a, p, segs.group[sg], rows.xsum[sg], 0.5f);
        const __m512 scale_even = lanes(g.scale, false), scale_odd = lanes(g.scale, true);
        for (int64_t b0 = segs.start[sg]; b0 < segs.start[sg + 1]; b0 += Block) {
          const uint8_t* wb = w + (b0 - k0) * (kGemmPanel / 2);
          const uint8_t* pb = ahead + (b0 - k0) * (kGemmPanel / 2);
          const __m256i* xb[R];
          for (int r = 0; r < R; ++r) xb[r] = reinterpret_cast<const __m256i*>(rows.xq.get() + r * rows.xq_stride) + b0 / 4;
          // The weights decoded once for every row. Each row's sums are independent chains; one
          // row's come in two sets, alternate steps (a set's vpdpwssd waits on its last, 5 cycles).
          constexpr int kSets = R == 1 ? 2 : 1;
          __m512i even[kSets][R], even16[kSets][R], odd[kSets][R], odd16[kSets][R];
          for (int u = 0; u < kSets; ++u) {
            for (int r = 0; r < R; ++r) even[u][r] = even16[u][r] = odd[u][r] = odd16[u][r] = _mm512_setzero_si512();
          }
#pragma GCC unroll 2
          for (int64_t st = 0; st < Block / 8; ++st) {
            __builtin_prefetch(pb + 4 * kGemmPanel * st, 0, 2);
            const __m512i t = _mm512_permutexvar_epi16(order, _mm512_loadu_si512(wb + 4 * kGemmPanel * st));
            const __m512i t_even = _mm512_and_si512(t, low), t_even16 = _mm512_and_si512(t, high);
            const __m512i t_odd = _mm512_and_si512(_mm512_srli_epi16(t, 8), low), t_odd16 = _mm512_srli_epi16(t, 12);
            const int u = static_cast<int>(st % kSets);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              const __m512i xa = _mm512_broadcast_i64x4(_mm256_loadu_si256(xb[r] + 2 * st));
              const __m512i xh = _mm512_broadcast_i64x4(_mm256_loadu_si256(xb[r] + 2 * st + 1));
              even[u][r] = _mm512_dpwssd_epi32(even[u][r], t_even, xa);
              even16[u][r] = _mm512_dpwssd_epi32(even16[u][r], t_even16, xh);
              odd[u][r] = _mm512_dpwssd_epi32(odd[u][r], t_odd, xa);
              odd16[u][r] = _mm512_dpwssd_epi32(odd16[u][r], t_odd16, xh);
            }
          }
          __m512i even_ints[R], odd_ints[R];
          for (int r = 0; r < R; ++r) {
            __m512i e = even[0][r], e16 = even16[0][r], o = _mm512_add_epi32(odd[0][r], odd16[0][r]);
            for (int u = 1; u < kSets; ++u) {
              e = _mm512_add_epi32(e, even[u][r]);
              e16 = _mm512_add_epi32(e16, even16[u][r]);
              o = _mm512_add_epi32(o, _mm512_add_epi32(odd[u][r], odd16[u][r]));
            }
            even_ints[r] = _mm512_add_epi32(e, _mm512_srai_epi32(e16, 4));
            odd_ints[r] = o;
          }
          for (int r = 0; r < R; ++r) {
            const __m512 xs = _mm512_set1_ps(rows.xq_scale[r * blocks + b0 / Block]);  // first, as in panels_int16
            sums_even[r] = _mm512_fmadd_ps(scale_even, _mm512_mul_ps(xs, _mm512_cvtepi32_ps(even_ints[r])), sums_even[r]);
            sums_odd[r] = _mm512_fmadd_ps(scale_odd, _mm512_mul_ps(xs, _mm512_cvtepi32_ps(odd_ints[r])), sums_odd[r]);
          }
        }
        for (int r = 0; r < R; ++r) {
          const GroupTerms gr(a, p, segs.group[sg], rows.xsum[r * segs.count() + sg], 0.5f);
          sums_even[r] = _mm512_sub_ps(sums_even[r], lanes(gr.zero_term, false));
          sums_odd[r] = _mm512_sub_ps(sums_odd[r], lanes(gr.zero_term, true));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 ordered[2] = {
            in_order(_mm512_castps512_ps256(sums_even[r]), _mm512_castps512_ps256(sums_odd[r])),
            in_order(_mm512_extractf32x8_ps(sums_even[r], 1), _mm512_extractf32x8_ps(sums_odd[r], 1))};
        finish_slice(a, rows, p, k0, ordered, r);
      }
    }
  }
}
#pragma GCC diagnostic pop

// The int16 paths at the row's block size (RowPrep::xq_block); `vnni`: int4 on AVX512-VNNI.
void run_int16(const QuantGemmArgs& a, const Segments& segs, const RowPrep& rows, int64_t p0, int64_t p1, bool vnni) {
  const auto run = [&]<int64_t Block>() {
    if (vnni) {
      switch (a.m) {
        case 1: panels_int16_vnni<Block, 1>(a, segs, rows, p0, p1); break;
        case 2: panels_int16_vnni<Block, 2>(a, segs, rows, p0, p1); break;
        case 3: panels_int16_vnni<Block, 3>(a, segs, rows, p0, p1); break;
        default: panels_int16_vnni<Block, kVnniMaxRows>(a, segs, rows, p0, p1); break;
      }
    } else if (a.bits == 4) {
      panels_int16<Block>(a, segs, rows, p0, p1);
    } else {
      panels_int16_int8<Block>(a, segs, rows, p0, p1);
    }
  };
  switch (rows.xq_block) {
    case 128: run.template operator()<128>(); break;
    case 64: run.template operator()<64>(); break;
    case 32: run.template operator()<32>(); break;
    default: assert(false && "a block size kInt16Blocks lacks"); break;
  }
}
}  // namespace
}  // namespace quant_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -W(maybe-)uninitialized reports
// once inlined into a loop (a known false positive).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
namespace quant_avx512 {
namespace {
// One zmm register per 16-column row: up to 12 rows in registers, 32 registers in all.
struct Isa {
  using V = __m512;
  static constexpr int kVecs = 1;
  static constexpr int kDirectRows = 12;
  static constexpr int direct_tile_rows(int) { return 12; }
  static constexpr int kTileRows = 12;
  static V zero() { return _mm512_setzero_ps(); }
  static V bcast(const float* p) { return _mm512_set1_ps(*p); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static void int8(const int8_t* p, V* out) {
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void int4(const uint8_t* p, V* lo, V* hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    hi[0] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
  static void int4_bytes(const uint8_t* p, V* whole, V* high) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    whole[0] = _mm512_cvtepi32_ps(b);
    high[0] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
};
#include "cpu_gemm_quant_tiles.h"

// The bf16 path (QuantGemmArgs::x_bf16): like the in-register path, with vdpbf16ps on pairs of
// input columns (a 32-bit lane holds one column's weights at depths 2j and 2j + 1, the activations'
// pair is broadcast), twice the products per instruction of fp32 FMAs and no dequantized buffer.
// Weights become bf16 exactly: an int4 nibble u as the bf16 bits 0x4300 | u, i.e. 128 + u (so the
// zero point moves by 128 too), an int8 value as itself (|q| <= 128 fits bf16's 8 bits).
template <int Bits>
NANOVLLM_AVX512BF16 inline __m512bh weight_pairs(const uint8_t* w, bool last_odd) {
  if constexpr (Bits == 4) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));  // lo | hi << 4
    // (b & 0xf) | 0x43004300, then | (b << 12) & 0xf0000: imm 0xEA is (A & B) | C.
    const __m512i lo = _mm512_ternarylogic_epi32(b, _mm512_set1_epi32(0xf), _mm512_set1_epi32(0x43004300), 0xEA);
    return reinterpret_cast<__m512bh>(
        _mm512_ternarylogic_epi32(_mm512_slli_epi32(b, 12), _mm512_set1_epi32(0xf0000), lo, 0xEA));
  } else {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 even[1], odd[1] = {_mm512_setzero_ps()};
    Isa::int8(reinterpret_cast<const int8_t*>(w), even);
    if (!last_odd) Isa::int8(reinterpret_cast<const int8_t*>(w + kGemmPanel), odd);  // no row past an odd k
    // cvtne2ps gives [even 0..15 | odd 0..15]; vpermw interleaves them into the lanes.
    return reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(
        interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd[0], even[0]))));
  }
}

// Two int4 steps at once (depths 2j .. 2j + 3 of 16 columns, 32 bytes): vpermw puts column c's bytes
// of both steps into lane c (the odd columns' high bytes, shifted down), so one mask makes the
// weights at depths 2j and 2j + 2 and a shift and mask those at 2j + 1 and 2j + 3: three operations a
// step fewer than weight_pairs' widening, which bounded one row at ~12 GB/s of int4 on a Zen 4 core
// (this pair ~20 from memory). The activations' pairs must match: RowPrep::quads.
struct QuadDecoder {
  __m512i index, shift, mask, magic;
  NANOVLLM_AVX512BF16 QuadDecoder()
      : index(_mm512_set_epi16(15, 7, 15, 7, 14, 6, 14, 6, 13, 5, 13, 5, 12, 4, 12, 4, 11, 3, 11, 3, 10, 2, 10, 2, 9, 1,
                               9, 1, 8, 0, 8, 0)),
        shift(_mm512_set_epi32(8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0)),
        mask(_mm512_set1_epi32(0x000f000f)),
        magic(_mm512_set1_epi32(0x43004300)) {}
  NANOVLLM_AVX512BF16 void operator()(const uint8_t* w, __m512bh& even, __m512bh& odd) const {
    const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    const __m512i lanes = _mm512_srlv_epi32(_mm512_permutexvar_epi16(index, b), shift);
    // imm 0xEA: (A & B) | C.
    even = reinterpret_cast<__m512bh>(_mm512_ternarylogic_epi32(lanes, mask, magic, 0xEA));
    odd = reinterpret_cast<__m512bh>(_mm512_ternarylogic_epi32(_mm512_srli_epi32(lanes, 4), mask, magic, 0xEA));
  }
};

// The bf16 pair at `pair` in every lane.
NANOVLLM_AVX512BF16 inline __m512bh bcast(const uint16_t* pair) {
  int32_t bits;
  std::memcpy(&bits, pair, sizeof bits);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(bits));
}

// R rows (x rows a.x_stride apart, pairs of bf16) against panel p's slice at k0, segment by segment, as
// direct_slice; xsum holds these rows' segment sums, xq the rows as RowPrep::quads (null: single
// steps only); y the rows' panel columns, ldy apart. `ahead` (nullable): where a line is asked for
// into L2 per line the quad steps read, at the same offset.
template <int R, int Bits>
NANOVLLM_AVX512BF16 void direct_slice_bf16(const QuantGemmArgs& a, const Segments& segs, int64_t slice, int64_t p,
                                           int64_t k0, const uint8_t* w, const uint16_t* x, const uint16_t* xq,
                                           const float* xsum, float* y, int64_t ldy, const uint8_t* ahead = nullptr) {
  // Accumulator sets, as dot_segment; a quad step's even and odd depths go to different sets, so up
  // to 8 rows get at least two (with one, each row's two dot products a step waited on each other:
  // 10-30%).
  constexpr int S = std::clamp(16 / R, 1, 4);
  constexpr int kRowBytes = kGemmPanel * Bits / 8;
  const float magic = Bits == 4 ? 128.0f : 0.0f;
  const int64_t col0 = p * kGemmPanel;
  const int cols = static_cast<int>(std::min(kGemmPanel, a.n - col0));
  const QuadDecoder quad;
  for (int64_t sg = segs.first[slice]; sg < segs.first[slice + 1]; ++sg) {
    const int64_t s0 = segs.start[sg], len = segs.start[sg + 1] - s0;
    const int64_t pairs = (len + 1) / 2;
    const uint8_t* ws = w + (s0 - k0) * kRowBytes;
    const uint8_t* pb = ahead == nullptr ? nullptr : ahead + (s0 - k0) * kRowBytes;
    // The group's scales and zero points are loaded first, a possible cache miss the dot products hide.
    __m512 s[1], z[1];
    group_params(a, p, segs.group[sg], s, z);
    __m512 part[S][R];
    for (int t = 0; t < S; ++t) {
      for (int r = 0; r < R; ++r) part[t][r] = _mm512_setzero_ps();
    }
    const auto step = [&](int64_t j, __m512* into) NANOVLLM_AVX512BF16 {
      const __m512bh b = weight_pairs<Bits>(ws + 2 * j * kRowBytes, Bits == 8 && 2 * j + 1 == len);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) into[r] = _mm512_dpbf16_ps(into[r], b, bcast(x + r * a.x_stride + s0 + 2 * j));
    };
    // Steps j and j + 1 (j even) through the quad decoder, into two accumulator sets.
    const auto quad_step = [&](int64_t j, __m512* even_into, __m512* odd_into) NANOVLLM_AVX512BF16 {
      __m512bh even, odd;
      quad(ws + 2 * j * kRowBytes, even, odd);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const uint16_t* q = xq + r * a.x_stride + s0 + 2 * j;
        even_into[r] = _mm512_dpbf16_ps(even_into[r], even, bcast(q));
        odd_into[r] = _mm512_dpbf16_ps(odd_into[r], odd, bcast(q + 2));
      }
    };
    int64_t j = 0;
    if (Bits == 4 && xq != nullptr) {
      constexpr int kQuads = std::max(S / 2, 1);
      for (; j + 2 * kQuads <= pairs - (len & 1); j += 2 * kQuads) {
        if (pb != nullptr) {
          for (int64_t at = 2 * j * kRowBytes; at < 2 * (j + 2 * kQuads) * kRowBytes; at += 64) {
            __builtin_prefetch(pb + at, 0, 2);
          }
        }
#pragma GCC unroll 4
        for (int u = 0; u < kQuads; ++u) quad_step(j + 2 * u, part[(2 * u) % S], part[(2 * u + 1) % S]);
      }
      for (; j + 2 <= pairs - (len & 1); j += 2) quad_step(j, part[0], part[1 % S]);
    }
    for (; j + S <= pairs; j += S) {
#pragma GCC unroll 4
      for (int t = 0; t < S; ++t) step(j + t, part[t]);
    }
    for (; j < pairs; ++j) step(j, part[0]);
    const __m512 zero = _mm512_add_ps(z[0], _mm512_set1_ps(magic));
    const bool first = s0 == 0;
    __m512 bias;
    load_bias(a, col0, cols, first, &bias);
    for (int r = 0; r < R; ++r) {
      __m512 acc = part[0][r];
      for (int t = 1; t < S; ++t) acc = _mm512_add_ps(acc, part[t][r]);
      __m512 out = _mm512_mul_ps(s[0], _mm512_fnmadd_ps(zero, _mm512_set1_ps(xsum[r * segs.count() + sg]), acc));
      if (first) out = _mm512_add_ps(out, bias);
      put(y + r * ldy, &out, cols, !first);
    }
  }
}

template <int Bits>
NANOVLLM_AVX512BF16 void panels_bf16(const QuantGemmArgs& a, const Segments& segs, const RowPrep& rows, int64_t p0,
                                     int64_t p1) {
  const int64_t panels = gemm_panels(a.n);
  const int64_t kp = padded_depth(a.k, Bits);
  // One int4 row taking quad steps: the panel kPrefetchPanels on (panel_ahead) asked for a line per
  // line read, from the quad steps' loop (the first panels at once).
  const bool feed = Bits == 4 && a.m == 1 && !rows.quads.empty();
  for (int64_t k0 = 0, slice = 0; k0 < a.k; k0 += kQuantKc, ++slice) {
    const int64_t panel_bytes = std::min(kQuantKc, kp - k0) * kGemmPanel * Bits / 8;
    const uint8_t* end = a.packed + slice_bytes(panels, kp, p0, k0, Bits) + (p1 - p0) * panel_bytes;
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* w = a.packed + slice_bytes(panels, kp, p, k0, Bits);
      if constexpr (Bits == 4) {
        if (!feed) {
          const uint8_t* ahead = w + (p == p0 ? 0 : kPrefetchPanels * panel_bytes);
          prefetch_l2(ahead, std::min(end, w + (kPrefetchPanels + 1) * panel_bytes));
        } else if (p == p0 && k0 == 0) {
          prefetch_l2(w, std::min(end, w + kPrefetchPanels * panel_bytes));
        }
      }
      const uint8_t* ahead = feed ? panel_ahead(a, k0, p, p0, p1) : nullptr;
      row_tiles<Isa::kTileRows>(a.m, [&]<int R>(int64_t, int64_t r) NANOVLLM_AVX512BF16 {
        direct_slice_bf16<R, Bits>(a, segs, slice, p, k0, w, a.x_bf16 + r * a.x_stride,
                                   rows.quads.empty() ? nullptr : rows.quads.data() + r * a.x_stride,
                                   rows.xsum.data() + r * segs.count(), a.y + r * a.y_stride + p * kGemmPanel,
                                   a.y_stride, ahead);
      });
    }
  }
}

#define NANOVLLM_AMX                                                                     \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx2,fma," \
                        "amx-tile,amx-bf16,amx-int8")))

// Depth a group's tiles multiply between two pieces of the next group's decode: int8's group of a
// column decoded 32 deep at a time (int8 at 32 rows from memory 1.15x faster than 128 deep); int4's
// 128-deep group whole (at 32 or 64 deep, 0.9x hot: each piece's call costs more than it hides).
template <int Bits>
constexpr int64_t kAmxPiece = Bits == 8 ? 32 : 128;

// C[2 * b + q] = block b's rows x panel q's columns over `len` input columns of a slice decoded into
// `w` (the pair layout of P panels), B blocks (1 or 2) by P panels (1 or 2); into c, block b's rows
// at c + b * 16 * 32, rows 32 apart. After each `piece_depth` of depth, between(its index, the pieces).
template <int B, int P, typename Between>
NANOVLLM_AMX void amx_segment(const Bf16* a0, const Bf16* a1, const Bf16* w, int64_t len, int64_t piece_depth,
                              float* c, const Between& between) {
  amx::zero_sums<B, P>();
  const Bf16* a[2] = {a0, a1};
  constexpr int64_t kStepValues = amx::kTileDepth * P * kGemmPanel;  // one step's B, in bf16
  const int64_t pieces = (len + piece_depth - 1) / piece_depth;
  for (int64_t piece = 0; piece < pieces; ++piece) {
    const int64_t d = piece * piece_depth;
    amx::multiply<B, P>(a, w + d / amx::kTileDepth * kStepValues, std::min(piece_depth, len - d) / amx::kTileDepth);
    between(piece, pieces);
  }
  float* const y[2] = {c, c + amx::kTileRows * 2 * kGemmPanel};
  const int64_t stride[2] = {2 * kGemmPanel, 2 * kGemmPanel};
  amx::store_sums<B, P>(y, stride);
}

// What the AMX paths' scaling takes for panel p and group g: its first column and live columns, the
// group's scales and zero points (zero_offset added), and the bias where `first` (else zeros).
struct PanelGroup {
  int64_t col0;
  int cols;
  __m512 s, z, bias;
  NANOVLLM_AMX PanelGroup(const QuantGemmArgs& a, int64_t p, int64_t g, bool first)
      : col0(p * kGemmPanel), cols(static_cast<int>(std::min(kGemmPanel, a.n - col0))) {
    __m512 s16[1], z16[1], b16[1];
    group_params(a, p, g, s16, z16);
    load_bias(a, col0, cols, first, b16);
    s = s16[0];
    z = z16[0];
    bias = b16[0];
  }
};

// Rows [r0, r0 + rows) of a panel's scaled group sums, scaled(i) row r0 + i's: into its running
// totals (rows two panels apart) or, after the last group, into y or y_bf16 (the panel's columns).
template <typename Scaled>
NANOVLLM_AMX inline void put_scaled(const QuantGemmArgs& a, bool last, float* total, int64_t r0, int64_t rows,
                                    const PanelGroup& pg, const Scaled& scaled) {
  const int64_t col0 = pg.col0;
  const __mmask16 live = bf16x16::lanes(pg.cols);
  if (!last) {
    for (int64_t i = 0; i < rows; ++i) _mm512_store_ps(total + i * 2 * kGemmPanel, scaled(i));
  } else if (a.y_bf16 != nullptr) {
    Bf16* const y = a.y_bf16 + r0 * a.y_stride + col0;
    for (int64_t i = 0; i < rows; ++i) bf16x16::store(y + i * a.y_stride, scaled(i), live);
  } else {
    float* const y = a.y + r0 * a.y_stride + col0;
    for (int64_t i = 0; i < rows; ++i) _mm512_mask_storeu_ps(y + i * a.y_stride, live, scaled(i));
  }
}

// bf16 rows on AMX tiles (amx_path): each pair of panels is decoded once, a group at a time, into
// the bf16 pair layout (csrc/cpu_amx.h's B), its values those weight_pairs gives the vdpbf16ps path
// (the integers, plus 128 for int4: exact in bf16); for each 32 rows the tiles sum each group's
// products in fp32 and the group's scale and zero point apply to the sums as on that path
// (s * (sum - z * xsum)). At 32 rows the vdpbf16ps path is bound by its dot products (half an FMA's
// rate on Sapphire Rapids), the tiles by the decode and the scaling.
template <int Bits>
NANOVLLM_AMX void panels_amx(const QuantGemmArgs& a, int64_t p0, int64_t p1) {
  using amx::kTileRows;
  const int64_t panels = gemm_panels(a.n), kp = padded_depth(a.k, Bits), blocks = (a.m + kTileRows - 1) / kTileRows;
  const float magic = Bits == 4 ? 128.0f : 0.0f;
  thread_local std::vector<Bf16> tiles_storage, group_storage;
  thread_local std::vector<float> sums_storage;
  Bf16* const tiles = amx::aligned(tiles_storage, blocks * kTileRows * a.k);
  // Two decoded groups of a panel pair and two groups' sums: the next group's decode and the last
  // group's scaling run on the vector units while the tiles multiply (each waited on the other: 1.3x
  // slower). A group's products sum in the tiles across slices: one group per output column (int8's
  // default) is scaled once, not once per 256-deep slice. Decoded a group at a time (8 KB at int4's
  // 128), the weights stay in L1 for the tiles; a whole pair's decode (64 KB at k = 1024) went to L2
  // and back, and held the tiles idle while it ran: int4 at 32 rows 1.24-1.27x faster, at 64 rows
  // 1.14-1.17x (Intel Xeon with AMX).
  const int64_t group_size = std::min(a.group_size, a.k), groups = (a.k + group_size - 1) / group_size;
  const int64_t group_values = group_size * 2 * kGemmPanel, kSums = 2 * kTileRows * 2 * kGemmPanel;
  const auto group_len = [&](int64_t g) { return std::min(a.k, (g + 1) * group_size) - g * group_size; };
  Bf16* const decoded = amx::aligned(group_storage, 2 * group_values);
  // Each block pair's totals start a line before a multiple of 4 KB past the sums: at a multiple,
  // a load of a sum after the store of a total at the same 4 KB offset waited on it (a false
  // dependency on the address bits below 4 KB): int4 6144 x 1024 at 32 rows 1.03-1.06x faster
  // (Intel Xeon with AMX).
  float* const sums = amx::aligned(sums_storage, (3 + (blocks + 1) / 2) * kSums);
  float* const totals = sums + 3 * kSums - kGemmPanel;
  amx::pack_rows(a.x_bf16, a.x_stride, a.m, a.k, tiles);
  // Each row's sum of x per group, made here by every thread of the team rather than once by the
  // calling thread before the team starts (RowPrep, ~1% of an int4 decode step's samples with the
  // other thread waiting on it; the steps ran no measurably faster, Intel Xeon with AMX).
  thread_local std::vector<float> gsum_storage;
  float* const gsum = amx::aligned(gsum_storage, a.m * groups);
  for (int64_t r = 0; r < a.m; ++r) {
    const Bf16* x = a.x_bf16 + r * a.x_stride;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c1 = g * group_size + group_len(g);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = g * group_size; c < c1; c += 16) {
        sum = _mm512_add_ps(sum, bf16x16::load(x + c, bf16x16::lanes(c1 - c)));
      }
      gsum[r * groups + g] = _mm512_reduce_add_ps(sum);
    }
  }
  // Depths [g0 + d0, g0 + d1) of group g of the pair at panel p into w, which holds the group: its
  // depth pairs in order, the pair's panels interleaved (csrc/cpu_amx.h's B layout).
  const auto decode = [&](int64_t p, int64_t g, Bf16* w, int64_t d0, int64_t d1) NANOVLLM_AMX {
    const int np = static_cast<int>(std::min<int64_t>(2, p1 - p));
    const int64_t g0 = g * group_size, g1 = std::min(a.k, g0 + d1);
    // The next pair's scales and zero points of this group, with its weights below: a group's lie
    // a row of all panels apart, each pair's on pages of their own, and the scaling waited on them
    // (int4 gate/up GEMM at 32 rows 1.1x faster, Intel Xeon with AMX).
    for (int64_t q = p + 2; d0 == 0 && q < std::min(p + 4, p1); ++q) {
      const int64_t at = (g * panels + q) * kGemmPanel;
      _mm_prefetch(reinterpret_cast<const char*>(a.scales + at), _MM_HINT_T0);
      if (a.zeros != nullptr) _mm_prefetch(reinterpret_cast<const char*>(a.zeros + at), _MM_HINT_T0);
    }
    for (int64_t k0 = (g0 + d0) / kQuantKc * kQuantKc; k0 < g1; k0 += kQuantKc) {
      const int64_t kc = std::min(kQuantKc, a.k - k0), lo = std::max(g0 + d0, k0), hi = std::min(g1, k0 + kc);
      for (int q = 0; q < np; ++q) {
        const uint8_t* ws = a.packed + slice_bytes(panels, kp, p + q, k0, Bits);
        // The next pair's same depths asked for into L2 as this group decodes, a line every 64
        // bytes decoded: a pair's slice of a panel is 2 KB of int4 (4 KB of int8), so the hardware
        // prefetcher, which stops at each 4 KB page, met every pair's weights with a miss in each
        // slice and the tiles waited on the decode's loads; asked for all at once, the requests
        // filled the core's line buffers and stalled it (int8's one group: half its time). At 32
        // rows from memory the layers' int4 GEMMs 1.1-1.45x faster, int8 1.0-1.15x (Intel Xeon with
        // AMX).
        const uint8_t* next = p + 2 + q < p1 ? a.packed + slice_bytes(panels, kp, p + 2 + q, k0, Bits) : nullptr;
        constexpr int64_t kStepBytes = 2 * kGemmPanel * Bits / 8;
        for (int64_t j = (lo - k0) / 2; j < (hi - k0) / 2; ++j) {
          if (next != nullptr && j * kStepBytes % 64 == 0) _mm_prefetch(next + j * kStepBytes, _MM_HINT_T1);
          _mm512_store_si512(w + (((k0 - g0) / 2 + j) * np + q) * 2 * kGemmPanel,
                             reinterpret_cast<__m512i>(weight_pairs<Bits>(ws + j * kStepBytes, false)));
        }
      }
    }
  };
  // Group g's sums of blocks [b, b + 2) by panels [p, p + np), scaled: s * (sum - zero * xsum) added
  // to the bias (the first group) or the groups so far. The groups add up in `total` (the block
  // pair's rows by the panel pair's columns, 4 KB), which goes to y after the last: y's rows lie n
  // floats apart, a multiple of 4 KB in most layers, and adding each group into y itself took 32 rows
  // of one column into one L1 set (int4 at 32 rows 1.3x faster without). The first and last
  // groups' cases are hoisted out of the row loops and the scale is one FMA: with the cases tested
  // per row, and a multiply and an add, the scaling alone ran 1.25x longer (int4 6144 x 1024 at 32
  // rows 1.05-1.08x faster without, Intel Xeon with AMX).
  const auto scale = [&](const float* c, int64_t b, int64_t g, int64_t p, int np) NANOVLLM_AMX {
    const bool first = g == 0, last = g == groups - 1;
    const int64_t r0 = b * kTileRows, r1 = std::min(a.m, (b + 2) * kTileRows), ng = groups;
    const float* const xsum = gsum + g;
    for (int q = 0; q < np; ++q) {
      const PanelGroup pg(a, p + q, g, first);
      const __m512 zero = _mm512_add_ps(pg.z, _mm512_set1_ps(magic));
      // Row r0 + i's sums and running total (rows two panels apart).
      const float* const sum = c + q * kGemmPanel;
      float* const total = totals + b / 2 * kSums + q * kGemmPanel;
      const auto scaled = [&](int64_t i, __m512 add) NANOVLLM_AMX {
        const __m512 row_sum = _mm512_set1_ps(xsum[(r0 + i) * ng]);
        return _mm512_fmadd_ps(pg.s, _mm512_fnmadd_ps(zero, row_sum, _mm512_load_ps(sum + i * 2 * kGemmPanel)), add);
      };
      const auto before = [&](int64_t i) NANOVLLM_AMX {
        return first ? pg.bias : _mm512_load_ps(total + i * 2 * kGemmPanel);
      };
      put_scaled(a, last, total, r0, r1 - r0, pg, [&](int64_t i) NANOVLLM_AMX { return scaled(i, before(i)); });
    }
  };
  decode(p0, 0, decoded, 0, group_len(0));
  amx::fence();
  _tile_loadconfig(&amx::kConfig);
  int64_t done = 0;  // segments multiplied so far: the last one's sums wait in sums[(done - 1) % 2]
  struct Pending {
    int64_t b, g, p;
    int np;
  } pending{};
  // Step i: group i % groups of the pair at p0 + 2 (i / groups), against every block pair.
  const int64_t steps = (p1 - p0 + 1) / 2 * groups;
  for (int64_t i = 0; i < steps; ++i) {
    const int64_t p = p0 + 2 * (i / groups), g = i % groups;
    const int np = static_cast<int>(std::min<int64_t>(2, p1 - p));
    const int64_t g0 = g * group_size, len = group_len(g);
    const Bf16* ws = decoded + i % 2 * group_values;
    for (int64_t b = 0; b < blocks; b += 2, ++done) {
      const bool two = b + 1 < blocks;
      const Bf16* a0 = tiles + (b * a.k + g0) * kTileRows;
      const Bf16* a1 = a0 + kTileRows * a.k;
      float* c = sums + done % 2 * kSums;
      // The first block pair decodes the next group a piece at a time between its tiles' pieces: a
      // whole group decoded after them (int8's one group a column: a pair, 64 KB of bf16) waited
      // for all of its multiplies to retire, so the two ran in turn (int8's 6144 x 1024 GEMM at 32
      // rows 1.07-1.15x faster).
      const auto between = [&](int64_t piece, int64_t pieces) NANOVLLM_AMX {
        if (b > 0 || i + 1 == steps) return;
        const int64_t next = i + 1, next_len = group_len(next % groups);
        const int64_t d0 = piece * next_len / pieces, d1 = (piece + 1) * next_len / pieces;
        decode(p0 + 2 * (next / groups), next % groups, decoded + next % 2 * group_values, d0 / 2 * 2,
               piece + 1 == pieces ? next_len : d1 / 2 * 2);
      };
      if (two && np == 2) amx_segment<2, 2>(a0, a1, ws, len, kAmxPiece<Bits>, c, between);
      if (two && np == 1) amx_segment<2, 1>(a0, a1, ws, len, kAmxPiece<Bits>, c, between);
      if (!two && np == 2) amx_segment<1, 2>(a0, a1, ws, len, kAmxPiece<Bits>, c, between);
      if (!two && np == 1) amx_segment<1, 1>(a0, a1, ws, len, kAmxPiece<Bits>, c, between);
      amx::fence();
      if (done > 0) scale(sums + (done - 1) % 2 * kSums, pending.b, pending.g, pending.p, pending.np);
      pending = {b, g, p, np};
    }
  }
  amx::fence();
  if (done > 0) scale(sums + (done - 1) % 2 * kSums, pending.b, pending.g, pending.p, pending.np);
  _tile_release();
}

// --- bf16 rows as integers on AMX int8 tiles ------------------------------------------------------

// The int path (amx_int_path): the weights' integers need no conversion, so each row of bf16
// activations becomes 16-bit integers q times a power of two per segment (int16_block's rule: exact
// for every value within 2^7 of the segment's largest, the others within 2^-16 of it), split into a
// signed high byte and an unsigned low byte, q = 256 hi + lo, and int8 tiles multiply both against
// the weights' bytes (int8 as stored, int4's nibbles widened, 0..15): two 64-deep products per 32-deep
// bf16 one, so the tiles take as long as on the bf16 path while the weights are only reordered (one
// byte permute per 64 int8 weights, against seven operations per 32 to make bf16 pairs). A segment is a
// group's part of a 256-deep slice (kQuantKc): the slices go outermost, so a slice's rows (16 KB
// at 32 rows) stay in L1 while every pair of panels multiplies them; column-pair-outermost, each
// pair read all of k's rows from L2, a tile load's 16 lines at a time in order with the multiplies.
constexpr int64_t kIntDepth = 64;  // input columns of an int8 tile's row
constexpr int64_t kIntATile = amx::kTileRows * kIntDepth;
constexpr int64_t kIntMaxSegments = kQuantKc / kIntDepth;  // segments of a slice, at most

// A slice's segments: [start[i], start[i + 1]) in group[i].
struct IntSegments {
  int64_t start[kIntMaxSegments + 1] = {}, group[kIntMaxSegments] = {};
  int count = 0;
  IntSegments(int64_t k0, int64_t k1, int64_t group_size) {
    for (int64_t c = k0; c < k1; c = std::min(k1, (c / group_size + 1) * group_size)) {
      start[count] = c;
      group[count++] = c / group_size;
    }
    start[count] = k1;
  }
};

// The rows of the int path's A and C tiles: 16, or m where m is less (one block, its tiles only as
// tall as its rows: the multiplies, loads and stores of fewer rows; the Qwen3-shaped layers' int8
// GEMMs at 2-12 rows 1.03-1.05x faster, Intel Xeon with AMX).
constexpr int64_t int_block_rows(int64_t m) { return std::min(m, amx::kTileRows); }

// Columns [k0, k1) of rows [0, m) of x as a slice's A tiles, in blocks of 16 rows:
// [block][(c - k0) / 64][hi, lo][16 rows][64 bytes], of which the tiles' int_block_rows(m) rows are
// written; the rows past m in the last block zeros.
// f[r * kIntMaxSegments + i]: row r's power of two in segment i (NaN where it holds a NaN or an
// infinity, 0 for zeros); xq: the sum of its integers.
NANOVLLM_AMX void pack_slice_int(const QuantGemmArgs& a, int64_t k0, int64_t k1, const IntSegments& segs, int8_t* out,
                                 float* f, float* xq) {
  const int64_t steps = (k1 - k0) / kIntDepth, blocks = (a.m + amx::kTileRows - 1) / amx::kTileRows;
  const __m512i magnitude = _mm512_set1_epi16(0x7fff), low = _mm512_set1_epi16(0xff), ones = _mm512_set1_epi16(1);
  const __m512i floor = _mm512_set1_epi16(-32767);
  const __m512 half = _mm512_set1_ps(0.5f);
  // The saturating packs below work 128-bit lane by lane: byte 16 L + 4 j + i of their result is
  // column 16 j + 4 L + i of the 64 (q[j]'s lane L); one byte permute puts the columns in order.
  alignas(64) int8_t order_bytes[64];
  for (int n = 0; n < 64; ++n) order_bytes[n] = static_cast<int8_t>(16 * (n % 16 / 4) + 4 * (n / 16) + n % 4);
  const __m512i order = _mm512_load_si512(order_bytes);
  // 64 columns' integers from c (q[j]: columns c + 16 j ..; |q| <= 32768) into row r's hi and lo A
  // tiles, their sum returned in int32 lanes: packed to int16 (saturating: 32768 becomes 32767) and
  // held at -32767 (as int16_block), then the high bytes to int8 and the low ones to uint8.
  const auto put64 = [&](int64_t r, int64_t c, const __m512i (&q)[4]) NANOVLLM_AMX {
    const __m512i w01 = _mm512_max_epi16(_mm512_packs_epi32(q[0], q[1]), floor);
    const __m512i w23 = _mm512_max_epi16(_mm512_packs_epi32(q[2], q[3]), floor);
    const __m512i hi = _mm512_packs_epi16(_mm512_srai_epi16(w01, 8), _mm512_srai_epi16(w23, 8));
    const __m512i lo = _mm512_packus_epi16(_mm512_and_si512(w01, low), _mm512_and_si512(w23, low));
    int8_t* const at =
        out + (r / amx::kTileRows * steps + (c - k0) / kIntDepth) * 2 * kIntATile + r % amx::kTileRows * kIntDepth;
    _mm512_store_si512(at, _mm512_permutexvar_epi8(order, hi));
    _mm512_store_si512(at + kIntATile, _mm512_permutexvar_epi8(order, lo));
    return _mm512_add_epi32(_mm512_madd_epi16(w01, ones), _mm512_madd_epi16(w23, ones));
  };
  for (int64_t r = 0; r < (blocks - 1) * amx::kTileRows + int_block_rows(a.m); ++r) {
    if (r >= a.m) {
      const __m512i zeros[4] = {};
      for (int64_t c = k0; c < k1; c += kIntDepth) put64(r, c, zeros);
      continue;
    }
    const Bf16* x = a.x_bf16 + r * a.x_stride;
    for (int i = 0; i < segs.count; ++i) {
      const int64_t c0 = segs.start[i], c1 = segs.start[i + 1];
      // The largest magnitude's bits: bf16 magnitudes order as integers.
      __m512i most = _mm512_setzero_si512();
      for (int64_t c = c0; c < c1; c += 32) {
        most = _mm512_max_epu16(most, _mm512_and_si512(_mm512_loadu_si512(x + c), magnitude));
      }
      most = _mm512_max_epu32(_mm512_and_si512(most, _mm512_set1_epi32(0xffff)), _mm512_srli_epi32(most, 16));
      const int exponent = static_cast<int>(_mm512_reduce_max_epu32(most) >> 7);  // the largest < 2^(exponent - 126)
      if (exponent < 15 || exponent > 254) {  // zero, tiny, infinite or NaN: the scalar rule
        int16_t q16[kIntDepth * kIntMaxSegments];
        int32_t sum = 0;
        f[r * kIntMaxSegments + i] = int16_block(x + c0, c1 - c0, q16, sum);
        xq[r * kIntMaxSegments + i] = static_cast<float>(sum);
        for (int64_t c = c0; c < c1; c += kIntDepth) {
          __m512i q[4];
          for (int j = 0; j < 4; ++j) {
            q[j] = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q16 + c - c0 + 16 * j)));
          }
          put64(r, c, q);
        }
        continue;
      }
      // x * 2^(141 - exponent) is exact; rounded half away from zero, as int16_block.
      const __m512 up = _mm512_set1_ps(std::bit_cast<float>(static_cast<uint32_t>(268 - exponent) << 23));
      __m512i sum = _mm512_setzero_si512();
      for (int64_t c = c0; c < c1; c += kIntDepth) {
        __m512i q[4];
        for (int j = 0; j < 4; ++j) {
          const __m512 v = _mm512_mul_ps(bf16x16::load(x + c + 16 * j), up);
          const __m512 away = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
              _mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN), _mm512_castps_si512(half), 0xEA));  // sign | 0.5
          q[j] = _mm512_cvttps_epi32(_mm512_add_ps(v, away));
        }
        sum = _mm512_add_epi32(sum, put64(r, c, q));
      }
      f[r * kIntMaxSegments + i] = std::bit_cast<float>(static_cast<uint32_t>(exponent - 14) << 23);  // 2^(e - 141)
      xq[r * kIntMaxSegments + i] = static_cast<float>(_mm512_reduce_add_epi32(sum));
    }
  }
}

// Four depths of a panel's int8 weights (64 bytes, [4][16]) as a row of an int8 B tile ([16][4]:
// each column's four bytes together).
NANOVLLM_AMX inline __m512i int8_quads(const uint8_t* w) {
  // byte 4c + i <- depth i's column c, at 16 i + c
  const __m512i index = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27, 11,
                                        58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22, 6, 53,
                                        37, 21, 5, 52, 36, 20, 4, 51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32,
                                        16, 0);
  return _mm512_permutexvar_epi8(index, _mm512_loadu_si512(w));
}

// Four depths of a panel's int4 weights (32 bytes: two rows of [16] bytes, a byte a column's two
// depths, the first in its low nibble) as a row of an int8 B tile, the values 0..15: a byte permute
// puts both rows' bytes of columns 2q and 2q + 1 in qword q, a multishift takes each depth's nibble
// to its byte, an AND clears the nibble above it.
NANOVLLM_AMX inline __m512i int4_quads(const uint8_t* w) {
  alignas(64) static constexpr auto kIndex = [] {
    std::array<uint8_t, 64> b{};
    for (int q = 0; q < 8; ++q) {
      for (int i = 0; i < 4; ++i) b[8 * q + i] = static_cast<uint8_t>(16 * (i / 2) + 2 * q + i % 2);
    }
    return b;
  }();
  // byte 4 c' + d of qword q (column 2q + c', depth d): bits from 8 c' + 16 (d / 2) + 4 (d % 2)
  const __m512i shifts = _mm512_set1_epi64(0x1c180c0814100400LL);
  const __m256i rows = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m512i bytes = _mm512_permutexvar_epi8(_mm512_load_si512(kIndex.data()), _mm512_castsi256_si512(rows));
  return _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, bytes), _mm512_set1_epi8(0x0f));
}

template <int Bits>
NANOVLLM_AMX inline __m512i weight_quads(const uint8_t* w) {
  if constexpr (Bits == 8) {
    return int8_quads(w);
  } else {
    return int4_quads(w);
  }
}

// For one block of 16 rows and `steps` 64-deep steps: C0/C1 (panels 0/1) = hi x B, C2/C3 = lo x B,
// A from `a` (each step's hi and lo tiles), B from w (each step 16 quad rows, a row's P panels' 64
// bytes together); between() after each step. The sums go to c: [hi, lo][16 rows][32 columns] (the
// tiles' rows of them: int_block_rows).
template <int P, typename Between>
NANOVLLM_AMX void int_segment(const int8_t* a, const int8_t* w, int64_t steps, int32_t* c, const Between& between) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (P == 2) _tile_zero(1);
  if constexpr (P == 2) _tile_zero(3);
  constexpr int64_t kStride = P * 64;
  for (int64_t d = 0; d < steps; ++d, a += 2 * kIntATile, w += amx::kTileRows * kStride) {
    _tile_loadd(6, w, kStride);
    _tile_loadd(4, a, kIntDepth);
    _tile_loadd(5, a + kIntATile, kIntDepth);
    if constexpr (P == 2) _tile_loadd(7, w + 64, kStride);
    _tile_dpbssd(0, 4, 6);  // signed hi x signed weights
    _tile_dpbusd(2, 5, 6);  // unsigned lo x signed weights
    if constexpr (P == 2) _tile_dpbssd(1, 4, 7);
    if constexpr (P == 2) _tile_dpbusd(3, 5, 7);
    between();
  }
  constexpr int64_t kRow = 2 * kGemmPanel * 4;
  _tile_stored(0, c, kRow);
  _tile_stored(2, c + amx::kTileRows * 2 * kGemmPanel, kRow);
  if constexpr (P == 2) _tile_stored(1, c + kGemmPanel, kRow);
  if constexpr (P == 2) _tile_stored(3, c + amx::kTileRows * 2 * kGemmPanel + kGemmPanel, kRow);
}

// panels_amx on int8 tiles, a slice at a time: each pair of panels' slice reordered (int8) or
// widened (int4) into quads (weight_quads, the next pair's between the tiles' steps), then for each
// segment and block of 16 rows the tiles sum hi x q and lo x q, and the group's scale and zero point
// apply to f (256 sum_hi + sum_lo - z sum q), f the row's power of two in the segment, summed over
// the slices in fp32 totals per pair (every row by 32 columns).
template <int Bits>
NANOVLLM_AMX void panels_amx_int(const QuantGemmArgs& a, int64_t p0, int64_t p1) {
  using amx::kTileRows;
  const int64_t panels = gemm_panels(a.n), kp = padded_depth(a.k, Bits), blocks = (a.m + kTileRows - 1) / kTileRows;
  const int64_t group_size = std::min(a.group_size, a.k), pairs = (p1 - p0 + 1) / 2;
  const int64_t rows_padded = blocks * kTileRows, slices = (a.k + kQuantKc - 1) / kQuantKc;
  thread_local std::vector<int8_t> tiles_storage, decoded_storage;
  thread_local std::vector<float> row_storage, sums_storage;
  int8_t* const tiles = amx::aligned(tiles_storage, rows_padded * kQuantKc * 2);
  constexpr int64_t kSliceBytes = kQuantKc * 2 * kGemmPanel;  // a pair's slice, reordered
  int8_t* const decoded = amx::aligned(decoded_storage, 2 * kSliceBytes);
  // The rows' powers of two and sums per segment, for two slices: the last segment of a slice is
  // scaled after the next slice's first is multiplied.
  const int64_t row_params = rows_padded * kIntMaxSegments;
  float* const row_area = amx::aligned(row_storage, 4 * row_params);
  constexpr int64_t kSums = 2 * kTileRows * 2 * kGemmPanel;  // a block's [hi, lo][16][32]
  // Two segments' int32 sums, then each pair's totals (rows x 32 columns), starting a line before a
  // multiple of 4 KB past the sums as panels_amx's.
  float* const sum_area = amx::aligned(sums_storage, 3 * kSums + pairs * rows_padded * 2 * kGemmPanel);
  int32_t* const sums = reinterpret_cast<int32_t*>(sum_area);
  float* const totals = sum_area + 3 * kSums - kGemmPanel;
  // Quad rows [r0, r1) of the slice at k0 of the pair at panel p into w: row R (depths k0 + 4R ..
  // k0 + 4R + 3) of panel q at (R * np + q) * 64 bytes. The pair after it (or the thread's first
  // pair of the next slice) is asked for into L2 as the weights are read, a line per 64 bytes.
  constexpr int64_t kRowBytes = 4 * kGemmPanel * Bits / 8;  // a quad row's packed bytes
  // The quad rows of the slice at k0; the pair slice the thread takes after the pair at p's at k0
  // (the next pair's, or the next slice's first pair's).
  const auto quad_rows = [&](int64_t k0) { return (std::min(kQuantKc, a.k - k0) + 3) / 4; };
  const auto after = [&](int64_t p, int64_t k0) {
    return p + 2 < p1 ? std::pair<int64_t, int64_t>{p + 2, k0} : std::pair<int64_t, int64_t>{p0, k0 + kQuantKc};
  };
  const auto decode = [&](int64_t p, int64_t k0, int8_t* w, int64_t r0, int64_t r1) NANOVLLM_AMX {
    const int np = static_cast<int>(std::min<int64_t>(2, p1 - p));
    const auto [after_p, after_k] = after(p, k0);
    for (int q = 0; q < np; ++q) {
      const uint8_t* ws = a.packed + slice_bytes(panels, kp, p + q, k0, Bits);
      const uint8_t* next = after_k < a.k && after_p + q < p1
                                ? a.packed + slice_bytes(panels, kp, after_p + q, after_k, Bits)
                                : nullptr;
      const int64_t next_rows = next == nullptr ? 0 : quad_rows(after_k);
      for (int64_t r = r0; r < r1; ++r) {
        if (r < next_rows && r * kRowBytes % 64 == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(next + r * kRowBytes), _MM_HINT_T1);
        }
        _mm512_store_si512(w + (r * np + q) * 64, weight_quads<Bits>(ws + r * kRowBytes));
      }
    }
  };
  // One group over all of k (int8's default, a scale per channel): each slice adds only f (256 sum_hi
  // + sum_lo) to the totals, the scale, the zero point (row_xq: each row's sum of f times its
  // integers' sum) and the bias applied once, after the last (32-row int8 GEMMs 1.02-1.03x faster).
  const bool one_group = group_size == a.k;
  thread_local std::vector<float> row_xq_storage;
  float* const row_xq = amx::aligned(row_xq_storage, rows_padded);
  // Segment i's sums (group g) of block b by the pair at p, scaled and added to the bias (the first
  // segment) or the pair's totals, into y after the last.
  const auto scale = [&](const int32_t* c, int64_t sl, int64_t b, int i, int64_t g, bool first, bool last, int64_t p,
                         int np) NANOVLLM_AMX {
    const int64_t r0 = b * kTileRows, rows = std::min(a.m, r0 + kTileRows) - r0;
    const float* const fr = row_area + sl % 2 * 2 * row_params + r0 * kIntMaxSegments + i;
    const float* const qr = fr + row_params;
    const __m512 shift = _mm512_set1_ps(256.0f);
    for (int q = 0; q < np; ++q) {
      const int32_t* const hi = c + q * kGemmPanel;
      const int32_t* const lo = hi + kTileRows * 2 * kGemmPanel;
      float* const total = totals + ((p - p0) / 2 * rows_padded + r0) * 2 * kGemmPanel + q * kGemmPanel;
      const auto sum = [&](int64_t j) NANOVLLM_AMX {  // row j's 256 sum_hi + sum_lo
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(hi + j * 2 * kGemmPanel)), shift,
                               _mm512_cvtepi32_ps(_mm512_load_si512(lo + j * 2 * kGemmPanel)));
      };
      const auto powered = [&](int64_t j) NANOVLLM_AMX {  // f times that, plus the totals before
        const __m512 f = _mm512_set1_ps(fr[j * kIntMaxSegments]);
        return first ? _mm512_mul_ps(f, sum(j))
                     : _mm512_fmadd_ps(f, sum(j), _mm512_load_ps(total + j * 2 * kGemmPanel));
      };
      if (one_group && !last) {
        for (int64_t j = 0; j < rows; ++j) _mm512_store_ps(total + j * 2 * kGemmPanel, powered(j));
        continue;
      }
      const PanelGroup pg(a, p + q, g, one_group || first);
      if (one_group) {
        put_scaled(a, true, total, r0, rows, pg, [&](int64_t j) NANOVLLM_AMX {
          return _mm512_fmadd_ps(pg.s, _mm512_fnmadd_ps(pg.z, _mm512_set1_ps(row_xq[r0 + j]), powered(j)), pg.bias);
        });
        continue;
      }
      const auto scaled = [&](int64_t j) NANOVLLM_AMX {
        const __m512 before = first ? pg.bias : _mm512_load_ps(total + j * 2 * kGemmPanel);
        // f times the integers' sum first: f is a power of two, so that product is exact, where s * f
        // fell below fp32's normal range for rows near 2^-108 and lost the scale's bits.
        const __m512 sums = _mm512_fnmadd_ps(pg.z, _mm512_set1_ps(qr[j * kIntMaxSegments]), sum(j));
        return _mm512_fmadd_ps(pg.s, _mm512_mul_ps(_mm512_set1_ps(fr[j * kIntMaxSegments]), sums), before);
      };
      put_scaled(a, last, total, r0, rows, pg, scaled);
    }
  };
  struct Pending {
    int64_t sl, b, g, p;
    int i, np;
    bool first, last;
  } pending{};
  int64_t done = 0;  // segments multiplied so far: the last one's sums wait in sums[(done - 1) % 2]
  const auto scale_pending = [&]() NANOVLLM_AMX {
    scale(sums + (done - 1) % 2 * kSums, pending.sl, pending.b, pending.i, pending.g, pending.first, pending.last,
          pending.p, pending.np);
  };
  int64_t turn = 0;  // pair slices multiplied so far: the current one's decode in decoded[turn % 2]
  decode(p0, 0, decoded, 0, quad_rows(0));
  amx::fence();
  {
    amx::TileConfig config = amx::kConfig;
    for (int t = 0; t < 6; ++t) config.rows[t] = static_cast<uint8_t>(int_block_rows(a.m));
    _tile_loadconfig(&config);
  }
  for (int64_t sl = 0; sl < slices; ++sl) {
    const int64_t k0 = sl * kQuantKc, k1 = std::min(a.k, k0 + kQuantKc);
    const IntSegments segs(k0, k1, group_size);
    float* const f = row_area + sl % 2 * 2 * row_params;
    pack_slice_int(a, k0, k1, segs, tiles, f, f + row_params);
    if (one_group) {
      for (int64_t r = 0; r < a.m; ++r) {
        row_xq[r] = (sl == 0 ? 0.0f : row_xq[r]) + f[r * kIntMaxSegments] * f[row_params + r * kIntMaxSegments];
      }
    }
    const int64_t slice_steps = (k1 - k0) / kIntDepth;
    for (int64_t p = p0; p < p1; p += 2, ++turn) {
      const int np = static_cast<int>(std::min<int64_t>(2, p1 - p));
      const int8_t* w = decoded + turn % 2 * kSliceBytes;
      // The next pair's slice: this pair's (or the next slice's first pair).
      const auto [next_p, next_k] = after(p, k0);
      const int64_t next_rows = next_k < a.k ? quad_rows(next_k) : 0;
      int8_t* const next_w = decoded + (turn + 1) % 2 * kSliceBytes;
      const int64_t calls = blocks * slice_steps;
      int64_t call = 0;
      // One part of the next pair's decode after each step of the tiles, for an even pace of requests.
      const auto between = [&]() NANOVLLM_AMX {
        if (next_rows > 0) decode(next_p, next_k, next_w, call * next_rows / calls, (call + 1) * next_rows / calls);
        ++call;
      };
      for (int i = 0; i < segs.count; ++i) {
        const int64_t s0 = (segs.start[i] - k0) / kIntDepth, s1 = (segs.start[i + 1] - k0) / kIntDepth;
        const bool first = sl == 0 && i == 0, last = sl + 1 == slices && i + 1 == segs.count;
        for (int64_t b = 0; b < blocks; ++b, ++done) {
          const int8_t* at = tiles + (b * slice_steps + s0) * 2 * kIntATile;
          const int8_t* ws = w + s0 * kTileRows * np * 64;
          int32_t* c = sums + done % 2 * kSums;
          if (np == 2) int_segment<2>(at, ws, s1 - s0, c, between);
          if (np == 1) int_segment<1>(at, ws, s1 - s0, c, between);
          amx::fence();
          if (done > 0) scale_pending();
          pending = {sl, b, segs.group[i], p, i, np, first, last};
        }
      }
    }
  }
  amx::fence();
  if (done > 0) scale_pending();
  _tile_release();
}

NANOVLLM_AVX512BF16 void run_bf16(const QuantGemmArgs& a, const Segments& segs, const RowPrep& rows, int64_t p0,
                                  int64_t p1, bool amx, bool amx_int) {
  if (amx_int && a.bits == 8) {
    panels_amx_int<8>(a, p0, p1);
  } else if (amx_int) {
    panels_amx_int<4>(a, p0, p1);
  } else if (amx) {
    if (a.bits == 8) {
      panels_amx<8>(a, p0, p1);
    } else {
      panels_amx<4>(a, p0, p1);
    }
  } else if (a.bits == 8) {
    panels_bf16<8>(a, segs, rows, p0, p1);
  } else {
    panels_bf16<4>(a, segs, rows, p0, p1);
  }
}
}  // namespace
}  // namespace quant_avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

// --- dispatch ------------------------------------------------------------------------------------

int64_t quant_gemm_packed_bytes(int64_t n, int64_t k, int bits) {
  return gemm_panels(n) * padded_depth(k, bits) * kGemmPanel * bits / 8;
}

bool quant_isa_supported(QuantIsa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (isa) {
    case QuantIsa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case QuantIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma");
    case QuantIsa::kAmx: return quant_isa_supported(QuantIsa::kAvx512) && has_amx_bf16();
    default: return true;
  }
#else
  return isa == QuantIsa::kAuto || isa == QuantIsa::kPortable;
#endif
}

// Asked on every GEMM call (which path takes it): cpu_isa()'s answers, read once.
bool quant_has_bf16() { return has_avx512_bf16(); }

bool quant_has_vnni512() { return has_avx512_vnni(); }

QuantIsa quant_isa_best() {
  static const QuantIsa best = [] {
    for (QuantIsa isa : {QuantIsa::kAvx512, QuantIsa::kAvx2}) {
      if (quant_isa_supported(isa)) return isa;
    }
    return QuantIsa::kPortable;
  }();
  return best;
}

namespace {

RowPrep::RowPrep(const QuantGemmArgs& a, const Segments& segs, bool int16, bool amx) {
  if (int16) {
    xq_block = int16_block_size(a.k, a.group_size);
    xq_stride = a.bits == 4 ? a.k * 2 : a.k / 2;
    const int64_t blocks = a.k / xq_block;
    xq = std::make_unique_for_overwrite<int32_t[]>(a.m * xq_stride);  // int16_row writes it all
    xq_scale.resize(a.m * blocks);
    xq_row_scale.assign(a.m, 0.0f);
    xsum.assign(a.m * segs.count(), 0.0f);
    std::vector<int32_t> sums(blocks);
    for (int64_t r = 0; r < a.m; ++r) {
      float* const scale = xq_scale.data() + r * blocks;
#if defined(__x86_64__)
      quant_avx2::int16_row(a.x_bf16 + r * a.x_stride, a.k, xq_block, a.bits, xq.get() + r * xq_stride, scale,
                            sums.data());
#endif
      // The scales relative to the largest (powers of two: exact), that one applied at a slice's end:
      // the products of the largest blocks' sums with their scales stay near 1 whatever the row's
      // magnitude (with absolute scales, a row of bf16's tiniest values lost precision to fp32's
      // subnormals); blocks 2^126 below the row's largest fall to subnormals as in any fp32 sum. A row
      // of zeros keeps 1.
      float& largest = xq_row_scale[r];
      for (int64_t b = 0; b < blocks; ++b) largest = std::isnan(scale[b]) ? largest : std::max(largest, scale[b]);
      if (largest == 0.0f) largest = 1.0f;
      for (int64_t b = 0; b < blocks; ++b) scale[b] /= largest;
      for (int64_t b = 0, sg = 0; b < blocks; ++b) {
        while (segs.start[sg + 1] <= b * xq_block) ++sg;
        xsum[r * segs.count() + sg] += scale[b] * static_cast<float>(sums[b]);
      }
    }
    return;
  }
  if ((a.x_bf16 == nullptr && a.m > kMaxDirectRows) || amx) return;  // the AMX path sums its rows itself
  xsum.assign(a.m * segs.count(), 0.0f);
  for (int64_t r = 0; r < a.m; ++r) {
    for (int64_t s = 0; s < segs.count(); ++s) {
      // In vectors (any order sums as well): one at a time, the sums of a decode step's 32 rows
      // took ~12 us a GEMM on the calling thread alone.
      float sum = 0.0f;
      if (a.x_bf16 != nullptr) {
        const Bf16* x = a.x_bf16 + r * a.x_stride;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = segs.start[s]; i < segs.start[s + 1]; ++i) sum += widen(x[i]);
      } else {
        const float* x = a.x + r * a.x_stride;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = segs.start[s]; i < segs.start[s + 1]; ++i) sum += x[i];
      }
      xsum[r * segs.count() + s] = sum;
    }
  }
  if (a.x_bf16 == nullptr && a.bits == 4) {
    const int64_t kp = padded_depth(a.k, 4);
    pairs.assign(a.m * kp, 0.0f);
    for (int64_t r = 0; r < a.m; ++r) {
      const float* x = a.x + r * a.x_stride;
      float* out = pairs.data() + r * kp;
      for (int64_t i = 0; i < a.k; i += 2) {
        out[i] = x[i];
        if (i + 1 < a.k) out[i + 1] = x[i + 1] - 16.0f * x[i];
      }
    }
  }
  // Quads must not straddle a segment: every group (and slice) starts on a multiple of 4. A prefill's
  // thousands of rows take single steps: the copy runs on one thread before the GEMM, and a tile of
  // 12 rows already spreads a step's decode over 12 products.
  if (amx || a.x_bf16 == nullptr || a.bits != 4 || a.m > kQuadMaxRows ||
      (a.group_size % 4 != 0 && a.group_size < a.k)) {
    return;
  }
  const int64_t row = a.k + a.k % 2;  // what a row holds; x_stride may be wider
  quads.assign((a.m - 1) * a.x_stride + row, 0);
  for (int64_t r = 0; r < a.m; ++r) {
    uint16_t* q = quads.data() + r * a.x_stride;
    std::copy_n(a.x_bf16 + r * a.x_stride, row, q);
    for (int64_t i = 0; i + 4 <= a.k; i += 4) std::swap(q[i + 1], q[i + 2]);
  }
}

// bf16 activations on vdpbf16ps (the AVX-512 bf16 path) or AMX tiles.
bool bf16_dots(QuantIsa isa) {
  return quant_has_bf16() && (isa == QuantIsa::kAuto || isa == QuantIsa::kAvx512 || isa == QuantIsa::kAmx);
}

// bf16 activations as integers on AMX int8 tiles (panels_amx_int), where amx_path takes the call too:
// int8 weights up to kAmxIntMaxRows rows, int4 up to kAmxInt4MaxRows (its first rows go to
// int16_vnni_path where that takes them), where the steps (k, every group) are multiples of 64 (a
// segment's 256 columns at most keep its int32 sums far from overflow).
bool amx_int_path(const QuantGemmArgs& a) {
  return a.m <= (a.bits == 8 ? kAmxIntMaxRows : kAmxInt4MaxRows) && a.k % 64 == 0 &&
         (a.group_size % 64 == 0 || a.group_size >= a.k);
}

// bf16 activations on AMX tiles: asked for (kAmx) or, by default, from kAmxMinRows rows (int8 from one
// where the int8 tiles take it), where the shape takes whole tiles: k and every group multiples of 32.
bool amx_path(const QuantGemmArgs& a, QuantIsa isa) {
  const bool rows = a.m >= kAmxMinRows || (a.bits == 8 && amx_int_path(a));
  return a.x_bf16 != nullptr && (isa == QuantIsa::kAmx || (isa == QuantIsa::kAuto && rows)) && has_amx_bf16() &&
         a.k % 32 == 0 && (a.group_size % 32 == 0 || a.group_size >= a.k);
}

// One to kVnniMaxRows rows against int4 on AVX512-VNNI (isa auto or AVX-512) as 16-bit integers
// (panels_int16_vnni): vpdpwssd outruns the bf16 dot products there, and at one or two rows the AMX
// tiles (from kAmxInt4MinRows the int8 tiles take the shapes they can); int8's one row reads at the
// memory's rate either way.
bool int16_vnni_path(const QuantGemmArgs& a, QuantIsa isa) {
  return a.x_bf16 != nullptr && a.m >= 1 && a.m <= kVnniMaxRows && a.bits == 4 &&
         (isa == QuantIsa::kAuto || isa == QuantIsa::kAvx512) && quant_has_vnni512() &&
         int16_block_size(a.k, a.group_size) > 0 && !(a.m >= kAmxInt4MinRows && amx_path(a, isa) && amx_int_path(a));
}

// bf16 activations of one row against int4 or int8 on AVX2 as 16-bit integers (RowPrep::xq): the
// decode of the weights for fp32 FMAs bounds one row on AVX2, integer multiply-adds of pairs of
// weights with pairs of activations take fewer operations; and int16_vnni_path's rows.
bool int16_path(const QuantGemmArgs& a, QuantIsa isa) {
#if defined(__x86_64__)
  return (a.x_bf16 != nullptr && !bf16_dots(isa) && (isa == QuantIsa::kAuto ? quant_isa_best() : isa) == QuantIsa::kAvx2 &&
          a.m == 1 && int16_block_size(a.k, a.group_size) > 0) || int16_vnni_path(a, isa);
#else
  return false;
#endif
}

void run_isa(const QuantGemmArgs& a, QuantIsa isa, const Segments& segs, const RowPrep& rows, int64_t p0, int64_t p1) {
#if defined(__x86_64__)
  if (a.x_bf16 != nullptr) {
    if (rows.xq_block == 0) {
      const bool amx = amx_path(a, isa);
      quant_avx512::run_bf16(a, segs, rows, p0, p1, amx, amx && amx_int_path(a));
    } else {
      quant_avx2::run_int16(a, segs, rows, p0, p1, int16_vnni_path(a, isa));
    }
    return;
  }
#endif
  switch (isa == QuantIsa::kAuto ? quant_isa_best() : isa) {
#if defined(__x86_64__)
    case QuantIsa::kAvx512:
    case QuantIsa::kAmx: quant_avx512::run(a, segs, rows, p0, p1); break;
    case QuantIsa::kAvx2: quant_avx2::run(a, segs, rows, p0, p1); break;
#endif
    default: quant_portable::run(a, segs, rows, p0, p1); break;
  }
}

}  // namespace

void quant_gemm(const QuantGemmArgs& a, QuantIsa isa, int num_threads) {
  if (a.m == 0) return;
  const Segments segs(a.k, a.group_size);
  QuantGemmArgs g = a;
  // bf16 rows that neither bf16 path takes, widened for the fp32 paths (exactly: the same product).
  std::vector<float> wide;
  const bool int16 = int16_path(a, isa);
  if (a.x_bf16 != nullptr && !int16 && !bf16_dots(isa)) {
    std::tie(g.x, g.x_stride) = rows_as<float>(a.x_bf16, a.m, a.k, a.x_stride, wide);
    g.x_bf16 = nullptr;
  }
  const bool amx = !int16 && amx_path(g, isa);
  const RowPrep rows(g, segs, int16, amx);
  // bf16 output: the AMX path rounds each sum as it finishes it; on the others each thread rounds its
  // columns once their sums are whole, while they are in cache (a separate conversion was a pass and
  // ~9 us of dispatch per call at one row).
  std::unique_ptr<float[]> sums;
  if (a.y_bf16 != nullptr && !amx) {
    sums = std::make_unique_for_overwrite<float[]>(a.m * a.n);
    g.y = sums.get();
    g.y_stride = a.n;
  }
  parallel_rows(gemm_panels(a.n), a.m * a.k * kGemmPanel, num_threads, [&](int64_t p0, int64_t p1) {
    run_isa(g, isa, segs, rows, p0, p1);
    if (a.y_bf16 == nullptr || amx) return;
    const int64_t c0 = p0 * kGemmPanel, c1 = std::min(a.n, p1 * kGemmPanel);
    for (int64_t r = 0; r < a.m; ++r) {
      for (int64_t c = c0; c < c1; ++c) a.y_bf16[r * a.y_stride + c] = to_bf16(g.y[r * a.n + c]);
    }
  });
}

void quant_gemm_panels(const QuantGemmArgs& a, QuantIsa isa, int64_t p0, int64_t p1) {
  if (a.m == 0 || p0 >= p1) return;
  assert(a.y_bf16 == nullptr && (a.x_bf16 == nullptr || bf16_dots(isa)));
  const Segments segs(a.k, a.group_size);
  // An expert's one bf16 row against int4 takes the VNNI integers too: the Qwen3-MoE-shaped int4
  // model's MoE layers at one token 1.7-2.0 -> 1.4 ms (47-54% -> 64-65% of the memory's rate), at 32
  // tokens (some experts of one row) 17.4 -> 16.0 ms (Intel Xeon with AMX).
  const RowPrep rows(a, segs, int16_vnni_path(a, isa), amx_path(a, isa));
  run_isa(a, isa, segs, rows, p0, p1);
}

}  // namespace nanovllm
