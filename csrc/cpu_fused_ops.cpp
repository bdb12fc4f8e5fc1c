#include "cpu_fused_ops.h"

#include "cpu_bf16_avx512.h"
#include "cpu_isa.h"
#include "cpu_math.h"
#include "cpu_parallel.h"

#include <algorithm>
#include <cmath>

namespace nanovllm {
namespace {

// Rows in groups of kNormGroup: their sums of squares, then their 1 / sqrt (the same IEEE operations
// as one row at a time, so the same bits), then their outputs. One row at a time, each row's
// reduction, division and square root ran in series, which short rows do not hide: the q/k norms
// (rows of 64) and rotary of a decode step's 32 tokens took 47 us on a thread, 41 now (bf16 on
// AVX512-BF16, Intel Xeon with AMX).
constexpr int64_t kNormGroup = 16;

// 1 / sqrt(squares / hidden + eps) of a group's rows.
[[gnu::always_inline]] inline void inverse_rms(const float* __restrict squares, int64_t hidden, float eps,
                                               float* __restrict inv) {
#pragma omp simd
  for (int64_t j = 0; j < kNormGroup; ++j) inv[j] = 1.0f / std::sqrt(squares[j] / static_cast<float>(hidden) + eps);
}

// Rows [begin, end) of a: squares(x, res, res_out) gives a row's sum of squares (of x, or of x + res
// rounded, written to res_out, where res is not null), scale(x, out, inv) its output from its input
// (x, or res_out's sum) and 1 / rms.
template <typename T, typename Squares, typename Scale>
[[gnu::always_inline]] inline void rms_norm_groups(const RmsNormArgs& a, int64_t begin, int64_t end,
                                                   const Squares& squares_of, const Scale& scale) {
  const int64_t H = a.hidden;
  const auto x_row = [&a, H](int64_t i) {
    return static_cast<const T*>(a.x) + (i / a.heads) * a.x_stride + (i % a.heads) * H;
  };
  alignas(64) float squares[kNormGroup] = {}, inv[kNormGroup];
  for (int64_t g = begin; g < end; g += kNormGroup) {
    const int64_t rows = std::min(kNormGroup, end - g);
    for (int64_t i = g; i < g + rows; ++i) {
      squares[i - g] = a.residual == nullptr ? squares_of(x_row(i), nullptr, nullptr)
                                             : squares_of(x_row(i), static_cast<const T*>(a.residual) + i * H,
                                                          static_cast<T*>(a.residual_out) + i * H);
    }
    inverse_rms(squares, H, a.eps, inv);
    for (int64_t i = g; i < g + rows; ++i) {
      scale(a.residual == nullptr ? x_row(i) : static_cast<const T*>(a.residual_out) + i * H,
            static_cast<T*>(a.out) + i * H, inv[i - g]);
    }
  }
}

template <typename T>
[[gnu::always_inline]] inline void rms_norm_rows(const RmsNormArgs& a, int64_t begin, int64_t end) {
  const int64_t H = a.hidden;
  const T* w = static_cast<const T*>(a.weight);
  const auto squares = [H](const T* __restrict x, const T* __restrict res, T* __restrict res_out) {
    float sum = 0.0f;
    if (res != nullptr) {
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < H; ++d) {
        const float r = round_to<T>(widen(x[d]) + widen(res[d]));
        narrow_rounded(r, res_out + d);
        sum += r * r;
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < H; ++d) sum += widen(x[d]) * widen(x[d]);
    }
    return sum;
  };
  const auto scale = [H, w](const T* __restrict x, T* __restrict out, float inv) {
#pragma omp simd
    for (int64_t d = 0; d < H; ++d) narrow(widen(w[d]) * round_to<T>(widen(x[d]) * inv), out + d);
  };
  rms_norm_groups<T>(a, begin, end, squares, scale);
}

#if defined(__x86_64__)
// rms_norm_rows for bf16 on AVX512-BF16 CPUs: the same roundings, done by vcvtneps2bf16 (bf16x16);
// the sum of squares in 16 lanes, so its last bits (and now and then an output's) may differ.
NANOVLLM_AVX512BF16 void rms_norm_bf16x16(const RmsNormArgs& a, int64_t begin, int64_t end) {
  using namespace bf16x16;
  const int64_t H = a.hidden;
  const Bf16* w = static_cast<const Bf16*>(a.weight);
  const auto squares = [H](const Bf16* x, const Bf16* res, Bf16* res_out) NANOVLLM_AVX512BF16 {
    __m512 sum = _mm512_setzero_ps();
    if (res != nullptr) {
      for (int64_t d = 0; d < H; d += 16) {
        const __mmask16 live = lanes(H - d);
        const __m512 r = round(_mm512_add_ps(load(x + d, live), load(res + d, live)));
        store_rounded(res_out + d, r, live);
        sum = _mm512_fmadd_ps(r, r, sum);
      }
    } else {
      for (int64_t d = 0; d < H; d += 16) {
        const __m512 v = load(x + d, lanes(H - d));
        sum = _mm512_fmadd_ps(v, v, sum);
      }
    }
    return bf16x16::sum(sum);
  };
  const auto scale = [H, w](const Bf16* x, Bf16* out, float inv) NANOVLLM_AVX512BF16 {
    const __m512 by = _mm512_set1_ps(inv);
    for (int64_t d = 0; d < H; d += 16) {
      const __mmask16 live = lanes(H - d);
      store(out + d, _mm512_mul_ps(load(w + d, live), round(_mm512_mul_ps(load(x + d, live), by))), live);
    }
  };
  rms_norm_groups<Bf16>(a, begin, end, squares, scale);
}
#endif

template <typename T>
[[gnu::always_inline]] inline void silu_and_mul_rows(const SiluAndMulArgs& a, int64_t begin, int64_t end) {
  const int64_t inner = a.inner;  // a local: the stores below could alias `a` as far as the compiler knows
  for (int64_t i = begin; i < end; ++i) {
    const T* __restrict gate = static_cast<const T*>(a.x) + i * a.x_stride;
    const T* __restrict up = gate + inner;
    T* __restrict out = static_cast<T*>(a.out) + i * inner;
#pragma omp simd
    for (int64_t d = 0; d < inner; ++d) {
      const float g = widen(gate[d]);
      narrow(round_to<T>(silu(g)) * widen(up[d]), out + d);
    }
  }
}


template <typename T>
[[gnu::always_inline]] inline void rotate_rows(T* x, int64_t heads, int64_t half, const float* __restrict cs,
                                               const float* __restrict sn) {
  for (int64_t h = 0; h < heads; ++h, x += 2 * half) {
    T* __restrict x1 = x;
    T* __restrict x2 = x + half;
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
      const float a = widen(x1[j]), b = widen(x2[j]);
      const float r1 = round_to<T>(round_to<T>(a * cs[j]) - round_to<T>(b * sn[j]));
      const float r2 = round_to<T>(round_to<T>(b * cs[j]) + round_to<T>(a * sn[j]));
      narrow_rounded(r1, x1 + j);
      narrow_rounded(r2, x2 + j);
    }
  }
}

// Token i's cos and sin of its half head_dim angles, rounded to T first, as the torch layer casts
// them to q's dtype.
template <typename T>
[[gnu::always_inline]] inline void rotary_angles(const RotaryArgs& a, int64_t i, float* cs, float* sn) {
  const float pos = static_cast<float>(a.positions[i]);
  for (int64_t j = 0; j < a.head_dim / 2; ++j) {
    const float angle = pos * a.inv_freq[j];
    cs[j] = round_to<T>(std::cos(angle));
    sn[j] = round_to<T>(std::sin(angle));
  }
}

// Tokens [begin, end), each token's q and k heads turned by Rotate (rotate_rows or a vector form).
template <typename T, auto Rotate = rotate_rows<T>>
[[gnu::always_inline]] inline void rotary_rows(const RotaryArgs& a, int64_t begin, int64_t end) {
  const int64_t half = a.head_dim / 2;
  float own[kMaxRotaryDim];
  for (int64_t i = begin; i < end; ++i) {
    const float* cs = own;
    if (a.angles != nullptr) {
      cs = a.angles + i * a.head_dim;
    } else {
      rotary_angles<T>(a, i, own, own + half);
    }
    Rotate(static_cast<T*>(a.q) + i * a.q_stride, a.q_heads, half, cs, cs + half);
    Rotate(static_cast<T*>(a.k) + i * a.k_stride, a.k_heads, half, cs, cs + half);
  }
}

#if defined(__x86_64__)
// rotate_rows for bf16 on AVX512-BF16 CPUs: the same roundings.
NANOVLLM_AVX512BF16 void rotate_rows_bf16x16(Bf16* x, int64_t heads, int64_t half, const float* cs,
                                               const float* sn) {
  using namespace bf16x16;
  for (int64_t h = 0; h < heads; ++h, x += 2 * half) {
    for (int64_t j = 0; j < half; j += 16) {
      const __mmask16 live = lanes(half - j);
      const __m512 a = load(x + j, live), b = load(x + half + j, live);
      const __m512 c = _mm512_maskz_loadu_ps(live, cs + j), s = _mm512_maskz_loadu_ps(live, sn + j);
      store_rounded(x + j, round(_mm512_sub_ps(round(_mm512_mul_ps(a, c)), round(_mm512_mul_ps(b, s)))), live);
      store_rounded(x + half + j, round(_mm512_add_ps(round(_mm512_mul_ps(b, c)), round(_mm512_mul_ps(a, s)))),
                    live);
    }
  }
}

NANOVLLM_AVX512BF16 void rotary_bf16x16(const RotaryArgs& a, int64_t begin, int64_t end) {
  rotary_rows<Bf16, rotate_rows_bf16x16>(a, begin, end);
}

// silu_and_mul_rows for bf16 on AVX512-BF16 CPUs: the same roundings.
NANOVLLM_AVX512BF16 void silu_bf16x16(const SiluAndMulArgs& a, int64_t begin, int64_t end) {
  using namespace bf16x16;
  const int64_t inner = a.inner;
  for (int64_t i = begin; i < end; ++i) {
    const Bf16* gate = static_cast<const Bf16*>(a.x) + i * a.x_stride;
    const Bf16* up = gate + inner;
    Bf16* out = static_cast<Bf16*>(a.out) + i * inner;
    for (int64_t d = 0; d < inner; d += 16) {
      const __mmask16 live = lanes(inner - d);
      store(out + d, _mm512_mul_ps(round(silu(load(gate + d, live))), load(up + d, live)), live);
    }
  }
}
#endif

NANOVLLM_CLONES void rotary_f32(const RotaryArgs& a, int64_t b, int64_t e) { rotary_rows<float>(a, b, e); }
NANOVLLM_CLONES void rotary_bf16(const RotaryArgs& a, int64_t b, int64_t e) { rotary_rows<Bf16>(a, b, e); }
NANOVLLM_CLONES void rms_norm_f32(const RmsNormArgs& a, int64_t b, int64_t e) { rms_norm_rows<float>(a, b, e); }
NANOVLLM_CLONES void rms_norm_bf16(const RmsNormArgs& a, int64_t b, int64_t e) { rms_norm_rows<Bf16>(a, b, e); }
NANOVLLM_CLONES void silu_f32(const SiluAndMulArgs& a, int64_t b, int64_t e) { silu_and_mul_rows<float>(a, b, e); }
NANOVLLM_CLONES void silu_bf16(const SiluAndMulArgs& a, int64_t b, int64_t e) { silu_and_mul_rows<Bf16>(a, b, e); }

using RmsNormRows = void (*)(const RmsNormArgs&, int64_t, int64_t);
using RotaryRows = void (*)(const RotaryArgs&, int64_t, int64_t);

RmsNormRows rms_norm_rows_for(CpuDtype dtype) {
#if defined(__x86_64__)
  if (dtype == CpuDtype::kBFloat16 && has_avx512_bf16()) return rms_norm_bf16x16;
#endif
  return dtype == CpuDtype::kBFloat16 ? rms_norm_bf16 : rms_norm_f32;
}

RotaryRows rotary_rows_for(CpuDtype dtype) {
#if defined(__x86_64__)
  if (dtype == CpuDtype::kBFloat16 && has_avx512_bf16()) return rotary_bf16x16;
#endif
  return dtype == CpuDtype::kBFloat16 ? rotary_bf16 : rotary_f32;
}

}  // namespace

void rms_norm(const RmsNormArgs& a, int num_threads) {
  const RmsNormRows run = rms_norm_rows_for(a.dtype);
  parallel_rows(a.rows, a.hidden, num_threads, [&a, run](int64_t b, int64_t e) { run(a, b, e); });
}

void silu_and_mul(const SiluAndMulArgs& a, int num_threads) {
  auto run = a.dtype == CpuDtype::kBFloat16 ? silu_bf16 : silu_f32;
#if defined(__x86_64__)
  if (a.dtype == CpuDtype::kBFloat16 && has_avx512_bf16()) run = silu_bf16x16;
#endif
  parallel_rows(a.rows, a.inner, num_threads, [&a, run](int64_t b, int64_t e) { run(a, b, e); });
}

void rotary_angles(const RotaryArgs& a, float* out, int num_threads) {
  const int64_t half = a.head_dim / 2;
  parallel_rows(a.tokens, 8 * a.head_dim, num_threads, [&a, out, half](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* cs = out + i * a.head_dim;
      if (a.dtype == CpuDtype::kBFloat16) {
        rotary_angles<Bf16>(a, i, cs, cs + half);
      } else {
        rotary_angles<float>(a, i, cs, cs + half);
      }
    }
  });
}

void rotary(const RotaryArgs& a, int num_threads) {
  const RotaryRows run = rotary_rows_for(a.dtype);
  parallel_rows(a.tokens, (a.q_heads + a.k_heads) * a.head_dim, num_threads,
                [&a, run](int64_t b, int64_t e) { run(a, b, e); });
}

void norm_rotary(const RmsNormArgs& q_norm, const RmsNormArgs& k_norm, const RotaryArgs& r, int num_threads) {
  const RmsNormRows norm = rms_norm_rows_for(r.dtype);
  const RotaryRows rotate = rotary_rows_for(r.dtype);
  const int64_t qh = r.q_heads, kh = r.k_heads;
  parallel_rows(r.tokens, (qh + kh) * r.head_dim, num_threads, [&, norm, rotate](int64_t begin, int64_t end) {
    for (int64_t t0 = begin; t0 < end; t0 += kNormRotaryTokens) {
      const int64_t t1 = std::min(end, t0 + kNormRotaryTokens);
      norm(q_norm, t0 * qh, t1 * qh);
      norm(k_norm, t0 * kh, t1 * kh);
      rotate(r, t0, t1);
    }
  });
}

}  // namespace nanovllm
