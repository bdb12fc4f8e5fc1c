// Just enough of CUDA to run kernels/ on the CPU, for the test-suite on machines without a GPU.
//
// The kernel source is compiled unchanged by the host compiler (with NANOVLLM_KERNEL_EMULATION
// defined); harness.cpp runs one CTA at a time with one std::thread per CUDA thread:
// __syncthreads is a std::barrier over the CTA, warp shuffles exchange values through a per-warp
// buffer between two barriers, shared memory is a static buffer (CTAs never run concurrently), and
// cp.async is a plain 16-byte copy (or zero-fill), i.e. it completes at once: the emulation checks
// the kernels' indexing and arithmetic, not their timing or the async-copy pipeline itself.
#pragma once

#include <algorithm>
#include <barrier>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static  // one instance per kernel instantiation: CTAs run one at a time

using std::max;
using std::min;

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct uint2 {
  unsigned x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

using cudaStream_t = void*;
enum cudaError_t : int { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMisalignedAddress = 716 };

namespace emu {
// Set by the harness for each emulated thread.
inline thread_local dim3 thread_idx, block_idx;
inline dim3 block_dim, grid_dim;
inline std::barrier<>* block_barrier = nullptr;
struct Warp {
  std::barrier<> bar{32};
  float vals[32];
};
inline thread_local Warp* warp = nullptr;
alignas(16) inline unsigned char dynamic_smem[256 * 1024];
}  // namespace emu

#define threadIdx (emu::thread_idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define NANOVLLM_DYNAMIC_SMEM(name) unsigned char* name = emu::dynamic_smem

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float x, int lane_mask) {
  emu::Warp& w = *emu::warp;
  const int lane = static_cast<int>(threadIdx.x % 32);
  w.bar.arrive_and_wait();  // everyone is done reading the previous exchange
  w.vals[lane] = x;
  w.bar.arrive_and_wait();
  return w.vals[lane ^ lane_mask];
}

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp16 through the compiler's _Float16, bf16 as the top 16 bits of an fp32 (round to nearest even).
struct __half {
  uint16_t bits;
};
struct __half2 {
  __half x, y;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float x) {
  const _Float16 f = static_cast<_Float16>(x);
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }

inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 b) { return {__bfloat162float(b.x), __bfloat162float(b.y)}; }

namespace nanovllm {
// cp.async, completing immediately.
inline void cp_async_16(void* smem, const void* gmem, int bytes) {
  if (bytes == 16) {
    std::memcpy(smem, gmem, 16);
  } else {
    std::memset(smem, 0, 16);
  }
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}
}  // namespace nanovllm
