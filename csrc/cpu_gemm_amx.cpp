// gemm_bf16_panel_range on AMX tiles (Intel Sapphire Rapids and later): the same pair-packed bf16
// weights, the same products summed in fp32, at several times the pair tiles' rate.
//
// The pair layout is already what a tile multiply reads for its second operand: a panel's k pairs
// lie 128 bytes apart (64 for a lone last panel), each a row of 16 columns x 2 weights, so a B tile
// (16 k pairs of one panel) loads straight from the packed weight with that stride; the rows of x
// are copied into A tiles (amx::pack_rows). Tiles: C0..C3 the products of two 16-row blocks by two
// panels, A4/A5 the blocks, B6/B7 the panels (amx::kConfig).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_amx.h"
#include "cpu_bf16_avx512.h"
#include "cpu_gate_up_act.h"
#include "cpu_gemm.h"

namespace nanovllm {

#if defined(__x86_64__)
namespace {

using amx::kTileDepth;
using amx::kTileRows;

// A block of 16 rows of x, packed (amx::pack_rows), and where its products go: y itself, or spill.
struct RowBlock {
  const Bf16* tiles;  // [k / 32][16 rows][32], one A tile after another
  float* y;
  int64_t y_stride;  // elements
};

// C[2 * b + q] = block b's rows x panel q's columns over depths [k0, k1) (whole slices), B blocks (1
// or 2) by P panels (1 or 2), from the panels' packed slices. The sums start from zero at k0 = 0,
// else from `carry` (those of the depths before: 32 rows x 32 columns, 4 KB); they go back to
// `carry` while k1 < k, and to the blocks' y once k1 = k. `stream`: the first blocks of a chunk to
// meet these slices, whose B comes from memory (amx::multiply).
template <int B, int P>
NANOVLLM_AMX_TILES void multiply(const RowBlock (&blocks)[2], const Bf16* packed, int64_t panels, int64_t k, int64_t p,
                                 int64_t k0, int64_t k1, float* carry, bool stream) {
  constexpr int64_t kCarryRow = 2 * kGemmPanel;
  float* const carried[2] = {carry, carry + kTileRows * kCarryRow};
  constexpr int64_t kCarryStride[2] = {kCarryRow, kCarryRow};
  if (k0 == 0) {
    amx::zero_sums<B, P>();
  } else {
    amx::load_sums<B, P>(carried, kCarryStride);
  }
  const Bf16* a[2] = {blocks[0].tiles + k0 * kTileRows, blocks[1].tiles + k0 * kTileRows};
  for (int64_t d = k0; d < k1; d += kGemmSliceDepth) {
    const int64_t next = d + kGemmSliceDepth;
    amx::multiply<B, P>(a, packed + gemm_slice_offset(panels, k, p, d), std::min(kGemmSliceDepth, k - d) / kTileDepth,
                        stream, next < k ? packed + gemm_slice_offset(panels, k, p, next) : nullptr);
  }
  if (k1 < k) {
    amx::store_sums<B, P>(carried, kCarryStride);
    return;
  }
  float* const y[2] = {blocks[0].y, blocks[1].y};
  const int64_t stride[2] = {blocks[0].y_stride, blocks[1].y_stride};
  amx::store_sums<B, P>(y, stride);
}

template <int B>
void multiply_panels(int np, const RowBlock (&blocks)[2], const Bf16* packed, int64_t panels, int64_t k, int64_t p,
                     int64_t k0, int64_t k1, float* carry, bool stream) {
  if (np == 2) {
    multiply<B, 2>(blocks, packed, panels, k, p, k0, k1, carry, stream);
  } else {
    multiply<B, 1>(blocks, packed, panels, k, p, k0, k1, carry, stream);
  }
}

// Depth a chunk's block pairs take in turn against a panel pair: one slice, whose B (16 KB for a
// pair) stays in L1 while every block pair multiplies by it, their sums carried over in memory
// between slices. A tile load from L2 holds the tiles' multiplies up (one thread's 2 x 2 tile loop
// ran at 3.3 TFLOP/s with its A and B in L1, 1.8 with either from L2, 1.4 with both); over the
// whole depth before the next block pair, a pair's B (64 KB at k = 1024) went through L1 to L2 and
// back for each block pair (2 threads: 2048 x 1024 x 6144 1.12-1.18x faster in passes, 256 x 1024 x
// 1024 from memory 1.08-1.16x; Intel Xeon with AMX).
inline constexpr int64_t kPassDepth = kGemmSliceDepth;

// The depth of a pass for `blocks` row blocks at depth k: the whole depth where a pair's B over it
// (64 bytes a depth) stays in L1 anyway (the MoE layer's down GEMM, k = 512, 32 KB, ran 1.05x
// slower in two passes), or where fewer than 8 block pairs share each slice and the carried sums
// cost more than B's trips to L2 save (2048 rows by 3072 x 1024, 128-row chunks: 1.02-1.06x slower).
// rows_per_chunk keeps a chunk under 16 blocks past k = 1536: deeper GEMMs take no passes.
int64_t pass_depth(int64_t blocks, int64_t k) {
  constexpr int64_t kPairBytesPerDepth = 2 * kGemmPanel * sizeof(Bf16), kKeptB = 32 * 1024, kSharing = 16;
  return blocks >= kSharing && k * kPairBytesPerDepth > kKeptB ? kPassDepth : k;
}

inline constexpr int64_t kCarryValues = 2 * kTileRows * 2 * kGemmPanel;  // a block pair's sums

// Rows packed and multiplied at a time: their A tiles about 768 KB, so that they stay in a core's L2
// (2 MB on Sapphire Rapids) while every panel's B streams past them once. Packed whole, a 2048-row
// prefill's A (4 MB at k = 1024) went back to L3 for each pair of panels: one thread's GEMMs of
// 2048 rows by 2048 x 1024 and by 1024 x 3072 ran 1.7x / 1.6x faster cut at 768 KB (at 256 KB
// 1.4x / 1.05x, at 2 MB 1.35x / 1.2x; Intel Xeon with AMX).
int64_t rows_per_chunk(int64_t k) {
  constexpr int64_t kChunkBytes = 768 * 1024, kTwoBlocks = 2 * kTileRows;
  return std::max(kTwoBlocks, kChunkBytes / (k * static_cast<int64_t>(sizeof(Bf16))) / kTwoBlocks * kTwoBlocks);
}

// A bf16 output from this size is written past the caches (amx::finish_pair's `stream`): a core's L2.
inline constexpr int64_t kStreamedOutputBytes = 2 << 20;

// A chunk's m rows against panels [p0, p1): their A tiles in `tiles` (amx::pack_rows), products into
// y (rows a.y_stride apart); or, where y_bf16, act or best is set, each pair's into `pair` (rows 2 *
// kGemmPanel apart: 128 bytes a row, 48 KB for a chunk at k = 1024, more at a shallower k) and from
// there rounded into y_bf16 (rows a.n apart), turned into SiLU(gate) * up in act (rows a.n / 2
// apart), or compared into best (each row's largest and its column), while they are in the thread's
// cache: a prefill's product in fp32 went to memory and back (a layer's 512 rows x 6144 are 12 MB).
NANOVLLM_AMX_TILES void multiply_rows(const GemmBf16Args& a, float* y, Bf16* y_bf16, Bf16* act, RowBest* best,
                                      int64_t m, const Bf16* tiles, float* spill, float* pair, float* carry,
                                      int64_t p0, int64_t p1) {
  const int64_t panels = gemm_panels(a.n), blocks = (m + kTileRows - 1) / kTileRows;
  const bool to_pair = y_bf16 != nullptr || act != nullptr || best != nullptr;
  const int64_t out_stride = to_pair ? 2 * kGemmPanel : a.y_stride;
  const bool stream = a.m * a.n * static_cast<int64_t>(sizeof(Bf16)) >= kStreamedOutputBytes;
  for (int64_t p = p0; p < p1; p += 2) {
    amx::fence();  // the last pair's rounding read `pair` before these tiles overwrite it
    const int np = static_cast<int>(std::min<int64_t>(2, p1 - p));
    const int64_t col0 = p * kGemmPanel, cols = std::min(np * kGemmPanel, a.n - col0);
    float* const out = to_pair ? pair : y + col0;  // the pair's first column
    // Block b: its tiles and where its products land (spill's half s where the block has fewer than
    // 16 rows or the panels run past n).
    const auto block = [&](int64_t b, int s) -> RowBlock {
      const Bf16* t = tiles + b * kTileRows * a.k;
      if ((b + 1) * kTileRows <= m && cols == np * kGemmPanel) {
        return {t, out + b * kTileRows * out_stride, out_stride};
      }
      return {t, spill + s * kTileRows * 2 * kGemmPanel, 2 * kGemmPanel};
    };
    // The spilled products of blocks [b, b + count) into out: their rows, `cols` columns.
    const auto land = [&](int64_t b, int count) {
      amx::fence();
      for (int s = 0; s < count; ++s) {
        const int64_t first = (b + s) * kTileRows, rows = std::min(kTileRows, m - first);
        if (rows == kTileRows && cols == np * kGemmPanel) continue;
        for (int64_t r = 0; r < rows; ++r) {
          std::copy_n(spill + (s * kTileRows + r) * 2 * kGemmPanel, cols, out + (first + r) * out_stride);
        }
      }
    };
    // Rows [r0, r1) of the pair's products finished: the bias added, rounded into y_bf16 (or in
    // place: round_y), made SiLU(gate) * up in act, or compared into best. A block pair's rows are
    // finished once the next pair's multiplies are issued: the vector work runs beside those tiles'
    // and reads sums still in L1 (after the whole chunk, it waited on a 384-row chunk's 48 KB coming
    // back from L2).
    const bool finishing = a.bias != nullptr || to_pair || a.round_y;
    const auto finish = [&](int64_t r0, int64_t r1) {
      amx::fence();
      if (act != nullptr) {
        for (int64_t r = r0; r < r1; ++r) {
          silu_mul_panels_x16(out + r * out_stride, act + r * (a.n / 2) + col0 / 2, 0, np);
        }
        return;
      }
      if (best != nullptr) {
        if (a.bias != nullptr || a.round_y) {
          const float* bias = a.bias == nullptr ? nullptr : a.bias + col0;
          amx::finish_pair(out + r0 * out_stride, out_stride, bias, nullptr, a.n, r1 - r0, cols, false, a.round_y);
        }
        amx::best_of_pair(out + r0 * out_stride, out_stride, r1 - r0, cols, col0, best + r0);
        return;
      }
      amx::finish_pair(out + r0 * out_stride, out_stride, a.bias == nullptr ? nullptr : a.bias + col0,
                       y_bf16 == nullptr ? nullptr : y_bf16 + r0 * a.n + col0, a.n, r1 - r0, cols, stream, a.round_y);
    };
    const int64_t pass = pass_depth(blocks, a.k);
    for (int64_t k0 = 0; k0 < a.k; k0 += pass) {
      const int64_t k1 = std::min(a.k, k0 + pass);
      const bool last = k1 == a.k;
      int64_t b = 0, finished = 0;
      for (; b + 2 <= blocks; b += 2) {
        const RowBlock pair_blocks[2] = {block(b, 0), block(b + 1, 1)};
        multiply_panels<2>(np, pair_blocks, a.packed, panels, a.k, p, k0, k1, carry + b / 2 * kCarryValues, b == 0);
        if (!last) continue;
        land(b, 2);
        if (finishing && b > 0) {  // the pair before this one
          finish(finished, b * kTileRows);
          finished = b * kTileRows;
        }
      }
      if (b < blocks) {
        const RowBlock one[2] = {block(b, 0), block(b, 0)};
        multiply_panels<1>(np, one, a.packed, panels, a.k, p, k0, k1, carry + b / 2 * kCarryValues, b == 0);
        if (last) land(b, 1);
      }
      if (last && finishing) finish(finished, m);
    }
  }
}

}  // namespace

[[gnu::target("amx-tile,amx-bf16")]] void gemm_bf16_amx_panel_range(const GemmBf16Args& a, int64_t p0, int64_t p1) {
  if (p0 >= p1 || a.m == 0) return;
  const int64_t chunk = std::min(rows_per_chunk(a.k), a.m);
  thread_local std::vector<Bf16> tiles_storage;
  thread_local std::vector<float> spill_storage, pair_storage, carry_storage;
  const int64_t chunk_rows = (chunk + kTileRows - 1) / kTileRows * kTileRows;
  Bf16* const tiles = amx::aligned(tiles_storage, chunk_rows * a.k);
  float* const spill = amx::aligned(spill_storage, 2 * kTileRows * 2 * kGemmPanel);  // products that do not fit in y
  float* const pair = a.y_bf16 != nullptr || a.act != nullptr || a.best != nullptr
                          ? amx::aligned(pair_storage, chunk_rows * 2 * kGemmPanel)
                          : nullptr;
  float* const carry = amx::aligned(carry_storage, (chunk_rows / kTileRows + 1) / 2 * kCarryValues);
  _tile_loadconfig(&amx::kConfig);
  for (int64_t r0 = 0; r0 < a.m; r0 += chunk) {
    const int64_t m = std::min(chunk, a.m - r0);
    amx::pack_rows(a.x + r0 * a.x_stride, a.x_stride, m, a.k, tiles);
    amx::fence();
    multiply_rows(a, pair != nullptr ? nullptr : a.y + r0 * a.y_stride,
                  a.y_bf16 != nullptr ? a.y_bf16 + r0 * a.n : nullptr,
                  a.act != nullptr ? a.act + r0 * (a.n / 2) : nullptr, a.best != nullptr ? a.best + r0 : nullptr, m,
                  tiles, spill, pair, carry, p0, p1);
  }
  _tile_release();
}
#else
void gemm_bf16_amx_panel_range(const GemmBf16Args&, int64_t, int64_t) {}
#endif

}  // namespace nanovllm
