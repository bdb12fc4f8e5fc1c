// A prefill tile of paged attention on AMX tiles (bf16 caches, Intel Sapphire Rapids and later):
// the scores Q K^T and the weighted values P V as tile products, the softmax between them on the
// vector units.
//
// Why: the vector path (csrc/cpu_attention_tiles.h) ran a 4096-token prompt's attention at ~140
// GFLOP/s on two threads, two thirds of the prompt's prefill on the Intel Xeon with AMX; here one
// layer's takes 41-45 ms instead of 258 (~6x). The tiles multiply 16 x 16 x 32 at a time.
//
// Layouts (amx::kConfig's 16-row x 64-byte tiles; C0..C3 sums, A4 the left operand, B6 the right):
//   - Q: the task's query vectors as A tiles, [16-vector block][D / 32][16 vectors][32].
//   - K^T: B tiles of the keys, [16-key tile][D / 32][16 depth pairs][16 keys][2]: a tile's row is
//     one depth pair of 16 keys, gathered from their cache rows (a transpose of how they are stored).
//   - P: a block of 16 vectors' exponentials (less each one's max) in bf16 as A tiles, [32-key
//     tile][16][32]; each output row is divided by its vector's sum at the end.
//   - V: B tiles, [32-key tile][D / 16][16 key pairs][16 columns][2]: two cache rows interleaved.
// The scores of all the task's keys are kept (as the vector path keeps them), so that the softmax
// is computed once and P V needs no rescaling. P is rounded to bf16 before its products (as GPU
// flash attention rounds it): within bf16's precision of the vector path's fp32 weights.
#include "cpu_attention_amx.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_isa.h"
#include "cpu_math.h"

namespace nanovllm {

#if defined(__x86_64__)
#define NANOVLLM_ATTN_AMX \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,amx-tile,amx-bf16")))

// GCC 12's AVX-512 reductions and extracts start from _mm*_undefined_*(), which -Wuninitialized
// reports once inlined (a known false positive), as in csrc/cpu_attention_bf16.h.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace {

using amx::kTileDepth;  // 32 bf16 a tile row
using amx::kTileRows;   // 16
constexpr int64_t kTileValues = kTileRows * kTileDepth;  // bf16 values in an A or B tile (1 KB)
constexpr int64_t kKeyTile = 16;                          // keys in a score tile's columns
constexpr int64_t kScoreTiles = 4;                        // C0..C3: 64 keys' scores at a time

struct Scratch {
  std::vector<Bf16> q, kt, p, v;
  std::vector<float> s, o;
};

// The cache row of key t of KV head h (element offset).
inline int64_t key_row(const PagedAttentionArgs& a, const int32_t* table, int64_t t, int64_t h) {
  return (static_cast<int64_t>(table[t / a.block_size]) * a.block_size + t % a.block_size) * a.num_kv_heads *
             a.head_dim +
         h * a.head_dim;
}

// K^T tiles of keys [0, keys) (keys a multiple of kKeyTile * kScoreTiles; those from `count` on
// zero): tile (j, dt) row dp = the 32-bit pair at depth 32 dt + 2 dp of keys 16 j .. 16 j + 15,
// gathered from their rows (64-bit offsets: a layer's cache may pass 2^31 pairs).
NANOVLLM_ATTN_AMX void gather_keys(const PagedAttentionArgs& a, const int32_t* table, int64_t h, int64_t count,
                                   int64_t keys, Bf16* out) {
  const auto* k_cache = static_cast<const int32_t*>(a.k_cache);
  const int64_t depth_tiles = a.head_dim / kTileDepth;
  alignas(64) int64_t rows[kKeyTile];
  for (int64_t j = 0; j < keys / kKeyTile; ++j) {
    for (int64_t i = 0; i < kKeyTile; ++i) {
      const int64_t t = j * kKeyTile + i;
      rows[i] = t < count ? key_row(a, table, t, h) / 2 : 0;  // in pairs
    }
    const __m512i low = _mm512_load_si512(rows), high = _mm512_load_si512(rows + 8);
    const int64_t live = std::clamp<int64_t>(count - j * kKeyTile, 0, kKeyTile);
    const auto mask = static_cast<uint32_t>((uint64_t{1} << live) - 1);
    const auto low_mask = static_cast<__mmask8>(mask), high_mask = static_cast<__mmask8>(mask >> 8);
    for (int64_t dt = 0; dt < depth_tiles; ++dt) {
      int32_t* tile = reinterpret_cast<int32_t*>(out + (j * depth_tiles + dt) * kTileValues);
      for (int64_t dp = 0; dp < kTileRows; ++dp) {
        const int32_t* pair = k_cache + dt * kTileRows + dp;
        _mm256_store_si256(reinterpret_cast<__m256i*>(tile + dp * kKeyTile),
                           _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), low_mask, low, pair, 4));
        _mm256_store_si256(reinterpret_cast<__m256i*>(tile + dp * kKeyTile + 8),
                           _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), high_mask, high, pair, 4));
      }
    }
  }
}

// V tiles of keys [0, keys) (keys a multiple of 32; rows from `count` on zero: their weights are 0,
// but an unwritten row could hold NaNs): tile (kt, dj) row kp = columns 16 dj .. 16 dj + 15 of keys
// 32 kt + 2 kp and 32 kt + 2 kp + 1, interleaved.
NANOVLLM_ATTN_AMX void gather_values(const PagedAttentionArgs& a, const int32_t* table, int64_t h, int64_t count,
                                     int64_t keys, Bf16* out) {
  const auto* v_cache = static_cast<const Bf16*>(a.v_cache);
  const int64_t D = a.head_dim, column_tiles = D / kTileRows;
  // Output word 2c takes the first row's column c, 2c + 1 the second's (index 32 + c), per half.
  alignas(64) int16_t low[32], high[32];
  for (int c = 0; c < 16; ++c) {
    low[2 * c] = static_cast<int16_t>(c);
    low[2 * c + 1] = static_cast<int16_t>(32 + c);
    high[2 * c] = static_cast<int16_t>(16 + c);
    high[2 * c + 1] = static_cast<int16_t>(48 + c);
  }
  const __m512i lo = _mm512_load_si512(low), hi = _mm512_load_si512(high);
  for (int64_t t = 0; t < keys; t += 2) {
    const Bf16* r0 = t < count ? v_cache + key_row(a, table, t, h) : nullptr;
    const Bf16* r1 = t + 1 < count ? v_cache + key_row(a, table, t + 1, h) : nullptr;
    Bf16* tiles = out + t / kTileDepth * column_tiles * kTileValues + (t % kTileDepth) / 2 * kTileDepth;
    for (int64_t d = 0; d < D; d += kTileDepth) {
      const __m512i x0 = r0 != nullptr ? _mm512_loadu_si512(r0 + d) : _mm512_setzero_si512();
      const __m512i x1 = r1 != nullptr ? _mm512_loadu_si512(r1 + d) : _mm512_setzero_si512();
      _mm512_store_si512(tiles + d / kTileRows * kTileValues, _mm512_permutex2var_epi16(x0, lo, x1));
      _mm512_store_si512(tiles + (d / kTileRows + 1) * kTileValues, _mm512_permutex2var_epi16(x0, hi, x1));
    }
  }
}

// C0..C3 += A4 x B6 over `depth` tiles: A4 from a (advancing by a_step), tile j's B from b + j * b_j
// (advancing by b_step).
NANOVLLM_ATTN_AMX inline void four_products(const Bf16* a, int64_t a_step, const Bf16* b, int64_t b_j, int64_t b_step,
                                            int64_t depth) {
  for (int64_t s = 0; s < depth; ++s, a += a_step, b += b_step) {
    _tile_loadd(4, a, kTileDepth * 2);
    _tile_loadd(6, b, kTileDepth * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(6, b + b_j, kTileDepth * 2);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(6, b + 2 * b_j, kTileDepth * 2);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(6, b + 3 * b_j, kTileDepth * 2);
    _tile_dpbf16ps(3, 4, 6);
  }
}

// exp(x) for x <= 0, vec_exp's polynomial (csrc/cpu_math.h) in AVX-512 registers, 2^k applied by
// vscalefps; below kExpMin clamped (1e-38 for 0). The auto-vectorized vec_exp loop, with the max
// and the bf16 conversion around it, was half of a long prompt's attention on AMX tiles.
NANOVLLM_ATTN_AMX inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(kLn2Low), _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2High), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

// C0..C3 stored at c, c + step, c + 2 step, c + 3 step, rows `stride` floats apart.
NANOVLLM_ATTN_AMX inline void store_four(float* c, int64_t step, int64_t stride) {
  _tile_stored(0, c, stride * 4);
  _tile_stored(1, c + step, stride * 4);
  _tile_stored(2, c + 2 * step, stride * 4);
  _tile_stored(3, c + 3 * step, stride * 4);
}

// The exponentials of one vector's scores s[0, n) (unscaled dot products) less their max, in bf16
// into P row `row` of its block (keys [n, keys) zero); returns their sum. Left unnormalized: the
// vector's output row is divided by the sum instead (one pass over the scores fewer).
NANOVLLM_ATTN_AMX float softmax_row(const float* __restrict s, int64_t n, int64_t keys, float scale,
                                    Bf16* __restrict p, int64_t row) {
  // The max over four chains of lanes: one chain waited on vmaxps's latency every 16 keys (a
  // `reduction(max)` loop stayed scalar, a dependent vmaxss a key).
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 lanes[4] = {lowest, lowest, lowest, lowest};
  int64_t t = 0;
  for (; t + 64 <= n; t += 64) {
    for (int j = 0; j < 4; ++j) lanes[j] = _mm512_max_ps(lanes[j], _mm512_loadu_ps(s + t + 16 * j));
  }
  for (; t < n; t += 16) {
    const auto live = static_cast<__mmask16>(n - t >= 16 ? 0xffff : (1u << (n - t)) - 1);
    lanes[0] = _mm512_mask_max_ps(lanes[0], live, lanes[0], _mm512_maskz_loadu_ps(live, s + t));
  }
  const float m =
      _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(lanes[0], lanes[1]), _mm512_max_ps(lanes[2], lanes[3])));
  // exp((s - m) scale), 32 keys a tile row, rounded by vcvtne2ps2bf16 (to nearest even, as to_bf16).
  const __m512 top = _mm512_set1_ps(m), by = _mm512_set1_ps(scale);
  __m512 sums = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < keys; k0 += kTileDepth) {
    const int64_t live = std::clamp<int64_t>(n - k0, 0, kTileDepth);
    const auto low = static_cast<__mmask16>((1u << std::min<int64_t>(live, 16)) - 1);
    const auto high = static_cast<__mmask16>((1u << std::max<int64_t>(live - 16, 0)) - 1);
    const __m512 e0 = _mm512_maskz_mov_ps(
        low, exp_nonpositive(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(low, s + k0), top), by)));
    const __m512 e1 = _mm512_maskz_mov_ps(
        high, exp_nonpositive(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(high, s + k0 + 16), top), by)));
    sums = _mm512_add_ps(sums, _mm512_add_ps(e0, e1));
    _mm512_store_si512(p + k0 / kTileDepth * kTileValues + row * kTileDepth,
                       reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
  }
  return _mm512_reduce_add_ps(sums);
}

}  // namespace

bool attention_amx_takes(const PagedAttentionArgs& a) {
  return a.dtype == CpuDtype::kBFloat16 && a.head_dim % 64 == 0 && has_amx_bf16() && has_avx512() &&
         has_avx512_bf16();
}

NANOVLLM_ATTN_AMX void attend_rows_amx(const PagedAttentionArgs& a, int32_t seq, int32_t head_begin, int32_t head_end,
                                       int32_t row_begin, int32_t row_end) {
  const int64_t group = a.num_heads / a.num_kv_heads, D = a.head_dim, depth_tiles = D / kTileDepth;
  const int32_t q_start = a.cu_seqlens_q[seq];
  const int64_t q_len = a.cu_seqlens_q[seq + 1] - q_start;
  const int64_t base = a.context_lens[seq] - q_len + row_begin;  // the first row's position
  const int64_t rows = row_end - row_begin, V = rows * group, blocks = (V + kTileRows - 1) / kTileRows;
  const int64_t L = base + rows;  // keys the last row sees
  constexpr int64_t kKeyStep = kKeyTile * kScoreTiles;
  const int64_t keys = (L + kKeyStep - 1) / kKeyStep * kKeyStep;  // a multiple of the P tiles' 32 too
  const int32_t* table = a.block_tables + static_cast<int64_t>(seq) * a.block_table_stride;
  thread_local Scratch s;
  Bf16* const q = amx::aligned(s.q, blocks * depth_tiles * kTileValues);
  Bf16* const kt = amx::aligned(s.kt, keys * D);
  Bf16* const pb = amx::aligned(s.p, keys * kTileRows);  // one block's P tiles
  Bf16* const v = amx::aligned(s.v, keys * D);
  float* const sc = amx::aligned(s.s, kTileRows * keys);
  float* const o = amx::aligned(s.o, kTileRows * D);
  const auto* query = static_cast<const Bf16*>(a.query);
  auto* out = static_cast<Bf16*>(a.out);
  // The keys vector `vec` sees: its row's position + 1.
  const auto visible = [&](int64_t vec) { return base + vec / group + 1; };
  _tile_loadconfig(&amx::kConfig);
  for (int64_t h = head_begin; h < head_end; ++h) {
    // Q's A tiles: vector i = row i / group, query head h * group + i % group.
    for (int64_t i = 0; i < blocks * kTileRows; ++i) {
      Bf16* dst = q + (i / kTileRows * depth_tiles * kTileRows + i % kTileRows) * kTileDepth;
      const Bf16* src = query + ((q_start + row_begin + i / group) * a.num_heads + h * group + i % group) * D;
      for (int64_t dt = 0; dt < depth_tiles; ++dt, dst += kTileValues) {
        if (i < V) {
          std::copy_n(src + dt * kTileDepth, kTileDepth, dst);
        } else {
          std::fill_n(dst, kTileDepth, Bf16{0});
        }
      }
    }
    gather_keys(a, table, h, L, keys, kt);
    gather_values(a, table, h, L, keys, v);
    amx::fence();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t last = std::min(V, (b + 1) * kTileRows) - 1;
      const int64_t seen = visible(last);  // keys the block's last vector sees
      const int64_t steps = (seen + kKeyStep - 1) / kKeyStep;  // 64-key score steps
      const int64_t value_tiles = (seen + kTileDepth - 1) / kTileDepth;  // 32-key P tiles
      // Scores, 64 keys at a time, into sc [16 vectors][keys].
      for (int64_t st = 0; st < steps; ++st) {
        amx::zero_sums<2, 2>();
        four_products(q + b * depth_tiles * kTileValues, kTileValues,
                      kt + st * kScoreTiles * depth_tiles * kTileValues, depth_tiles * kTileValues, kTileValues,
                      depth_tiles);
        store_four(sc + st * kKeyStep, kKeyTile, keys);
      }
      amx::fence();
      float inv[kTileRows];  // 1 / each vector's sum of exponentials
      for (int64_t i = 0; i < kTileRows; ++i) {
        const int64_t vec = b * kTileRows + i;
        const int64_t n = vec < V ? visible(vec) : 0;
        inv[i] = 1.0f / softmax_row(sc + i * keys, n, value_tiles * kTileDepth, a.scale, pb, i);
      }
      amx::fence();
      // Values, 64 columns at a time.
      for (int64_t d0 = 0; d0 < D; d0 += kScoreTiles * kTileRows) {
        amx::zero_sums<2, 2>();
        four_products(pb, kTileValues, v + d0 / kTileRows * kTileValues, kTileValues, D / kTileRows * kTileValues,
                      value_tiles);
        store_four(o + d0, kTileRows, D);
      }
      amx::fence();
      for (int64_t i = 0; i <= last - b * kTileRows; ++i) {
        const int64_t vec = b * kTileRows + i;
        Bf16* dst = out + ((q_start + row_begin + vec / group) * a.num_heads + h * group + vec % group) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = to_bf16(o[i * D + d] * inv[i]);
      }
    }
  }
  _tile_release();
}
#pragma GCC diagnostic pop
#else
bool attention_amx_takes(const PagedAttentionArgs&) { return false; }
void attend_rows_amx(const PagedAttentionArgs&, int32_t, int32_t, int32_t, int32_t, int32_t) {}
#endif

}  // namespace nanovllm
