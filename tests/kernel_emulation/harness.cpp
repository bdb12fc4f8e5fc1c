// Runs the real kernels/ source on the CPU (see cuda_emulation.h), exported with the same flat
// arguments as the nanovllm._kernels bindings, for tests/test_kernels_emulated.py (ctypes).
//
// Shared memory is filled with NaN bytes before every CTA, so a kernel that reads shared memory it
// has not written shows up as NaN in the output.
#define NANOVLLM_KERNEL_EMULATION 1

#include <thread>
#include <vector>

#include "cache_write.cu"
#include "paged_decode.cuh"

namespace {

using namespace nanovllm;

// One std::thread per CUDA thread for the whole grid; they walk the CTAs in the same order, with a
// barrier between CTAs (and around the shared-memory poisoning), so CTAs run one at a time.
template <typename Body>
void run_grid(dim3 grid, unsigned threads, int smem_bytes, Body body) {
  emu::grid_dim = grid;
  emu::block_dim = dim3{threads, 1, 1};
  std::barrier<> block(static_cast<std::ptrdiff_t>(threads));
  emu::block_barrier = &block;
  std::vector<emu::Warp> warps((threads + 31) / 32);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      emu::thread_idx = dim3{t, 0, 0};
      emu::warp = &warps[t / 32];
      for (unsigned z = 0; z < grid.z; ++z) {
        for (unsigned y = 0; y < grid.y; ++y) {
          for (unsigned x = 0; x < grid.x; ++x) {
            emu::block_idx = dim3{x, y, z};
            block.arrive_and_wait();  // the previous CTA is done with shared memory
            if (t == 0) std::memset(emu::dynamic_smem, 0xff, static_cast<size_t>(smem_bytes));
            block.arrive_and_wait();
            body();  // a kernel's early return only leaves this CTA
          }
        }
      }
    });
  }
  for (auto& th : pool) th.join();
}

template <typename T, int D, int G>
int decode_typed(const DecodeParams& p) {
  using C = DecodeConfig<T, D, G>;
  if (C::kSmemBytes > static_cast<int>(sizeof(emu::dynamic_smem))) return cudaErrorInvalidValue;
  run_grid(decode_grid(p, G), C::kThreads, C::kSmemBytes, [&] { paged_decode_kernel<T, D, G>(p); });
  if (p.num_partitions > 1) {
    run_grid(reduce_grid(p), kReduceThreads, 0, [&] { split_kv_reduce_kernel<T>(p); });
  }
  return cudaSuccess;
}

template <typename T, int D>
int decode_group(const DecodeParams& p) {
  switch (group_cap(p.num_heads / p.num_kv_heads)) {
    case 1: return decode_typed<T, D, 1>(p);
    case 2: return decode_typed<T, D, 2>(p);
    case 4: return decode_typed<T, D, 4>(p);
    default: return decode_typed<T, D, 8>(p);
  }
}

template <typename T>
int decode_dtype(const DecodeParams& p) {
  switch (p.head_dim) {
    case 16: return decode_group<T, 16>(p);
    case 32: return decode_group<T, 32>(p);
    case 64: return decode_group<T, 64>(p);
    case 128: return decode_group<T, 128>(p);
    case 256: return decode_group<T, 256>(p);
    default: return cudaErrorInvalidValue;
  }
}

template <typename Word>
int cache_write_typed(const CacheWriteParams& p) {
  const int64_t es = p.elem_size;
  const int words = static_cast<int>(p.head_dim * es / static_cast<int64_t>(sizeof(Word)));
  const int total = static_cast<int>(p.num_kv_heads) * words;
  const unsigned threads = total >= kCacheWriteThreads ? kCacheWriteThreads : ((total + 31) / 32) * 32;
  run_grid(dim3{static_cast<unsigned>(p.num_tokens), 1, 1}, threads, 0, [&] {
    cache_write_kernel<Word>(static_cast<const char*>(p.key), static_cast<const char*>(p.value),
                             static_cast<char*>(p.k_cache), static_cast<char*>(p.v_cache), p.slot_mapping,
                             static_cast<int>(p.num_kv_heads), words, p.key_stride_token * es, p.key_stride_head * es,
                             p.value_stride_token * es, p.value_stride_head * es, p.k_stride_block * es,
                             p.k_stride_slot * es, p.k_stride_head * es, p.v_stride_block * es, p.v_stride_slot * es,
                             p.v_stride_head * es, static_cast<int>(p.block_size));
  });
  return cudaSuccess;
}

// The emulated launchers, with the real launchers' signature (the stream is ignored).

// Returns the access width (bytes) used, or -1.
int emulated_cache_write(const CacheWriteParams& p, void*) {
  const int width = access_width(p);
  switch (width) {
    case 16: cache_write_typed<uint4>(p); break;
    case 8: cache_write_typed<uint2>(p); break;
    case 4: cache_write_typed<uint32_t>(p); break;
    case 2: cache_write_typed<uint16_t>(p); break;
    default: return -1;
  }
  return width;
}

int emulated_paged_decode(const DecodeParams& p, void*) {
  if (p.num_seqs == 0) return cudaSuccess;
  switch (p.dtype) {
    case kFloat32: return decode_dtype<float>(p);
    case kFloat16: return decode_dtype<__half>(p);
    case kBFloat16: return decode_dtype<__nv_bfloat16>(p);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// Exported as function pointers to the same flat-argument entry points the pybind11 module binds
// (kernels/launchers.h), so the emulation cannot drift from the real argument lists; ctypes calls
// them through these pointers.
// (The unbraced `extern "C"` also makes these const pointers external.)
extern "C" const auto emu_cache_write = &cache_write_entry<emulated_cache_write>;
extern "C" const auto emu_paged_decode = &paged_decode_entry<emulated_paged_decode>;
