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

}  // namespace nanovllm::avx512_bf16
#pragma GCC diagnostic pop

#endif  // __x86_64__
