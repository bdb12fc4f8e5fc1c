// The attention kernel's score loop on AVX512-BF16, for bf16 caches (csrc/cpu_attention.cpp takes
// it at run time when the CPU has the instructions and head_dim is a multiple of 32).
//
// Why: the AVX2 loop widens every key element to fp32 (two instructions a load) and multiplies
// eight lanes at a time, ~400 cycles a key for 16 query heads of 64 on Zen 4, where the scores were
// ~60% of a decode step's attention. vdpbf16ps multiplies the bf16 query and key pairs as stored,
// 32 elements an instruction, with fp32 sums: the products are those of the widened values
// (a bf16 x bf16 product is exact in fp32); the sums round in another order, and the instruction
// treats denormal inputs as zero.
#pragma once

#if defined(__x86_64__)

#include <immintrin.h>

#include <cstdint>

#include "cpu_attention_avx2.h"
#include "cpu_dtype.h"

#define NANOVLLM_AVX512_BF16_ATTN __attribute__((target("avx2,fma,avx512f,avx512bf16")))

// GCC 12's AVX-512 extracts start from _mm256_undefined_*(), which -Wuninitialized reports once
// inlined (a known false positive), as in cpu_gemm_quant.cpp.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace nanovllm::avx512_bf16 {

// The lane sums of acc[0..7], in that order.
NANOVLLM_AVX512_BF16_ATTN inline __m256 sum_lanes8(const __m512* acc) {
  __m256 half[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    half[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)));
  }
  return avx2::sum_lanes8(half[0], half[1], half[2], half[3], half[4], half[5], half[6], half[7]);
}

// out[j] = scale * (q . k_j) for the eight keys k, k + stride, ..., k + 7 * stride; q and the keys
// bf16, D a multiple of 32.
NANOVLLM_AVX512_BF16_ATTN inline void dot8(const Bf16* __restrict q, const Bf16* __restrict k, int64_t stride, int D,
                                           float scale, float* __restrict out) {
  __m512 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512(k + j * stride + d));
    }
  }
  _mm256_storeu_ps(out, _mm256_mul_ps(sum_lanes8(acc), _mm256_set1_ps(scale)));
}

// Lane i of the result: the sum of x[i]'s sixteen lanes. Halves, then quarters, then pairs of lanes
// are added across accumulators (31 shuffles and 15 adds for the 16 sums, where one transpose and
// add per eight took 8 extracts and 6 three-uop hadds).
NANOVLLM_AVX512_BF16_ATTN inline __m512 sum_lanes16(const __m512 (&x)[16]) {
  __m512 y[8], z[4];
  for (int i = 0; i < 8; ++i) {  // y[i]: 256-bit halves [x[i] | x[i + 8]], each folded to 8 lanes
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[i], x[i + 8], 0x44), _mm512_shuffle_f32x4(x[i], x[i + 8], 0xee));
  }
  for (int i = 0; i < 4; ++i) {  // z[i]: 128-bit lanes [x[i], x[i + 8], x[i + 4], x[i + 12]], 4 lanes each
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[i], y[i + 4], 0x88), _mm512_shuffle_f32x4(y[i], y[i + 4], 0xdd));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[2]))),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(z[0]), _mm512_castps_pd(z[2]))));
  const __m512 w1 = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(z[1]), _mm512_castps_pd(z[3]))),
                                  _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(z[1]), _mm512_castps_pd(z[3]))));
  // Lane 4k + p of r: (z0, z2, z1, z3)[p]'s source in 128-bit lane k, i.e. x[(0, 8, 4, 12)[k] + (0, 2, 1, 3)[p]].
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w0, w1, 0x88), _mm512_shuffle_ps(w0, w1, 0xdd));
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, r);
}

// out0[j] = scale * (q0 . k_j) and out1[j] = scale * (q1 . k_j) for the eight keys k, k + stride, ...,
// k + 7 * stride: two query vectors (a GQA group's) on each key load (dot8 loads each key once per
// vector). q0, q1 and the keys bf16, D a multiple of 32; step() before each key load, 64 bytes (the
// caller's prefetch feed).
template <typename Step>
NANOVLLM_AVX512_BF16_ATTN inline void dot8x2(const Bf16* __restrict q0, const Bf16* __restrict q1,
                                             const Bf16* __restrict k, int64_t stride, int D, float scale,
                                             float* __restrict out0, float* __restrict out1, Step&& step) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 32) {
    const __m512bh a = (__m512bh)_mm512_loadu_si512(q0 + d), b = (__m512bh)_mm512_loadu_si512(q1 + d);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      step();
      const __m512bh kj = (__m512bh)_mm512_loadu_si512(k + j * stride + d);
      acc[j] = _mm512_dpbf16_ps(acc[j], a, kj);
      acc[8 + j] = _mm512_dpbf16_ps(acc[8 + j], b, kj);
    }
  }
  const __m512 s = _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(scale));
  _mm256_storeu_ps(out0, _mm512_castps512_ps256(s));
  _mm256_storeu_ps(out1, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
}

}  // namespace nanovllm::avx512_bf16
#pragma GCC diagnostic pop

#endif  // __x86_64__
