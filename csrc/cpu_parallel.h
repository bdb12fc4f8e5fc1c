// Splitting a CPU kernel's rows over threads, shared by the fused layers and the sampler.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace nanovllm {

// Below this many elements per thread a second thread costs more than it saves.
inline constexpr int64_t kMinElementsPerThread = 1 << 15;

// fn(begin, end) over [0, n) rows split evenly; the calling thread takes the first range.
template <typename F>
void parallel_rows(int64_t n, int64_t row_elements, int num_threads, const F& fn) {
  const int64_t threads =
      std::clamp<int64_t>(std::min<int64_t>(num_threads, n * row_elements / kMinElementsPerThread), 1,
                          std::max<int64_t>(n, 1));
  std::vector<std::jthread> workers;
  workers.reserve(threads - 1);
  for (int64_t i = 1; i < threads; ++i) workers.emplace_back([&fn, n, i, threads] { fn(n * i / threads, n * (i + 1) / threads); });
  fn(0, n / threads);
}

}  // namespace nanovllm
