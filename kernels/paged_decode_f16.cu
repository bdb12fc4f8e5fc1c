// Decode kernels for one cache dtype; see paged_decode.cuh. Split by dtype only so that the build
// compiles the instantiations on several cores at once.
#include "paged_decode.cuh"

namespace nanovllm {

int launch_paged_decode_f16(const DecodeParams& p, cudaStream_t stream) { return launch_decode_dtype<__half>(p, stream); }

}  // namespace nanovllm
