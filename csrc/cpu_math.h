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

inline float vec_exp(float x) {
  // Below -87.3 the result would be denormal; callers (softmax, sigmoid) lose nothing by 1e-38.
  x = std::max(-87.3f, std::min(x, 88.7f));
  // Round to nearest by the 1.5 * 2^23 trick: plain adds, where floor() kept the loop scalar.
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;  // ln2 in two parts: r exact enough
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23);
}

// SiLU (x * sigmoid(x)) as the SiLU-and-mul layers compute it, dense and per expert.
inline float silu(float x) { return x / (1.0f + vec_exp(-x)); }

}  // namespace nanovllm
