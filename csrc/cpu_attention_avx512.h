// The attention kernel's tiles with AVX-512 (csrc/cpu_attention.cpp takes them at run time when the
// CPU has AVX-512F, head_dim is a multiple of 16 and block_size of 8).
//
// Why not the AVX2 tiles on these CPUs: those hold eight floats a register, so a head of 64 takes
// eight loads and eight FMAs a key for each query vector, and a bf16 row two instructions to widen
// each eight; the value pass, a third of a decode step's attention, ran at ~20 GB/s of a ~45 GB/s
// machine with the rows in cache (Zen 5). Sixteen floats a register halve both, and the scores of
// two query vectors share each key's loads (a GQA group's vectors read the same keys).
#pragma once

#if defined(__x86_64__)

#include <immintrin.h>

#include <cstdint>

#include "cpu_attention_avx2.h"
#include "cpu_dtype.h"

#define NANOVLLM_AVX512_ATTN __attribute__((target("avx2,fma,avx512f")))

// GCC 12's AVX-512 extracts and widenings start from _mm*_undefined_*(), which -Wuninitialized
// reports once inlined (a known false positive), as in cpu_attention_bf16.h.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace nanovllm::avx512 {

NANOVLLM_AVX512_ATTN inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
NANOVLLM_AVX512_ATTN inline __m512 load16(const Bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The lane sums of acc[0..7], in that order.
NANOVLLM_AVX512_ATTN inline __m256 sum_lanes8(const __m512* acc) {
  __m256 half[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    half[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)));
  }
  return avx2::sum_lanes8(half[0], half[1], half[2], half[3], half[4], half[5], half[6], half[7]);
}

// out[v * out_stride + j] = q_v . k_j for NV query vectors (q + v * q_stride) and the eight keys k,
// k + stride, ..., k + 7 * stride (D floats each, D a multiple of 16): each key chunk is loaded once
// for the NV vectors.
template <int NV, typename T>
NANOVLLM_AVX512_ATTN inline void dot8(const float* __restrict q, int64_t q_stride, const T* __restrict k,
                                      int64_t stride, int D, float* __restrict out, int64_t out_stride) {
  __m512 acc[NV][8];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
    for (int j = 0; j < 8; ++j) acc[v][j] = _mm512_setzero_ps();
  }
  for (int d = 0; d < D; d += 16) {
    __m512 kv[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) kv[j] = load16(k + j * stride + d);
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const __m512 qv = _mm512_loadu_ps(q + v * q_stride + d);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[v][j] = _mm512_fmadd_ps(qv, kv[j], acc[v][j]);
    }
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + v * out_stride, sum_lanes8(acc[v]));
}

// acc[v][c * 16 ..] += sum over keys i < n of p[v * p_stride + i] * x_i[c * 16 ..] for NV vectors and
// W chunks of sixteen columns, accumulators held in registers across the keys (x_i = x + i * x_stride).
template <int NV, int W, typename T>
NANOVLLM_AVX512_ATTN inline void weighted_rows(const float* __restrict p, int64_t p_stride, const T* __restrict x,
                                               int64_t x_stride, int n, float* __restrict acc, int64_t acc_stride) {
  __m512 a[NV][W];
  for (int v = 0; v < NV; ++v)
    for (int c = 0; c < W; ++c) a[v][c] = _mm512_loadu_ps(acc + v * acc_stride + c * 16);
  for (int i = 0; i < n; ++i, x += x_stride) {
    __m512 pv[NV];
    for (int v = 0; v < NV; ++v) pv[v] = _mm512_set1_ps(p[v * p_stride + i]);
    for (int c = 0; c < W; ++c) {
      const __m512 xv = load16(x + c * 16);
      for (int v = 0; v < NV; ++v) a[v][c] = _mm512_fmadd_ps(pv[v], xv, a[v][c]);
    }
  }
  for (int v = 0; v < NV; ++v)
    for (int c = 0; c < W; ++c) _mm512_storeu_ps(acc + v * acc_stride + c * 16, a[v][c]);
}

// All D columns (D % 16 == 0) for NV vectors: at most 16 accumulators at a time (128 columns for one
// or two vectors, 64 for three or four), the rest sixteen at a time.
template <int NV, typename T>
NANOVLLM_AVX512_ATTN inline void weighted_rows(const float* __restrict p, int64_t p_stride, const T* __restrict x,
                                               int64_t x_stride, int n, int D, float* __restrict acc,
                                               int64_t acc_stride) {
  int d = 0;
  if constexpr (NV <= 2) {
    for (; d + 128 <= D; d += 128) weighted_rows<NV, 8>(p, p_stride, x + d, x_stride, n, acc + d, acc_stride);
  }
  for (; d + 64 <= D; d += 64) weighted_rows<NV, 4>(p, p_stride, x + d, x_stride, n, acc + d, acc_stride);
  for (; d < D; d += 16) weighted_rows<NV, 1>(p, p_stride, x + d, x_stride, n, acc + d, acc_stride);
}

}  // namespace nanovllm::avx512
#pragma GCC diagnostic pop

#endif  // __x86_64__
