// Which x86 vector extensions the CPU has, for the kernels that pick a path at run time.
#pragma once

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// Code for AVX2 + FMA CPUs (has_avx2_fma), compiled for them whatever the build's baseline.
#define NANOVLLM_AVX2 __attribute__((target("avx2,fma")))

namespace nanovllm {

struct CpuIsa {
  bool avx2_fma = false;     // the AVX2 GEMM tiles and attention score tiles
  bool avx512f = false;      // the AVX-512 fp32 GEMM tiles
  bool avx512 = false;       // AVX-512 F + BW + VL + DQ (Skylake-SP on): the MoE layer's own loops
  // AVX-512 (as avx512) + AVX512-BF16: the bf16 pair tiles and vcvtneps2bf16's 16-lane loops (Zen 4,
  // Cooper Lake, SPR; every CPU with BF16 has BW, VL and DQ, which those loops' masked moves and
  // vfpclassps need, but a VM may hide them).
  bool avx512_bf16 = false;
  // AVX-512 (as avx512) + AVX512-VNNI: the quantized GEMM's one to four int4 rows as 16-bit integers
  // (vpdpwssd; Cascade Lake on, Zen 4 on).
  bool avx512_vnni = false;
  // AMX tiles with bf16 and int8 products, granted to the process (Sapphire Rapids on), and AVX512-VBMI's
  // byte permutes (which every AMX CPU has: the quantized GEMM's int8 path reorders weights with them).
  bool amx_bf16 = false;
};

// Linux hands the tile registers' state (8 KB a thread) only to a process that asks for it, once.
inline bool amx_granted() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

// Asked at the first call, not in a static initializer: those may run before libgcc has read the
// CPU's features (then every answer is "no").
inline const CpuIsa& cpu_isa() {
  static const CpuIsa isa = [] {
    CpuIsa found;
#if defined(__x86_64__)
    __builtin_cpu_init();
    found.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    found.avx512f = __builtin_cpu_supports("avx512f");
    found.avx512 = found.avx512f && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512dq");
    found.avx512_bf16 = found.avx512 && __builtin_cpu_supports("avx512bf16");
    found.avx512_vnni = found.avx512 && __builtin_cpu_supports("avx512vnni");
    found.amx_bf16 = found.avx512_bf16 && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                     __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("avx512vbmi") && amx_granted();
#endif
    return found;
  }();
  return isa;
}

inline bool has_avx2_fma() { return cpu_isa().avx2_fma; }
inline bool has_avx512f() { return cpu_isa().avx512f; }
inline bool has_avx512() { return cpu_isa().avx512; }
inline bool has_avx512_bf16() { return cpu_isa().avx512_bf16; }
inline bool has_avx512_vnni() { return cpu_isa().avx512_vnni; }
inline bool has_amx_bf16() { return cpu_isa().amx_bf16; }

}  // namespace nanovllm
