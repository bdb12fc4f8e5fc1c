// pybind11 module `nanovllm._kernels`: the CUDA launchers, taking raw device pointers (ints),
// sizes, strides (elements) and the stream handle (torch.cuda.Stream.cuda_stream).
//
// Nothing here links against libtorch and nothing needs a GPU at import: the CUDA runtime is linked
// statically and initializes lazily, on the first launch. The Python wrappers in
// nanovllm/attention/cuda_ops.py check every tensor before calling in; a launcher error still
// surfaces as RuntimeError (a bug in those checks, or an asynchronous error of earlier work).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "launchers.h"

namespace py = pybind11;
using namespace nanovllm;

namespace {

template <typename P>
P* ptr(uintptr_t address) {
  return reinterpret_cast<P*>(address);
}

void check(int code, const char* what) {
  if (code != 0) {
    throw std::runtime_error(std::string(what) + " failed: " + cuda_error_string(code) + " (cuda error " +
                             std::to_string(code) + ")");
  }
}

void cache_write(uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache, uintptr_t slot_mapping,
                 int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t elem_size,
                 int64_t key_stride_token, int64_t key_stride_head, int64_t value_stride_token,
                 int64_t value_stride_head, int64_t k_stride_block, int64_t k_stride_slot, int64_t k_stride_head,
                 int64_t v_stride_block, int64_t v_stride_slot, int64_t v_stride_head, int64_t block_size,
                 uintptr_t stream) {
  CacheWriteParams p{};
  p.key = ptr<const void>(key);
  p.value = ptr<const void>(value);
  p.k_cache = ptr<void>(k_cache);
  p.v_cache = ptr<void>(v_cache);
  p.slot_mapping = ptr<const int32_t>(slot_mapping);
  p.num_tokens = num_tokens;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.elem_size = elem_size;
  p.key_stride_token = key_stride_token;
  p.key_stride_head = key_stride_head;
  p.value_stride_token = value_stride_token;
  p.value_stride_head = value_stride_head;
  p.k_stride_block = k_stride_block;
  p.k_stride_slot = k_stride_slot;
  p.k_stride_head = k_stride_head;
  p.v_stride_block = v_stride_block;
  p.v_stride_slot = v_stride_slot;
  p.v_stride_head = v_stride_head;
  p.block_size = block_size;
  check(launch_cache_write(p, ptr<void>(stream)), "cache_write");
}

void paged_decode(uintptr_t query, uintptr_t out, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_tables,
                  uintptr_t context_lens, uintptr_t partial_out, uintptr_t partial_max, uintptr_t partial_sum,
                  int64_t q_stride_token, int64_t q_stride_head, int64_t o_stride_token, int64_t o_stride_head,
                  int64_t k_stride_block, int64_t k_stride_slot, int64_t k_stride_head, int64_t v_stride_block,
                  int64_t v_stride_slot, int64_t v_stride_head, int64_t block_table_stride, int32_t num_seqs,
                  int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                  int32_t num_partitions, int32_t dtype, float scale, uintptr_t stream) {
  DecodeParams p{};
  p.query = ptr<const void>(query);
  p.out = ptr<void>(out);
  p.k_cache = ptr<const void>(k_cache);
  p.v_cache = ptr<const void>(v_cache);
  p.block_tables = ptr<const int32_t>(block_tables);
  p.context_lens = ptr<const int32_t>(context_lens);
  p.partial_out = ptr<float>(partial_out);
  p.partial_max = ptr<float>(partial_max);
  p.partial_sum = ptr<float>(partial_sum);
  p.q_stride_token = q_stride_token;
  p.q_stride_head = q_stride_head;
  p.o_stride_token = o_stride_token;
  p.o_stride_head = o_stride_head;
  p.k_stride_block = k_stride_block;
  p.k_stride_slot = k_stride_slot;
  p.k_stride_head = k_stride_head;
  p.v_stride_block = v_stride_block;
  p.v_stride_slot = v_stride_slot;
  p.v_stride_head = v_stride_head;
  p.block_table_stride = block_table_stride;
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.num_partitions = num_partitions;
  p.dtype = dtype;
  p.scale = scale;
  check(launch_paged_decode(p, ptr<void>(stream)), "paged_decode");
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "nano-vLLM CUDA kernels (paged decode attention, cache write); see kernels/ and "
            "nanovllm/attention/cuda_ops.py";
  m.def("cache_write", &cache_write, "Scatter K/V rows into the paged cache by slot (-1 = skip).");
  m.def("paged_decode", &paged_decode, "Decode attention over the paged cache (split-KV when num_partitions > 1).");
  m.def("heads_per_cta", &decode_heads_per_cta);
  m.def("max_partitions", &decode_max_partitions);
  m.def("supports_head_dim", &decode_supports_head_dim);
  m.def(
      "probe",
      [] {
        int driver = 0;
        const int code = cuda_probe(&driver);
        return py::make_tuple(code, code == 0 ? std::string() : std::string(cuda_error_string(code)), driver,
                              cuda_runtime_version());
      },
      "(error code, message, driver version, runtime version): whether these kernels can run here. "
      "Synchronizes the device: call once at startup.");
  m.def("cuda_runtime_version", &cuda_runtime_version,
        "The CUDA runtime version the module was built with (e.g. 13000), read without a GPU.");
  m.def("build_targets", &build_targets, "The nvcc -gencode targets the kernels were compiled for.");
  m.attr("DTYPE_FLOAT32") = static_cast<int>(kFloat32);
  m.attr("DTYPE_FLOAT16") = static_cast<int>(kFloat16);
  m.attr("DTYPE_BFLOAT16") = static_cast<int>(kBFloat16);
}
