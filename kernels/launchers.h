// Host-side entry points of the CUDA kernels, in plain C++ so that bindings.cpp compiles with the
// ordinary host compiler and without CUDA headers. Every launcher returns a cudaError_t as int
// (0 = success: the kernel was queued on `stream`; nothing is synchronized) and never throws.
//
// Pointers are raw device addresses, strides are in elements, `stream` is a cudaStream_t as
// returned by torch.cuda.Stream.cuda_stream. The Python wrappers
// (nanovllm/attention/cuda_ops.py) validate everything a launcher relies on; the launchers
// re-check only what would otherwise make a kernel read or write out of bounds through a bad
// launch configuration (unsupported head_dim, misaligned vectors) and report it as
// cudaErrorInvalidValue.
#pragma once

#include <cstdint>

namespace nanovllm {

// Element type codes shared with the bindings (and nanovllm/attention/cuda_ops.py).
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct CacheWriteParams {
  const void* key;    // [num_tokens, num_kv_heads, head_dim]
  const void* value;  // same shape
  void* k_cache;      // [num_blocks, block_size, num_kv_heads, head_dim]
  void* v_cache;
  const int32_t* slot_mapping;  // [num_tokens]; -1 = skip the token
  int64_t num_tokens;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t elem_size;  // bytes per element (2 or 4): the copy itself is type-agnostic
  int64_t key_stride_token, key_stride_head;
  int64_t value_stride_token, value_stride_head;
  int64_t k_stride_block, k_stride_slot, k_stride_head;
  int64_t v_stride_block, v_stride_slot, v_stride_head;
  int64_t block_size;
};

struct DecodeParams {
  const void* query;  // [num_seqs, num_heads, head_dim]
  void* out;          // [num_seqs, num_heads, head_dim], query's dtype
  const void* k_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* v_cache;
  const int32_t* block_tables;  // [num_seqs, >= ceil(context_len / block_size)]
  const int32_t* context_lens;  // [num_seqs]
  // Split-KV workspace, used when num_partitions > 1 (else may be null): fp32
  // partial_out [num_seqs, num_heads, num_partitions, head_dim] (unnormalized), and
  // partial_max / partial_sum [num_seqs, num_heads, num_partitions] (log2-domain running max and
  // softmax denominator of each partition).
  float* partial_out;
  float* partial_max;
  float* partial_sum;
  int64_t q_stride_token, q_stride_head;
  int64_t o_stride_token, o_stride_head;
  int64_t k_stride_block, k_stride_slot, k_stride_head;
  int64_t v_stride_block, v_stride_slot, v_stride_head;
  int64_t block_table_stride;
  int32_t num_seqs;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t block_size;
  int32_t num_partitions;
  int32_t dtype;  // nanovllm::DType
  float scale;    // softmax scale (applied to q . k)
};

int launch_cache_write(const CacheWriteParams& p, void* stream);
int launch_paged_decode(const DecodeParams& p, void* stream);

// The flat argument lists nanovllm/attention/cuda_ops.py passes (pointers as integers, strides in
// elements, the stream last), made into a parameter block and handed to `Launch(params, stream)`.
// The pybind11 module instantiates these with the real launchers; the CPU emulation of the kernels
// (tests/kernel_emulation) with its own, so both take exactly the same arguments.
template <auto Launch>
auto cache_write_entry(uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache, uintptr_t slot_mapping,
                       int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t elem_size,
                       int64_t key_stride_token, int64_t key_stride_head, int64_t value_stride_token,
                       int64_t value_stride_head, int64_t k_stride_block, int64_t k_stride_slot,
                       int64_t k_stride_head, int64_t v_stride_block, int64_t v_stride_slot, int64_t v_stride_head,
                       int64_t block_size, uintptr_t stream) {
  const CacheWriteParams p{.key = reinterpret_cast<const void*>(key),
                           .value = reinterpret_cast<const void*>(value),
                           .k_cache = reinterpret_cast<void*>(k_cache),
                           .v_cache = reinterpret_cast<void*>(v_cache),
                           .slot_mapping = reinterpret_cast<const int32_t*>(slot_mapping),
                           .num_tokens = num_tokens,
                           .num_kv_heads = num_kv_heads,
                           .head_dim = head_dim,
                           .elem_size = elem_size,
                           .key_stride_token = key_stride_token,
                           .key_stride_head = key_stride_head,
                           .value_stride_token = value_stride_token,
                           .value_stride_head = value_stride_head,
                           .k_stride_block = k_stride_block,
                           .k_stride_slot = k_stride_slot,
                           .k_stride_head = k_stride_head,
                           .v_stride_block = v_stride_block,
                           .v_stride_slot = v_stride_slot,
                           .v_stride_head = v_stride_head,
                           .block_size = block_size};
  return Launch(p, reinterpret_cast<void*>(stream));
}

template <auto Launch>
auto paged_decode_entry(uintptr_t query, uintptr_t out, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_tables,
                        uintptr_t context_lens, uintptr_t partial_out, uintptr_t partial_max, uintptr_t partial_sum,
                        int64_t q_stride_token, int64_t q_stride_head, int64_t o_stride_token, int64_t o_stride_head,
                        int64_t k_stride_block, int64_t k_stride_slot, int64_t k_stride_head, int64_t v_stride_block,
                        int64_t v_stride_slot, int64_t v_stride_head, int64_t block_table_stride, int32_t num_seqs,
                        int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                        int32_t num_partitions, int32_t dtype, float scale, uintptr_t stream) {
  const DecodeParams p{.query = reinterpret_cast<const void*>(query),
                       .out = reinterpret_cast<void*>(out),
                       .k_cache = reinterpret_cast<const void*>(k_cache),
                       .v_cache = reinterpret_cast<const void*>(v_cache),
                       .block_tables = reinterpret_cast<const int32_t*>(block_tables),
                       .context_lens = reinterpret_cast<const int32_t*>(context_lens),
                       .partial_out = reinterpret_cast<float*>(partial_out),
                       .partial_max = reinterpret_cast<float*>(partial_max),
                       .partial_sum = reinterpret_cast<float*>(partial_sum),
                       .q_stride_token = q_stride_token,
                       .q_stride_head = q_stride_head,
                       .o_stride_token = o_stride_token,
                       .o_stride_head = o_stride_head,
                       .k_stride_block = k_stride_block,
                       .k_stride_slot = k_stride_slot,
                       .k_stride_head = k_stride_head,
                       .v_stride_block = v_stride_block,
                       .v_stride_slot = v_stride_slot,
                       .v_stride_head = v_stride_head,
                       .block_table_stride = block_table_stride,
                       .num_seqs = num_seqs,
                       .num_heads = num_heads,
                       .num_kv_heads = num_kv_heads,
                       .head_dim = head_dim,
                       .block_size = block_size,
                       .num_partitions = num_partitions,
                       .dtype = dtype,
                       .scale = scale};
  return Launch(p, reinterpret_cast<void*>(stream));
}

// Query heads one CTA handles (a GQA group larger than this is split over several CTAs).
int decode_heads_per_cta();
// Largest num_partitions the split-KV path accepts.
int decode_max_partitions();
// Whether the decode kernel is compiled for this head_dim (any dtype).
bool decode_supports_head_dim(int head_dim);
const char* cuda_error_string(int code);
// Can this process run these kernels? Initializes the runtime and launches an empty kernel on the
// current device (synchronizing: call it once at startup, never per step). Returns a cudaError_t:
// e.g. an insufficient driver for the runtime linked in, or no kernel image for this GPU.
int cuda_probe(int* driver_version);
int cuda_runtime_version();
// The -gencode targets this module was built with (a string for diagnostics and the build test).
const char* build_targets();

}  // namespace nanovllm
