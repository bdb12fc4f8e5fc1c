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
