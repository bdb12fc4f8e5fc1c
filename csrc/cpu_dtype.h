// The element types of the CPU kernels (float32, bfloat16) and bf16 <-> float conversion: a bf16
// value is the upper half of an IEEE float.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace nanovllm {

enum class CpuDtype : int32_t { kFloat32 = 0, kBFloat16 = 1 };

using Bf16 = uint16_t;

inline float widen(float x) { return x; }
inline float widen(Bf16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }

// Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays a (quiet) NaN. A
// select, not a branch, so that loops over it vectorize.
inline Bf16 to_bf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<Bf16>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

inline int64_t dtype_bytes(CpuDtype dtype) { return dtype == CpuDtype::kBFloat16 ? sizeof(Bf16) : sizeof(float); }

inline void narrow(float x, float* dst) { *dst = x; }
inline void narrow(float x, Bf16* dst) { *dst = to_bf16(x); }

// x, already a value of dst's type (round_to's result), stored: a bf16's upper half as it is.
// to_bf16 gives the same bits, at eight vector operations an element more.
inline void narrow_rounded(float x, float* dst) { *dst = x; }
inline void narrow_rounded(float x, Bf16* dst) { *dst = static_cast<Bf16>(std::bit_cast<uint32_t>(x) >> 16); }

// n contiguous values converted, as torch's .float() / .to(torch.bfloat16) convert a tensor.
inline void widen_n(const Bf16* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = widen(x[i]);
}
inline void narrow_n(const float* x, Bf16* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(x[i]);
}

// Rows x [m, k] of From, `stride` apart, as rows of To: x itself where the types agree, else
// converted into `storage` (rows k apart). Returns the rows and their stride.
template <typename To, typename From>
std::pair<const To*, int64_t> rows_as(const From* x, int64_t m, int64_t k, int64_t stride, std::vector<To>& storage) {
  if constexpr (std::is_same_v<To, From>) {
    return {x, stride};
  } else {
    storage.resize(m * k);
    for (int64_t r = 0; r < m; ++r) {
      if constexpr (std::is_same_v<To, float>) {
        widen_n(x + r * stride, storage.data() + r * k, k);
      } else {
        narrow_n(x + r * stride, storage.data() + r * k, k);
      }
    }
    return {storage.data(), k};
  }
}

// x as it would be stored in T: rounded to bf16 for T = Bf16, unchanged for float. Mirrors torch,
// which rounds the result of every bf16 op. widen(to_bf16(x)) bit for bit, computed on the float's
// bits in place: no narrowing to 16 bits and back, which vectorized as lane shuffles (the MoE
// layer's SiLU-and-mul and combine in bf16 spent most of their time there).
template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, Bf16>) {
    const uint32_t u = std::bit_cast<uint32_t>(x);
    const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    return std::bit_cast<float>(((u & 0x7fffffffu) > 0x7f800000u ? u | 0x400000u : rounded) & 0xffff0000u);
  } else {
    return x;
  }
}

}  // namespace nanovllm
