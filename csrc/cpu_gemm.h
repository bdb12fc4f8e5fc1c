// y = x W^T + bias in fp32 on an AVX2 + FMA CPU, on a weight packed once at load time: the
// engine's fp32 linear layers and LM head (nanovllm/cpu/gemm.py picks the kernels), and the
// mixture-of-experts layers' experts on every AVX2 CPU (cpu_moe.h).
//
// Why our own: oneDNN's prepacked fp32 matmul ran these shapes at 60-75% of the two cores' FMA
// peak, and 45-60% at decode batches (32 x 1024 x 6144: 87 GF/s of ~185); a BLIS-style 6 x 16
// register tile with the weight streamed once per call keeps the FMA units busy instead.
//
// Packed layout: the weight's N rows in panels of kGemmPanel output columns (the last panel
// zero-padded), K cut into slices 256 deep; a panel's slice is [depth][kGemmPanel] (the weights of
// one input column contiguous), laid out [slice depth][panel]: a pass over the panels at one
// depth reads one sequential stream. The packed copy keeps the weight's dtype: bf16 stays bf16
// (half the memory and bandwidth of fp32) and is widened in registers; the arithmetic is fp32.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpu_dtype.h"

namespace nanovllm {

inline constexpr int64_t kGemmPanel = 16;

// The packed layout's slices: K cut this deep. A slice of one panel, 256 x 16 weights (16 KB in
// fp32), stays in L1 while a tile walks the rows of x below it (BLIS's kc).
inline constexpr int64_t kGemmSliceDepth = 256;

inline int64_t gemm_panels(int64_t n) { return (n + kGemmPanel - 1) / kGemmPanel; }

// Where the slice starting at input column k0 of panel p begins in the packed weight of `panels`
// panels, k deep.
inline int64_t gemm_slice_offset(int64_t panels, int64_t k, int64_t p, int64_t k0) {
  return (k0 * panels + p * std::min(kGemmSliceDepth, k - k0)) * kGemmPanel;
}

// Tile t of `rows` rows cut into `tiles`: rows [tile_first(t), tile_first(t + 1)), the tiles' sizes
// within one of each other. Full tiles and a remainder (8 rows as 6 + 2 on AVX2) left a small tile
// whose few accumulators wait on the FMA latency (a 2-row tile took 60% of a 6-row one's time, Zen 3).
inline int64_t tile_first(int64_t t, int64_t rows, int64_t tiles) { return t * rows / tiles; }

inline int64_t tile_count(int64_t rows, int64_t most) { return (rows + most - 1) / most; }

// tile_at.template operator()<n>(t, r0) for n (1 .. R) known at compile time.
template <int R, typename TileAt>
void tile_of(int64_t n, int64_t t, int64_t r0, const TileAt& tile_at) {
  if constexpr (R > 0) {
    if (n == R) {
      tile_at.template operator()<R>(t, r0);
    } else {
      tile_of<R - 1>(n, t, r0, tile_at);
    }
  }
}

// Rows [0, rows) in the fewest tiles of at most kMax rows, cut by tile_first:
// tile_at.template operator()<rows of the tile>(tile index, first row) for each.
template <int kMax, typename TileAt>
void row_tiles(int64_t rows, const TileAt& tile_at) {
  const int64_t tiles = tile_count(rows, kMax);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r0 = tile_first(t, rows, tiles);
    tile_of<kMax>(tile_first(t + 1, rows, tiles) - r0, t, r0, tile_at);
  }
}

// Elements of the packed copy of an [n, k] weight (the binding checks that it fits int64).
inline int64_t gemm_packed_elements(int64_t n, int64_t k) { return gemm_panels(n) * k * kGemmPanel; }

// w [n, k] of `dtype`, rows w_stride elements apart -> packed, gemm_packed_elements(n, k) elements
// of the same dtype. With `pairs`, laid out for the AVX-512 pair tiles: the slices of panels 2j and
// 2j + 1 interleaved unit by unit, a unit being one weight per column in fp32 and a k pair in bf16
// (k even; the two weights of the pair next to each other: [depth / 2][2][16][2]); a last odd
// panel alone. A tile of two panels then reads one sequential stream: two streams 8 KB apart ran
// 1.6-1.7x slower from DRAM at 2-4 rows (Zen 4, one core), the hardware prefetcher follows one
// stream far better. Without, the AVX2 tiles' layout.
void gemm_pack(const void* w, CpuDtype dtype, int64_t n, int64_t k, int64_t w_stride, void* packed, bool pairs);

struct GemmArgs {
  const float* x;      // [m, k], rows x_stride apart
  const void* packed;  // gemm_pack's output for an [n, k] weight, of packed_dtype
  const float* bias;   // nullable, [n]
  float* y;            // [m, n], rows y_stride apart
  int64_t m, n, k, x_stride, y_stride;
  CpuDtype packed_dtype;
  // fp32 weights packed with pairs, for the AVX-512 tiles (12 x 32); else the AVX2 tiles (6 x 16),
  // fp32 weights or bf16 ones widened in registers.
  bool pairs = false;
  // With pairs, from kAmxFp32MinRows rows on AMX tiles where the process has them
  // (gemm_fp32_amx_panel_range); false keeps every row count on the FMA tiles.
  bool amx = true;
};

// From this many rows gemm_panel_range takes pair-packed fp32 weights to AMX tiles.
inline constexpr int64_t kAmxFp32MinRows = 64;

// Needs AVX2 + FMA (has_avx2_fma()), and AVX-512F for pairs; the binding checks.
void gemm(const GemmArgs& a, int num_threads);

// Panels [begin, end) of `panels` for thread `thread` of `team`, split at even panels: the pair
// layouts' tiles start at an even panel (the p0 of gemm_bf16_panel_range, and of gemm_panel_range
// with pairs).
struct PanelShare {
  int64_t begin, end;
  PanelShare(int64_t panels, int64_t thread, int64_t team)
      : begin(std::min(panels, (panels + 1) / 2 * thread / team * 2)),
        end(std::min(panels, (panels + 1) / 2 * (thread + 1) / team * 2)) {}
};

// A row's greedy token over the logits compared so far, as cpu_sampler's argmax picks it: the
// largest value (a NaN never counts, -inf does) and the first column holding it (-1: none yet).
struct RowBest {
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = -1;
};

struct GemmBf16Args {
  const Bf16* x;       // [m, k], rows x_stride apart
  const Bf16* packed;  // gemm_pack's output for a bf16 [n, k] weight, with pairs
  const float* bias;   // nullable, [n]
  float* y;            // [m, n], rows y_stride apart
  int64_t m, n, k, x_stride, y_stride;
  // On AMX tiles where the process has them (has_amx_bf16()) and k is a multiple of 32; else (or
  // when false) on the AVX512-BF16 pair tiles.
  bool amx = true;
  // Where not null, the product rounded to bf16 ([m, n], rows n apart) is the output: on AMX tiles
  // each panel pair's columns are rounded as soon as its rows are summed, through a scratch of the
  // thread's (y is not written); on the pair tiles y holds the fp32 product and the thread rounds
  // its columns after.
  Bf16* y_bf16 = nullptr;
  // Where not null, a MoE layer's gate/up product (cpu_moe.h's packing: 8 gate and 8 up columns a
  // panel) becomes SiLU(gate) * up rounded to bf16 as the layer's own loop computes it
  // (silu_mul_panels_x16), [m, n / 2], rows n / 2 apart, and y is scratch: on AMX tiles each block
  // pair's rows as soon as they are summed (y is not written), on the pair tiles from y after. Not
  // with y_bf16 or a bias.
  Bf16* act = nullptr;
  // The fp32 products in y rounded to bf16's precision (a bf16 F.linear's output, widened): an LM
  // head's logits. On AMX tiles each panel pair's as soon as its rows are summed, while in L1.
  bool round_y = false;
  // Where not null, on AMX tiles only (amx_takes): y is not written, and each row's largest product
  // (rounded where round_y) over the panels of the call and its first column are kept in best[row],
  // updated from each panel pair's products while they are in L1 (gemm_greedy's heads).
  RowBest* best = nullptr;
};

// Whether gemm_bf16_panel_range takes AMX tiles for a.
bool amx_takes(const GemmBf16Args& a);

// gemm_panel_range for bf16 rows of x on pair-packed bf16 weights, products summed in fp32: on AMX
// tiles (gemm_bf16_amx_panel_range), or the pair tiles (two products per vdpbf16ps lane: twice an
// FMA's throughput); p0 even (PanelShare). Needs AVX512-BF16 (has_avx512_bf16()).
void gemm_bf16_panel_range(const GemmBf16Args& a, int64_t p0, int64_t p1);

// The same on AMX tiles (cpu_gemm_amx.cpp): the same products, summed in fp32 in the tiles' order.
// Needs has_amx_bf16() and k a multiple of 32.
void gemm_bf16_amx_panel_range(const GemmBf16Args& a, int64_t p0, int64_t p1);

// gemm_panel_range for fp32 rows on pair-packed fp32 weights on AMX tiles (cpu_gemm_amx_fp32.cpp):
// each value split into three bf16 pieces and the six products of pieces within fp32's precision
// summed in fp32 (within fp32's rounding bound of the exact product, as the FMA tiles' sums; rows and
// panel pairs holding values the pieces cannot hold on the FMA tiles). p0 even (PanelShare). Needs
// has_amx_bf16().
void gemm_fp32_amx_panel_range(const GemmArgs& a, int64_t p0, int64_t p1);

// y = x W^T + bias on gemm_bf16_panel_range's tiles, split over the team: the bf16 linear layers
// where nanovllm/cpu/gemm.py gives them our kernel (AVX512-BF16 CPUs for small layers, every bf16
// layer where the process has AMX tiles).
void gemm_bf16(const GemmBf16Args& a, int num_threads);

// gemm / gemm_bf16 for a bf16 model's layer: the fp32 product in a.y, rounded to bf16 into y_bf16
// ([m, n], rows n apart) by the thread that computed each column, while it is in that thread's cache
// (one thread's pass over the product after the GEMM was 2.6% of a bf16 MoE model's prefill); on
// AMX tiles a panel pair at a time (GemmBf16Args::y_bf16), a.y unused.
void gemm_narrowed(const GemmArgs& a, Bf16* y_bf16, int num_threads);
void gemm_bf16_narrowed(const GemmBf16Args& a, Bf16* y_bf16, int num_threads);

struct GemmLogitsArgs {
  const void* x;  // [m, k] of x_dtype, rows x_stride apart
  CpuDtype x_dtype;
  const void* packed;  // gemm_pack's output for the head's [n, k] weight, of packed_dtype, with or without pairs
  CpuDtype packed_dtype;
  bool pairs;
  float* y;  // [m, n], rows y_stride apart
  int64_t m, n, k, x_stride, y_stride;
};

// An LM head's fp32 logits in one call: what nanovllm/cpu/gemm.py's linear gives on the same rows,
// then .float() (the same bits, but a NaN's sign and payload). x W^T by gemm on x widened to fp32,
// or by gemm_bf16 on x as bf16 for a pair-packed bf16 weight; where x is bf16 each logit is rounded
// to bf16 (F.linear's output dtype) by the thread that wrote it, while it is in that thread's cache.
// The Python path spent two conversion passes and three allocations around the GEMM, each a torch
// call on caches the weights had just flushed (tens of us a decode step).
void gemm_logits(const GemmLogitsArgs& a, int num_threads);

// The same head's greedy tokens without its logits, for a step whose rows all sample greedily and
// want nothing else of them: ids[r] the first column of row r's largest logit (the logits
// gemm_logits gives, NaNs passed over, 0 for a row of NaNs: cpu_sampler's argmax_rows). a.y is not
// read. bf16 rows on AMX tiles compare each panel pair's logits while they are in L1 and store none
// (a decode step of 32 rows wrote 4 MB of them, and read them back to pick its tokens); elsewhere
// they go through a scratch and argmax_rows.
void gemm_greedy(const GemmLogitsArgs& a, int64_t* ids, int num_threads);

// The part of gemm(a) that writes output columns [p0 * kGemmPanel, p1 * kGemmPanel), on the calling
// thread: for kernels that split the work of several GEMMs over their own team (cpu_moe.cpp). With
// pairs, p0 must be even and p1 even or the last panel (PanelShare): a pair's stream read from its
// second panel would be taken for a lone panel's.
void gemm_panel_range(const GemmArgs& a, int64_t p0, int64_t p1);

}  // namespace nanovllm
