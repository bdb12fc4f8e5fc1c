// y = x W^T + bias in fp32 for weight-only quantized W (int8 or int4, a scale and optionally a
// zero point per group of input columns): one pass over the packed weight, dequantized in
// registers. nanovllm/layers/quantization/cpu_kernel.py packs the weights and calls it.
//
// Packed layout: as csrc/cpu_gemm.h (panels of kGemmPanel = 16 output columns, K cut into slices
// 256 deep, a pass over the panels at one slice depth one sequential stream), with 1-byte (int8)
// or half-byte (int4) elements:
//   int8: a panel slice is [depth][16] signed bytes;
//   int4: [depth / 2][16] bytes, byte c of row j holding column c at depths 2j (low nibble) and
//         2j + 1 (high nibble), values 0..15; K is padded to even (the pad nibble is never read).
// Group parameters, per group and panel: 16 fp32 scales ([groups][panels][16]) and, when the
// weight has zero points, 16 int8 zero points ([groups][panels][16]). Columns past n have scale 0.
// Group-major, so a pass over the panels at one depth reads them as sequential streams too (panel-
// major, the scale loads missed the cache, a third of a decode GEMM's time).
// A weight value is w = (q - z) * s with q the stored value (int4: the nibble) and z the zero
// point plus `zero_offset` (int4 symmetric: z = 8, the stored zero point then absent).
//
// Two paths per panel slice: up to kDirectRows rows (decode, in tiles of a few rows that each
// decode the slice), each group's partial dot products
// sum x * q in registers and the group's scale and zero point apply once at its end
// (s * (sum x q - z * sum x)); more rows dequantize the slice once into an fp32 buffer in L1 and
// run register tiles over it (prefill). Instruction sets: AVX-512 (F, BW, VL, DQ), AVX2 + FMA, and
// plain C++ for any other CPU; one template, picked at run time or forced for tests.
#pragma once

#include <cstdint>

namespace nanovllm {

// kAmx: AVX-512 with bf16 activations on AMX tiles (k and the groups multiples of 32); kAuto takes
// those from a few rows where the process has them.
enum class QuantIsa : int32_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3, kAmx = 4 };

// Bytes of the packed int`bits` weight of an [n, k] matrix.
int64_t quant_gemm_packed_bytes(int64_t n, int64_t k, int bits);

struct QuantGemmArgs {
  const float* x;            // [m, k], rows x_stride apart (null with x_bf16)
  // Nullable: bf16 activations instead of x, [m, k rounded up to even] (a pad column of zeros),
  // rows x_stride apart, groups of an even size (or one per row). Where the CPU has AVX512-BF16
  // (isa auto or AVX-512) multiplied with its dot products on pairs of input columns (twice the fp32
  // FMA rate); one row against int4 or int8 on AVX2 (groups and k multiples of 32) as 16-bit
  // integers, a power-of-two scale per block of 128, 64 or 32 columns (the largest dividing k and
  // the group size), with integer multiply-adds (exact for values within 2^7 of their block's
  // largest, the others within 2^-16 of it); otherwise widened to fp32. On AMX tiles (kAmx, or kAuto
  // from 2 rows) int8 weights against up to 64 rows, and int4 against up to 20 (k and the groups
  // multiples of 64), take the rows as 16-bit integers too, a power of two per group's part of each
  // 256-deep slice, on int8 tiles.
  const uint16_t* x_bf16;
  const uint8_t* packed;     // quant_gemm_packed_bytes(n, k, bits) bytes
  const float* scales;       // [groups][panels][16]
  const int8_t* zeros;       // nullable: [groups][panels][16]
  const float* bias;         // nullable, [n]
  float* y;                  // [m, n], rows y_stride apart (unused with y_bf16)
  int64_t m, n, k, x_stride, y_stride;
  int64_t group_size;        // groups = ceil(k / group_size); group_size = k: one per output column
  int bits;                  // 4 or 8
  float zero_offset;         // added to every zero point (and the zero point when there are none)
  // Nullable: the output rounded to bf16 instead of y, [m, n], rows y_stride apart; quant_gemm's
  // AMX path rounds each sum as it finishes it, the others sum in fp32 in a buffer of their own
  // (quant_gemm_panels takes y only).
  uint16_t* y_bf16;
};

// Whether this CPU runs `isa` (kAuto and kPortable: always).
bool quant_isa_supported(QuantIsa isa);
// The instruction set kAuto picks here.
QuantIsa quant_isa_best();
// Whether this CPU runs the bf16 path (AVX-512 with AVX512-BF16: Zen 4, Cooper Lake, Sapphire Rapids).
bool quant_has_bf16();
// Whether one to four bf16 rows against int4 go as 16-bit integers to vpdpwssd (AVX-512 with
// AVX512-VNNI: Cascade Lake on, Zen 4 on).
bool quant_has_vnni512();

// The binding checks sizes, pointers and that the CPU runs `isa`.
void quant_gemm(const QuantGemmArgs& a, QuantIsa isa, int num_threads);
// Output panels [p0, p1) (of kGemmPanel columns) only, on the calling thread: for a caller that
// splits the panels over its own team (the mixture-of-experts layer).
void quant_gemm_panels(const QuantGemmArgs& a, QuantIsa isa, int64_t p0, int64_t p1);

}  // namespace nanovllm
