// Shared pieces of the CUDA kernels: element types, 16-byte vectors, cp.async.
//
// Nothing here depends on torch or Python; the kernels see raw pointers, sizes and strides (in
// elements) and the launchers return a cudaError_t for the bindings to turn into an exception.
#pragma once

#include <cstdint>

#ifdef NANOVLLM_KERNEL_EMULATION
// tests/kernel_emulation/: the same kernel source compiled by the host compiler, one std::thread
// per CUDA thread, so the CPU-only test suite can execute the kernels' logic. It provides the
// CUDA types and intrinsics used below, cp.async as a plain copy, and NANOVLLM_DYNAMIC_SMEM.
#include "cuda_emulation.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

// The kernel's dynamic shared memory (sized at launch).
#define NANOVLLM_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace nanovllm {

// 16 bytes of T: the unit of every global and shared memory access in the attention kernel.
template <typename T>
struct Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
};

// Unpack 16 bytes of T into fp32 (the kernels accumulate in fp32 whatever the cache dtype).
__device__ __forceinline__ void to_float(const uint4& raw, float (&out)[4], float) {
  out[0] = __uint_as_float(raw.x);
  out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z);
  out[3] = __uint_as_float(raw.w);
}

__device__ __forceinline__ void to_float(const uint4& raw, float (&out)[8], __half) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void to_float(const uint4& raw, float (&out)[8], __nv_bfloat16) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <typename T>
__device__ __forceinline__ float load_float(const T* p);
template <>
__device__ __forceinline__ float load_float<float>(const float* p) { return *p; }
template <>
__device__ __forceinline__ float load_float<__half>(const __half* p) { return __half2float(*p); }
template <>
__device__ __forceinline__ float load_float<__nv_bfloat16>(const __nv_bfloat16* p) { return __bfloat162float(*p); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

#ifndef NANOVLLM_KERNEL_EMULATION
// cp.async (sm_80+): a 16-byte global -> shared copy that bypasses registers and L1 (.cg), so a
// whole tile of K/V can be in flight while the CTA computes on the previous one. `bytes` is 16 or
// 0; with 0 nothing is read and the 16 shared bytes are zero-filled, which is how tokens past the
// end of a context become harmless zeros (never stale NaNs) without a branch around the copy.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most `N` of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#endif  // NANOVLLM_KERNEL_EMULATION

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace nanovllm
