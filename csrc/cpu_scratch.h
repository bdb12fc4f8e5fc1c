// Scratch memory the CPU kernels keep from call to call (the decoder stack's activations, the MoE
// layer's gathered rows): mapped on its own and advised onto transparent huge pages from 2 MiB, as
// nanovllm/cpu/huge_pages.py does for the weights and the KV cache. A long prefill's activations run
// to tens of MB, and on 4 KiB pages each op over them (norms, rotary, SiLU, the experts' gather and
// combine) took a TLB miss every 4 KiB: the Qwen3-MoE-shaped model's batch prefill (32 prompts of
// 100-256 tokens, bf16) ran 1.05-1.07x faster on huge pages once its buffers existed (Intel Xeon with
// AMX; the step that first grows them pays for zeroing whole 2 MiB pages).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace nanovllm {

struct ScratchUnmap {
  void* base = nullptr;
  size_t bytes = 0;
  void operator()(std::byte*) const;
};
using ScratchBuffer = std::unique_ptr<std::byte[], ScratchUnmap>;

// At least `bytes` of uninitialized memory, 64-byte aligned (2 MiB from 2 MiB on), its pages
// populated (zeroed by the kernel now, where Linux has MADV_POPULATE_WRITE).
ScratchBuffer scratch_buffer(int64_t bytes);

// A scratch_buffer kept from call to call, replaced by a larger one when a call needs more.
struct GrowingScratch {
  ScratchBuffer data;
  int64_t bytes = 0;
  std::byte* at_least(int64_t n);
};

}  // namespace nanovllm
