// Which x86 vector extensions the CPU has, for the kernels that pick a path at run time.
#pragma once

namespace nanovllm {

// Asked at the first call, not in a static initializer: those may run before libgcc has read the
// CPU's features (then every answer is "no").
inline bool has_avx2_fma() {
#if defined(__x86_64__)
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
#else
  return false;
#endif
}

}  // namespace nanovllm
