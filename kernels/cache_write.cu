// Cache write: scatter each new token's K and V rows into its slot of the paged cache.
//
// Token i goes to block slot_mapping[i] / block_size, offset slot_mapping[i] % block_size; a
// negative slot (padding, or the all -1 mapping of the memory-profiling forward) skips the token.
// The copy is a pure move of bytes, so one kernel serves fp16, bf16 and fp32: it is templated only
// on the access width, 16 bytes whenever pointers and strides allow (always for head_dim * size
// a multiple of 16 and tensors from torch's allocator), narrower otherwise.
#include "common.cuh"
#include "launchers.h"

namespace nanovllm {
namespace {

constexpr int kCacheWriteThreads = 128;

// One CTA per token: its kv_heads * head_dim elements of K and of V, `sizeof(Word)` bytes per access.
template <typename Word>
__global__ void __launch_bounds__(kCacheWriteThreads)
    cache_write_kernel(const char* __restrict__ key, const char* __restrict__ value, char* __restrict__ k_cache,
                       char* __restrict__ v_cache, const int32_t* __restrict__ slot_mapping, int num_kv_heads,
                       int words_per_head,  // head_dim * elem_size / sizeof(Word)
                       int64_t key_stride_token, int64_t key_stride_head, int64_t value_stride_token,
                       int64_t value_stride_head, int64_t k_stride_block, int64_t k_stride_slot,
                       int64_t k_stride_head, int64_t v_stride_block, int64_t v_stride_slot, int64_t v_stride_head,
                       int block_size) {
  // Strides arrive in bytes here (the launcher converts), so Word-typed pointer math stays simple.
  const int64_t token = blockIdx.x;
  const int32_t slot = slot_mapping[token];
  if (slot < 0) return;
  const int64_t block = slot / block_size;
  const int64_t offset = slot % block_size;
  const char* k_src = key + token * key_stride_token;
  const char* v_src = value + token * value_stride_token;
  char* k_dst = k_cache + block * k_stride_block + offset * k_stride_slot;
  char* v_dst = v_cache + block * v_stride_block + offset * v_stride_slot;
  const int total = num_kv_heads * words_per_head;
  for (int i = threadIdx.x; i < total; i += blockDim.x) {
    const int h = i / words_per_head;
    const int w = i - h * words_per_head;
    const Word k = reinterpret_cast<const Word*>(k_src + h * key_stride_head)[w];
    const Word v = reinterpret_cast<const Word*>(v_src + h * value_stride_head)[w];
    reinterpret_cast<Word*>(k_dst + h * k_stride_head)[w] = k;
    reinterpret_cast<Word*>(v_dst + h * v_stride_head)[w] = v;
  }
}

#ifndef NANOVLLM_KERNEL_EMULATION  // the emulator launches the kernel itself
template <typename Word>
int launch(const CacheWriteParams& p, cudaStream_t stream) {
  const int64_t es = p.elem_size;
  const int words_per_head = static_cast<int>(p.head_dim * es / static_cast<int64_t>(sizeof(Word)));
  const int total = static_cast<int>(p.num_kv_heads) * words_per_head;
  // Small rows (tiny test models) do not need 128 threads; keep whole warps.
  const int threads = total >= kCacheWriteThreads ? kCacheWriteThreads : ((total + 31) / 32) * 32;
  cache_write_kernel<Word><<<static_cast<unsigned>(p.num_tokens), threads, 0, stream>>>(
      static_cast<const char*>(p.key), static_cast<const char*>(p.value), static_cast<char*>(p.k_cache),
      static_cast<char*>(p.v_cache), p.slot_mapping, static_cast<int>(p.num_kv_heads), words_per_head,
      p.key_stride_token * es, p.key_stride_head * es, p.value_stride_token * es, p.value_stride_head * es,
      p.k_stride_block * es, p.k_stride_slot * es, p.k_stride_head * es, p.v_stride_block * es,
      p.v_stride_slot * es, p.v_stride_head * es, static_cast<int>(p.block_size));
  return static_cast<int>(cudaGetLastError());
}
#endif

// The widest access (16, 8, 4 or 2 bytes) that every address the kernel forms is aligned to.
int access_width(const CacheWriteParams& p) {
  const int64_t es = p.elem_size;
  uint64_t bits = reinterpret_cast<uintptr_t>(p.key) | reinterpret_cast<uintptr_t>(p.value) |
                  reinterpret_cast<uintptr_t>(p.k_cache) | reinterpret_cast<uintptr_t>(p.v_cache);
  for (int64_t s : {p.head_dim, p.key_stride_token, p.key_stride_head, p.value_stride_token, p.value_stride_head,
                    p.k_stride_block, p.k_stride_slot, p.k_stride_head, p.v_stride_block, p.v_stride_slot,
                    p.v_stride_head}) {
    bits |= static_cast<uint64_t>(s * es);
  }
  for (int width : {16, 8, 4, 2}) {
    if ((bits & static_cast<uint64_t>(width - 1)) == 0) return width;
  }
  return 1;
}

}  // namespace

#ifndef NANOVLLM_KERNEL_EMULATION
int launch_cache_write(const CacheWriteParams& p, void* stream_ptr) {
  if (p.num_tokens <= 0) return cudaSuccess;
  if (p.num_tokens > 0x7fffffff || p.num_kv_heads <= 0 || p.head_dim <= 0 || p.block_size <= 0 ||
      (p.elem_size != 2 && p.elem_size != 4) || p.num_kv_heads * p.head_dim * p.elem_size > (1 << 30)) {
    return cudaErrorInvalidValue;
  }
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  switch (access_width(p)) {
    case 16: return launch<uint4>(p, stream);
    case 8: return launch<uint2>(p, stream);
    case 4: return launch<uint32_t>(p, stream);
    case 2: return launch<uint16_t>(p, stream);
    default: return cudaErrorMisalignedAddress;
  }
}
#endif

}  // namespace nanovllm
