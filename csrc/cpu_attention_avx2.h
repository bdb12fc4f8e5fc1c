// AVX2 building blocks of the attention kernel's tile path (csrc/cpu_attention_tiles.h), shared by
// the bf16 scores on AVX512-BF16 (csrc/cpu_attention_bf16.h).
#pragma once

#if defined(__x86_64__)

#include <immintrin.h>

#include <cstdint>

#include "cpu_dtype.h"
#include "cpu_isa.h"

namespace nanovllm::avx2 {

NANOVLLM_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
NANOVLLM_AVX2 inline __m256 load8(const Bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The lane sums of a0..a7, in that order.
NANOVLLM_AVX2 inline __m256 sum_lanes8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                                       __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // a0..a3: low | high halves
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

}  // namespace nanovllm::avx2

#endif  // __x86_64__
