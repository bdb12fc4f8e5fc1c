// The CPU mixture-of-experts layer (Qwen3-MoE, Mixtral): router top-k, the tokens grouped by
// expert, each expert's gate/up GEMM, SiLU-and-mul and down GEMM, and the weighted sum back into
// token order (docs/design.md, "Mixture of experts").
//
// Routing: softmax over the router logits in fp32, the top_k largest (ties: the lower expert id
// first), each row's weights optionally renormalized to sum to 1 (Mixtral always, Qwen3-MoE with
// norm_topk_prob). An assignment is (row, j): row * top_k + j. Grouping is a stable counting sort:
// `sorted` lists the assignments expert by expert, rows ascending within an expert, and expert e's
// are sorted[offsets[e] .. offsets[e + 1]).
#pragma once

#include <cstdint>

#include "cpu_dtype.h"

namespace nanovllm {

struct MoeRouteArgs {
  const float* logits;  // [rows, experts], rows logits_stride apart
  int64_t logits_stride;
  int64_t rows, experts, top_k;
  bool renormalize;
  int32_t* topk_ids;        // [rows, top_k], by falling weight
  float* topk_weights;      // [rows, top_k]
  int32_t* expert_offsets;  // [experts + 1]
  int32_t* sorted;          // [rows * top_k]
};

void moe_route(const MoeRouteArgs& a, int num_threads);

// out[row] = sum_j topk_weights[row, j] * y[position of assignment (row, j) in `sorted`]: the
// experts' outputs, one row per assignment in sorted order, back into token order. Summed in fp32
// in j order (the same on any number of threads), rounded once to the dtype.
struct MoeCombineArgs {
  const void* y;  // [rows * top_k, hidden] of dtype, rows y_stride apart
  int64_t y_stride;
  const int32_t* sorted;
  const float* topk_weights;
  int64_t rows, top_k, hidden;
  void* out;  // [rows, hidden] of dtype, rows out_stride apart
  int64_t out_stride;
  CpuDtype dtype;
};

void moe_combine(const MoeCombineArgs& a, int num_threads);

// The whole layer in one call, on expert weights packed for gemm() (cpu_gemm.h). Expert e's gate/up
// weight is packed as [moe_gate_up_rows(inter), hidden]: each 16-row panel holds 8 gate rows and
// the 8 up rows of the same intermediate columns (inter padded to a multiple of 8 with zero rows), so
// a thread that computed a panel can apply SiLU-and-mul to it at once; it lies at w13 + e *
// gemm_packed_elements(moe_gate_up_rows(inter), hidden) elements. Expert e's down weight [hidden,
// moe_down_depth(inter, bf16 pairs)] (zero columns past inter) at w2 + e * gemm_packed_elements(hidden,
// moe_down_depth(...)). Threads take whole experts each (at a decode step's few rows per expert, or
// where that splits the work evenly), synchronizing once, or split each GEMM's output panels evenly
// (every chosen expert's), synchronizing twice (cpu_moe.cpp); an expert no row chose is never read. With pairs the weights are packed for
// the AVX-512 pair tiles (gemm_pack's pairs): bf16 ones (bf16 activations, hidden even, an
// AVX512-BF16 CPU; AMX tiles where the process has them) take bf16 rows, fp32 ones (an AVX-512F CPU) fp32 rows; otherwise activations are
// widened to fp32 for our AVX2 tiles. With bf16 activations every product is rounded to bf16 where
// the torch layers round it (the gate/up output, SiLU-and-mul, each expert's down output). Needs
// AVX2 + FMA (the binding checks).
inline int64_t moe_gate_up_rows(int64_t inter) { return 2 * ((inter + 7) / 8 * 8); }

// The packed down weight's depth: inter, or inter padded to 8 for the bf16 pair tiles (an even depth).
inline int64_t moe_down_depth(int64_t inter, bool bf16_pairs) { return bf16_pairs ? moe_gate_up_rows(inter) / 2 : inter; }

// What every kind of experts shares: the rows in and out, the router logits, the layer's shape.
struct MoeLayerArgs {
  const void* x;  // [rows, hidden] of dtype, rows x_stride apart
  int64_t x_stride;
  const float* logits;  // [rows, experts]
  int64_t logits_stride;
  int64_t rows, hidden, inter, experts, top_k;
  bool renormalize;
  void* out;  // [rows, hidden] of dtype
  int64_t out_stride;
  CpuDtype dtype;

  // The layer (its shape, routing and dtype) on one call's rows.
  MoeLayerArgs on_rows(const void* rows_x, int64_t rows_x_stride, const float* rows_logits, int64_t rows_logits_stride,
                       int64_t count, void* rows_out, int64_t rows_out_stride) const {
    MoeLayerArgs r = *this;
    r.x = rows_x;
    r.x_stride = rows_x_stride;
    r.logits = rows_logits;
    r.logits_stride = rows_logits_stride;
    r.rows = count;
    r.out = rows_out;
    r.out_stride = rows_out_stride;
    return r;
  }
};

struct MoeExpertsArgs {
  MoeLayerArgs layer;
  const void* w13;
  const void* w2;
  CpuDtype weight_dtype;
  bool pairs;
  bool bf16_pairs() const { return pairs && weight_dtype == CpuDtype::kBFloat16; }
};

void moe_experts(const MoeExpertsArgs& a, int num_threads);

// The same layer on int8 / int4 experts packed for quant_gemm (cpu_gemm_quant.h), expert after
// expert at fixed strides: the gate/up weight with its rows interleaved as above (its zero rows of
// scale 0), the down weight [hidden, inter]. With bf16_rows (bf16 activations, an AVX512-BF16 CPU,
// groups of an even size or one per row, hidden even) the GEMMs take bf16 rows (quant_gemm's x_bf16
// path), else fp32 rows.
struct MoeQuantWeights {
  const uint8_t* packed;  // experts x packed_stride bytes
  int64_t packed_stride;
  const float* scales;  // experts x scales_stride floats: [groups][panels][16]
  int64_t scales_stride;
  const int8_t* zeros;  // nullable; as scales (experts x scales_stride): [groups][panels][16]
  int64_t group_size;
  int bits;
  float zero_offset;
};

struct MoeQuantExpertsArgs {
  MoeLayerArgs layer;
  MoeQuantWeights w13, w2;
  bool bf16_rows;
};

void moe_quant_experts(const MoeQuantExpertsArgs& a, int num_threads);

}  // namespace nanovllm
