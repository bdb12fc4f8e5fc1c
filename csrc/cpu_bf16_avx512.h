// bf16 <-> fp32 on AVX512-BF16 CPUs, 16 values at a time, with to_bf16's bits (csrc/cpu_dtype.h),
// and the vector math of the bf16 loops that use them.
// vcvtneps2bf16 rounds to nearest even and quiets a NaN as to_bf16 does, but reads a subnormal
// input as zero: lanes holding one (rare in activations) take to_bf16's integer rounding instead.
// The emulated rounding costs eight vector operations a value, and a bf16 prefill's RMSNorms,
// rotary embeddings, SiLU-and-mul and products rounded to bf16 spent 9-14% of its time there
// (Intel Xeon with AMX).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#include "cpu_dtype.h"
#include "cpu_math.h"

// The target of the AVX512-BF16 code: these loops and the quantized GEMM's vdpbf16ps path.
#define NANOVLLM_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))

// GCC 12's AVX-512 shifts, conversions and shuffles start from _mm*_undefined_*(), which
// -Wuninitialized reports once inlined (a known false positive), as in cpu_attention_bf16.h.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace nanovllm::bf16x16 {

inline constexpr __mmask16 kAll = 0xffff;

// x rounded to bf16, as to_bf16 rounds each value.
NANOVLLM_AVX512BF16 [[gnu::always_inline]] inline __m256i narrow(__m512 x) {
  __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  // Exponent 0, mantissa not: tested on the bits (vfpclassps would follow MXCSR.DAZ).
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 subnormal = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000)) &
                              _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x007fffff));
  if (__builtin_expect(subnormal != 0, 0)) {
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    h = _mm256_mask_mov_epi16(h, subnormal, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
  return h;
}

NANOVLLM_AVX512BF16 [[gnu::always_inline]] inline __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x as stored in bf16 (round_to<Bf16>).
NANOVLLM_AVX512BF16 [[gnu::always_inline]] inline __m512 round(__m512 x) { return widen(narrow(x)); }

// The first `live` of 16 bf16 values at p, widened (the rest 0).
NANOVLLM_AVX512BF16 [[gnu::always_inline]] inline __m512 load(const Bf16* p, __mmask16 live = kAll) {
  return widen(_mm256_maskz_loadu_epi16(live, p));
}

// x rounded into the first `live` of 16 bf16 values at p.
NANOVLLM_AVX512BF16 [[gnu::always_inline]] inline void store(Bf16* p, __m512 x, __mmask16 live = kAll) {
  _mm256_mask_storeu_epi16(p, live, narrow(x));
}

// x, already a bf16 value (round's result), into the first `live` of 16 bf16 values at p.
NANOVLLM_AVX512BF16 [[gnu::always_inline]] inline void store_rounded(Bf16* p, __m512 x, __mmask16 live = kAll) {
  _mm256_mask_storeu_epi16(p, live, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}

NANOVLLM_AVX512BF16 [[gnu::always_inline]] inline float sum(__m512 x) { return _mm512_reduce_add_ps(x); }

// vec_exp (csrc/cpu_math.h) on 16 lanes: the same steps.
NANOVLLM_AVX512BF16 [[gnu::always_inline]] inline __m512 exp(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(kExpMin), _mm512_min_ps(x, _mm512_set1_ps(kExpMax)));
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), magic), magic);
  const __m512 r =
      _mm512_fmadd_ps(k, _mm512_set1_ps(kLn2Low), _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2High), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}

// silu (csrc/cpu_math.h) on 16 lanes.
NANOVLLM_AVX512BF16 [[gnu::always_inline]] inline __m512 silu(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

// The lanes of a 16-value step that hold the first n values (n may exceed 16).
[[gnu::always_inline]] inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? kAll : static_cast<__mmask16>((1u << n) - 1);
}

}  // namespace nanovllm::bf16x16
#pragma GCC diagnostic pop

#endif
