// Splitting a CPU kernel's work over threads, shared by the attention kernel, the fused layers and
// the sampler.
//
// The threads are the process's OpenMP team: _C links libgomp.so.1 and so does torch, and the
// loader maps a soname once, so our kernels and torch's GEMMs share one pool of workers. A kernel
// neither starts a thread per call nor competes for the cores with torch's workers, which spin for
// a while after each of torch's parallel regions (a thread of our own started then waited up to a
// millisecond for a core on a 2-CPU machine).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace nanovllm {

// Below this many elements per thread a second thread costs more than it saves. At 2^15 a decode
// step's RMSNorms of 32 rows x 1024 (~50 us each with their activations out of cache) ran on one
// thread while the other waited: at 2^13 the Qwen3-shaped model's step of 32 sequences ran 3-8%
// faster (bf16 and int4; batch 1 unchanged; Intel Xeon with AMX).
inline constexpr int64_t kMinElementsPerThread = 1 << 13;

// fn(thread_index, team_size) on up to `threads` threads of the OpenMP team (the caller is index 0;
// the runtime may grant fewer, e.g. inside another parallel region).
template <typename F>
void parallel_team(int64_t threads, const F& fn) {
  if (threads <= 1) {
    fn(0, 1);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(threads))
  fn(omp_get_thread_num(), omp_get_num_threads());
}

// How many of num_threads n rows of row_elements each are worth (at most one a row).
inline int64_t rows_team(int64_t n, int64_t row_elements, int num_threads) {
  return std::clamp<int64_t>(std::min<int64_t>(num_threads, n * row_elements / kMinElementsPerThread), 1,
                             std::max<int64_t>(n, 1));
}

// fn(begin, end) over [0, n) rows split evenly over the team.
template <typename F>
void parallel_rows(int64_t n, int64_t row_elements, int num_threads, const F& fn) {
  parallel_team(rows_team(n, row_elements, num_threads),
                [n, &fn](int64_t i, int64_t team) { fn(n * i / team, n * (i + 1) / team); });
}

}  // namespace nanovllm
