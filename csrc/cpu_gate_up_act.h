// SiLU(gate) * up of a MoE layer's gate/up product in its packing (cpu_moe.h: each 16-column panel
// holds 8 gate and then 8 up columns), 16 lanes at a time on AVX512-BF16 CPUs: the MoE layer's own
// loop, and the AMX GEMM's epilogue where it writes the activations itself (GemmBf16Args::act).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "cpu_bf16_avx512.h"
#include "cpu_gemm.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace nanovllm {

// SiLU(g) * u as silu_and_mul_panels computes an output: for bf16 activations
// round(round(silu(round(g))) * round(u)), for fp32 ones without the roundings.
template <typename Out>
NANOVLLM_AVX512BF16 [[gnu::always_inline]] inline __m512 act_of(__m512 g, __m512 u) {
  using namespace bf16x16;
  if constexpr (std::is_same_v<Out, float>) {
    return _mm512_mul_ps(silu(g), u);
  } else {
    g = round(g);
    return round(_mm512_mul_ps(round(silu(g)), round(u)));
  }
}

// The first `live` of 16 outputs of act_of<Out> into act.
template <typename Out>
NANOVLLM_AVX512BF16 [[gnu::always_inline]] inline void put_act(Out* act, __m512 v, __mmask16 live) {
  if constexpr (std::is_same_v<Out, float>) {
    _mm512_mask_storeu_ps(act, live, v);
  } else {
    bf16x16::store_rounded(act, v, live);
  }
}

// One row's SiLU(gate) * up of gate/up panels [p0, p1) (h: 8 gate then 8 up columns a panel, in
// fp32) into act (bf16 or fp32 activations), each value as the torch layer computes it:
// silu_and_mul_panels' loop on AVX512-BF16 CPUs (bf16x16's exp and SiLU, vec_exp's steps: the same
// bits), two panels in 16 lanes. In fp32 that loop ran scalar: a tenth of an fp32 MoE prefill on AMX.
template <typename Out>
NANOVLLM_AVX512BF16 void silu_mul_panels_x16(const float* h, Out* act, int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + 2 <= p1; p += 2) {
    // Lanes of 4: gate p, up p, gate p + 1, up p + 1 (two each).
    const __m512 a = _mm512_loadu_ps(h + p * kGemmPanel), b = _mm512_loadu_ps(h + (p + 1) * kGemmPanel);
    put_act(act + p * kGemmPanel / 2, act_of<Out>(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee)),
            bf16x16::kAll);
  }
  if (p < p1) {
    const __m512 a = _mm512_loadu_ps(h + p * kGemmPanel);
    put_act(act + p * kGemmPanel / 2, act_of<Out>(a, _mm512_shuffle_f32x4(a, a, 0xee)), bf16x16::lanes(kGemmPanel / 2));
  }
}

}  // namespace nanovllm
#pragma GCC diagnostic pop
#endif
