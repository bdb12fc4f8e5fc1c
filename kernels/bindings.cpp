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

void check(int code, const char* what) {
  if (code != 0) {
    throw std::runtime_error(std::string(what) + " failed: " + cuda_error_string(code) + " (cuda error " +
                             std::to_string(code) + ")");
  }
}

void cache_write(const CacheWriteParams& p, void* stream) { check(launch_cache_write(p, stream), "cache_write"); }

void paged_decode(const DecodeParams& p, void* stream) { check(launch_paged_decode(p, stream), "paged_decode"); }

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "nano-vLLM CUDA kernels (paged decode attention, cache write); see kernels/ and "
            "nanovllm/attention/cuda_ops.py";
  m.def("cache_write", &cache_write_entry<cache_write>, "Scatter K/V rows into the paged cache by slot (-1 = skip).");
  m.def("paged_decode", &paged_decode_entry<paged_decode>,
        "Decode attention over the paged cache (split-KV when num_partitions > 1).");
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
