// exp for the CPU kernels' vector loops. glibc declares its vector expf only under -ffast-math, so
// std::exp in an `omp simd` loop stays a scalar call per element (measured: SiLU-and-mul 3.7x
// slower than torch's); this one is plain arithmetic the compiler vectorizes (with
// -fno-trapping-math, see CMakeLists.txt). Cephes' expf: a
// degree-7 polynomial on [-ln2/2, ln2/2] times 2^k, within 2 ulp of expf over the clamped range.
#pragma once

#include <bit>
#include <algorithm>
#include <cstdint>

// One copy per instruction set, picked when the library loads: AVX-512, AVX2 + FMA, baseline. The
// functions a marked one calls must be inlined into it (always_inline) to get its instructions.
#define NANOVLLM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

namespace nanovllm {

// exp(x) = 2^k (1 + r + r^2 p(r)), k = x log2(e) rounded, r = x - k ln2 with ln2 in two parts (r
// exact enough), p of degree 5 (kExpPoly, highest first): vec_exp, and the AMX attention's softmax
// in AVX-512 registers (csrc/cpu_attention_amx.cpp).
inline constexpr float kExpMin = -87.3f, kExpMax = 88.7f, kLog2e = 1.44269504088896341f;
inline constexpr float kLn2High = 0.693359375f, kLn2Low = 2.12194440e-4f;  // ln2 = kLn2High - kLn2Low
inline constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                      4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float vec_exp(float x) {
  // Below -87.3 the result would be denormal; callers (softmax, sigmoid) lose nothing by 1e-38.
  x = std::max(kExpMin, std::min(x, kExpMax));
  // Round to nearest by the 1.5 * 2^23 trick: plain adds, where floor() kept the loop scalar.
  const float k = (x * kLog2e + 12582912.0f) - 12582912.0f;
  const float r = x - k * kLn2High + k * kLn2Low;
  float p = kExpPoly[0];
  p = p * r + kExpPoly[1];
  p = p * r + kExpPoly[2];
  p = p * r + kExpPoly[3];
  p = p * r + kExpPoly[4];
  p = p * r + kExpPoly[5];
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23);
}

// SiLU (x * sigmoid(x)) as the SiLU-and-mul layers compute it, dense and per expert.
inline float silu(float x) { return x / (1.0f + vec_exp(-x)); }

}  // namespace nanovllm
