// Fused elementwise layers for the CPU forward, fp32 or bf16: each is one pass over its rows
// instead of the 3-9 torch ops (and temporaries) of the layer written in torch. The numerics follow
// the torch layers (nanovllm/layers): fp32 math, rounded to the model dtype where torch rounds.
#pragma once

#include <cstdint>

#include "cpu_dtype.h"

namespace nanovllm {

// RMSNorm of rows of `hidden` elements. Row i (i < rows) starts at x + (i / heads) * x_stride +
// (i % heads) * hidden: a 2-D input has heads = 1; q/k norm passes [tokens, heads, head_dim] views
// of the fused qkv output. With `residual`, x + residual (rounded to the dtype) is normalized and
// also written to `residual_out`. `out` and `residual_out` are contiguous [rows, hidden].
struct RmsNormArgs {
  const void* x;
  const void* residual;  // nullable; contiguous [rows, hidden]
  const void* weight;    // [hidden]
  void* out;
  void* residual_out;    // written when residual is given
  int64_t rows, hidden, heads, x_stride;
  float eps;
  CpuDtype dtype;
};
void rms_norm(const RmsNormArgs& a, int num_threads);

// x [rows, 2 * inner] (gate | up), rows x_stride elements apart -> out [rows, inner] = silu(gate) * up.
struct SiluAndMulArgs {
  const void* x;
  void* out;
  int64_t rows, inner, x_stride;
  CpuDtype dtype;
};
void silu_and_mul(const SiluAndMulArgs& a, int num_threads);

// Rotary position embedding (neox / rotate-half), in place on q and k rows: each token's rows are
// heads x head_dim contiguous, tokens q_stride (k_stride) elements apart. Token i's angle for
// frequency j is positions[i] * inv_freq[j] in fp32, as torch computes it; then
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin per pair (x1, x2) = (x[j], x[j + head_dim / 2]),
// each product and sum rounded to the dtype as torch's ops round them.
struct RotaryArgs {
  void* q;
  void* k;
  const int32_t* positions;  // [tokens]
  const float* inv_freq;     // [head_dim / 2]
  int64_t tokens, q_heads, k_heads, head_dim, q_stride, k_stride;
  CpuDtype dtype;
  // Nullable: the tokens' cos and sin as rotary_angles writes them, taken instead of computing them
  // (a stack of layers that share inv_freq computes them once a forward).
  const float* angles = nullptr;
};
inline constexpr int64_t kMaxRotaryDim = 1024;
void rotary(const RotaryArgs& a, int num_threads);
// Each of a.tokens tokens' cos and sin of its head_dim / 2 angles, rounded to the dtype as torch
// casts them, into out [tokens][head_dim]: the cos, then the sin. Two libm calls an angle, which
// every layer made again: at a head_dim of 64, 6 us of a layer's norm and rotary for a 32-token
// decode step on one thread (41 -> 34 us), 47 us for a 512-token chunk on two (342 -> 295 us;
// Intel Xeon with AMX).
void rotary_angles(const RotaryArgs& a, float* out, int num_threads);

// rms_norm(q_norm), rms_norm(k_norm), then rotary(r) on their outputs (r.q, r.k), the same bits, a
// few tokens at a time: each token's q and k rows are still in L1 when they are turned (three
// passes over a prefill's q and k went through memory: ~8 MB at 2,048 tokens of a 16/8-head model).
// q_norm's rows are r.tokens x r.q_heads heads, k_norm's r.tokens x r.k_heads.
inline constexpr int64_t kNormRotaryTokens = 8;
void norm_rotary(const RmsNormArgs& q_norm, const RmsNormArgs& k_norm, const RotaryArgs& r, int num_threads);

}  // namespace nanovllm
