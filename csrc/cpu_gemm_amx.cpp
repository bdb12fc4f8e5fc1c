// gemm_bf16_panel_range on AMX tiles (Intel Sapphire Rapids and later): the same pair-packed bf16
// weights, the same products summed in fp32, at several times the pair tiles' rate.
//
// The pair layout is already what a tile multiply reads for its second operand: a panel's k pairs
// lie 128 bytes apart (64 for a lone last panel), each a row of 16 columns x 2 weights, so a B tile
// (16 k pairs of one panel) loads straight from the packed weight with that stride; the rows of x
// load as A tiles (16 rows x 32 columns) from x itself. Tiles: C0..C3 the products of two 16-row
// blocks by two panels, A4/A5 the blocks, B6/B7 the panels; one configuration, loaded per call
// (oneDNN's kernels, on the same threads, load their own) and released after.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_gemm.h"

namespace nanovllm {

#if defined(__x86_64__)
namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileDepth = 32;  // bf16 values in an A tile's row, k pairs x 2 in a B tile's rows

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes: C0..C3 fp32 16 x 16, A4/A5 and B6/B7 bf16 16 x 32.
constexpr TileConfig kConfig = [] {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.bytes_per_row[t] = 64;
    c.rows[t] = kTileRows;
  }
  return c;
}();

// GCC's tile intrinsics are asm statements that do not tell the compiler which memory they read or
// write: a fence around those that touch our own scratch keeps its stores and loads in order.
inline void compiler_fence() { asm volatile("" ::: "memory"); }

// count T of a thread's scratch `storage`, 64-byte aligned: a tile row split over two cache lines
// loads several times slower (3-6x, B tiles from L1 to L3).
template <typename T>
T* aligned(std::vector<T>& storage, int64_t count) {
  storage.resize(count + 64 / sizeof(T));
  const auto at = reinterpret_cast<uintptr_t>(storage.data());
  return reinterpret_cast<T*>((at + 63) / 64 * 64);
}

// A block of 16 rows of x, packed (pack_blocks), and where its products go: y itself, or spill.
struct RowBlock {
  const Bf16* tiles;  // [k / 32][16 rows][32], one A tile after another
  float* y;
  int64_t y_stride;  // elements
};

// Rows of x in blocks of 16 (the last zero-padded), each block's tiles contiguous: an A tile read
// from x itself would take 16 rows a power-of-two stride apart, a few L1 sets for all of them.
void pack_blocks(const GemmBf16Args& a, Bf16* out) {
  const int64_t steps = a.k / kTileDepth;
  for (int64_t r = 0; r < a.m + (kTileRows - a.m % kTileRows) % kTileRows; ++r) {
    Bf16* dst = out + (r / kTileRows * steps * kTileRows + r % kTileRows) * kTileDepth;
    for (int64_t s = 0; s < steps; ++s, dst += kTileRows * kTileDepth) {
      if (r < a.m) {
        std::copy_n(a.x + r * a.x_stride + s * kTileDepth, kTileDepth, dst);
      } else {
        std::fill_n(dst, kTileDepth, Bf16{0});
      }
    }
  }
}

// C[2 * b + q] = block b's rows x panel q's columns over the whole depth, B blocks (1 or 2) by P
// panels (1 or 2); the panels' packed slices from `packed`. Tile numbers are immediates: every
// (B, P) its own instance.
template <int B, int P>
[[gnu::target("amx-tile,amx-bf16")]] void multiply(const RowBlock (&blocks)[2], const Bf16* packed, int64_t panels,
                                                  int64_t k, int64_t p) {
  _tile_zero(0);
  if constexpr (P == 2) _tile_zero(1);
  if constexpr (B == 2) {
    _tile_zero(2);
    if constexpr (P == 2) _tile_zero(3);
  }
  // Two panels' slices interleave k pair by k pair (the pair layout), a lone panel's are its own:
  // a panel's k pairs (rows of 16 columns x 2 weights, 64 bytes) lie `stride` bytes apart.
  constexpr int64_t kPairRow = kGemmPanel * 2, stride = P * kPairRow * static_cast<int64_t>(sizeof(Bf16));
  constexpr int64_t kATile = kTileRows * kTileDepth;
  const Bf16* a0 = blocks[0].tiles;
  const Bf16* a1 = blocks[1].tiles;
  for (int64_t k0 = 0; k0 < k; k0 += kGemmSliceDepth) {
    const int64_t kc = std::min(kGemmSliceDepth, k - k0);
    const Bf16* slice = packed + gemm_slice_offset(panels, k, p, k0);
    for (int64_t d = 0; d < kc; d += kTileDepth, a0 += kATile, a1 += kATile) {
      const Bf16* b = slice + d / 2 * P * kPairRow;
      _tile_loadd(6, b, stride);
      _tile_loadd(4, a0, kTileDepth * 2);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (P == 2) _tile_loadd(7, b + kPairRow, stride);
      if constexpr (P == 2) _tile_dpbf16ps(1, 4, 7);
      if constexpr (B == 2) {
        _tile_loadd(5, a1, kTileDepth * 2);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (P == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  _tile_stored(0, blocks[0].y, blocks[0].y_stride * 4);
  if constexpr (P == 2) _tile_stored(1, blocks[0].y + kGemmPanel, blocks[0].y_stride * 4);
  if constexpr (B == 2) {
    _tile_stored(2, blocks[1].y, blocks[1].y_stride * 4);
    if constexpr (P == 2) _tile_stored(3, blocks[1].y + kGemmPanel, blocks[1].y_stride * 4);
  }
}

template <int B>
void multiply_panels(int np, const RowBlock (&blocks)[2], const Bf16* packed, int64_t panels, int64_t k, int64_t p) {
  if (np == 2) {
    multiply<B, 2>(blocks, packed, panels, k, p);
  } else {
    multiply<B, 1>(blocks, packed, panels, k, p);
  }
}

}  // namespace

[[gnu::target("amx-tile,amx-bf16")]] void gemm_bf16_amx_panel_range(const GemmBf16Args& a, int64_t p0, int64_t p1) {
  if (p0 >= p1 || a.m == 0) return;
  const int64_t panels = gemm_panels(a.n), blocks = (a.m + kTileRows - 1) / kTileRows;
  thread_local std::vector<Bf16> tiles_storage;
  thread_local std::vector<float> spill_storage;
  Bf16* const tiles = aligned(tiles_storage, blocks * kTileRows * a.k);
  float* const spill = aligned(spill_storage, 2 * kTileRows * 2 * kGemmPanel);  // products that do not fit in y
  pack_blocks(a, tiles);
  compiler_fence();
  _tile_loadconfig(&kConfig);
  for (int64_t p = p0; p < p1; p += 2) {
    const int np = static_cast<int>(std::min<int64_t>(2, p1 - p));
    const int64_t col0 = p * kGemmPanel, cols = std::min(np * kGemmPanel, a.n - col0);
    // Block b: its tiles and where its products land (spill's half s where the block has fewer than
    // 16 rows or the panels run past n).
    const auto block = [&](int64_t b, int s) -> RowBlock {
      const Bf16* t = tiles + b * kTileRows * a.k;
      if ((b + 1) * kTileRows <= a.m && cols == np * kGemmPanel) {
        return {t, a.y + b * kTileRows * a.y_stride + col0, a.y_stride};
      }
      return {t, spill + s * kTileRows * 2 * kGemmPanel, 2 * kGemmPanel};
    };
    // The spilled products of blocks [b, b + count) into y: their rows, `cols` columns.
    const auto land = [&](int64_t b, int count) {
      compiler_fence();
      for (int s = 0; s < count; ++s) {
        const int64_t first = (b + s) * kTileRows, rows = std::min(kTileRows, a.m - first);
        if (rows == kTileRows && cols == np * kGemmPanel) continue;
        for (int64_t r = 0; r < rows; ++r) {
          std::copy_n(spill + (s * kTileRows + r) * 2 * kGemmPanel, cols, a.y + (first + r) * a.y_stride + col0);
        }
      }
    };
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
      const RowBlock pair[2] = {block(b, 0), block(b + 1, 1)};
      multiply_panels<2>(np, pair, a.packed, panels, a.k, p);
      land(b, 2);
    }
    if (b < blocks) {
      const RowBlock one[2] = {block(b, 0), block(b, 0)};
      multiply_panels<1>(np, one, a.packed, panels, a.k, p);
      land(b, 1);
    }
    if (a.bias != nullptr) {
      for (int64_t r = 0; r < a.m; ++r) {
        float* row = a.y + r * a.y_stride + col0;
        for (int64_t c = 0; c < cols; ++c) row[c] += a.bias[col0 + c];
      }
    }
  }
  _tile_release();
}
#else
void gemm_bf16_amx_panel_range(const GemmBf16Args&, int64_t, int64_t) {}
#endif

}  // namespace nanovllm
