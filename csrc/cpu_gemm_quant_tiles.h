// The quantized GEMM's kernel body (csrc/cpu_gemm_quant.h), written once over an instruction-set
// type `Isa` and included by csrc/cpu_gemm_quant.cpp once per instruction set, each time inside
// that set's namespace and `#pragma GCC target` region, so every function here is compiled for it.
// Deliberately no include guard.
//
// Isa provides: V (a vector of floats), kVecs (vectors per 16-column panel row), kDirectRows (most
// rows of the in-register path), direct_tile_rows(bits) (most rows it decodes a slice for at once),
// kTileRows (rows of a register tile over a dequantized slice),
// zero/bcast/load/store/add/sub/mul/fma/fnma (fnma(a, b, c) = c - a * b), and the decoders int8(p, out)
// (16 signed bytes -> kVecs vectors), int4(p, lo, hi) (16 bytes -> the low and the high nibbles as
// floats) and int4_bytes(p, whole, high) (16 bytes -> each byte, lo + 16 hi, and its high nibble).

using V = Isa::V;
static_assert(Isa::kDirectRows <= kMaxDirectRows);
constexpr int kVecs = Isa::kVecs;
constexpr int kLanes = kGemmPanel / kVecs;

inline void load16(const float* p, V* out) {
  for (int v = 0; v < kVecs; ++v) out[v] = Isa::load(p + v * kLanes);
}

// The bias of a panel's `cols` columns from col0 where `take` and the layer has one, else zeros.
inline void load_bias(const QuantGemmArgs& a, int64_t col0, int cols, bool take, V* out) {
  alignas(64) float b16[kGemmPanel] = {};
  if (take && a.bias != nullptr) std::copy_n(a.bias + col0, cols, b16);
  load16(b16, out);
}

// y[0, cols) = v (+ y when `add`).
inline void put(float* y, const V* v, int cols, bool add) {
  if (cols == kGemmPanel) {
    for (int i = 0; i < kVecs; ++i) Isa::store(y + i * kLanes, add ? Isa::add(Isa::load(y + i * kLanes), v[i]) : v[i]);
    return;
  }
  alignas(64) float row[kGemmPanel];
  for (int i = 0; i < kVecs; ++i) Isa::store(row + i * kLanes, v[i]);
  for (int j = 0; j < cols; ++j) y[j] = add ? y[j] + row[j] : row[j];
}

// Group g's scales and zero points (zero_offset added) of panel p.
inline void group_params(const QuantGemmArgs& a, int64_t p, int64_t g, V* s, V* z) {
  const int64_t at = (g * gemm_panels(a.n) + p) * kGemmPanel;
  load16(a.scales + at, s);
  if (a.zeros == nullptr) {
    for (int v = 0; v < kVecs; ++v) z[v] = Isa::bcast(&a.zero_offset);
    return;
  }
  Isa::int8(a.zeros + at, z);
  for (int v = 0; v < kVecs; ++v) z[v] = Isa::add(z[v], Isa::bcast(&a.zero_offset));
}

// Independent accumulator sets per row for a tile of R rows: an FMA's result feeds the next after
// 4 cycles, so a row alone (one accumulator per vector) waited on that latency at every step; with
// S sets, S consecutive steps (int8 rows, int4 row pairs) go to different accumulators.
template <int R>
constexpr int kSets = std::clamp(8 / (R * kVecs), 1, 4);

// acc[r] += x[r, i] * q[i] over one segment of `len` input columns: int8 rows of 16 bytes, or
// int4 pairs of rows in 16 bytes (an odd last row in the low nibbles). int4 takes x as RowPrep::pairs:
// a byte b = lo + 16 hi times x0 plus its high nibble times (x1 - 16 x0) is x0 lo + x1 hi, and
// converting b and b >> 4 spares the mask that isolating lo costs (two of 14 vector operations a
// step, where the decode of one row is bound by them, not by memory). The products are up to 16x
// the terms they sum to: on random inputs the result's error grew 2-4x (to ~5e-6 of its largest
// value in fp32; a bf16 output rounds at 4e-3). x1 - 16 x0 keeps x1 only to the precision of 16 x0:
// exact for bf16 rows (widened) up to a ratio of ~2^12 between neighbours, but an fp32 row whose even
// column is 3e7 times its odd one, on a zero weight, lost the odd term outright (an error 16x the
// sum of |x| |w|; one outlier of 2000 among N(0, 1) values: 1.6e-6 of it against 1.7e-7 at 13 rows).
template <int R, int Bits>
inline void dot_segment(const float* x, int64_t ldx, const uint8_t* w, const uint8_t* ahead, int64_t len,
                        V (*acc)[kVecs]) {
  constexpr int S = kSets<R>;
  constexpr int kStep = Bits == 8 ? 1 : 2;  // input columns per 16 bytes of weights
  V part[S][R][kVecs];
  for (int t = 0; t < S; ++t) {
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < kVecs; ++v) part[t][r][v] = t == 0 ? acc[r][v] : Isa::zero();
    }
  }
  // One step: the 16 bytes at row `at` of w against input columns at * kStep (+ 1).
  const auto step = [&](int64_t at, V (*into)[kVecs]) {
    V lo[kVecs], hi[kVecs];
    if constexpr (Bits == 8) {
      Isa::int8(reinterpret_cast<const int8_t*>(w + at * kGemmPanel), lo);
    } else {
      Isa::int4_bytes(w + at * kGemmPanel, lo, hi);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V x0 = Isa::bcast(x + r * ldx + at * kStep);
      for (int v = 0; v < kVecs; ++v) into[r][v] = Isa::fma(x0, lo[v], into[r][v]);
      if constexpr (Bits == 4) {
        const V x1 = Isa::bcast(x + r * ldx + at * kStep + 1);
        for (int v = 0; v < kVecs; ++v) into[r][v] = Isa::fma(x1, hi[v], into[r][v]);
      }
    }
  };
  const int64_t steps = len / kStep;
  int64_t i = 0;
  for (; i + S <= steps; i += S) {
    // One row reads a line of weights per 4 steps: the line as far ahead in the pass (panel_ahead).
    // Measured on AVX2 (two vectors a panel row, Zen 3) and on AVX-512 (the Intel Xeon with AMX: a
    // 6144 x 1024 int8 weight at one row 2.2-2.5x faster, 16 -> 35-44 GB/s; int4 1.16x).
    if constexpr (R == 1 && S == 4) __builtin_prefetch(ahead + i * kGemmPanel, 0, 2);
#pragma GCC unroll 4
    for (int t = 0; t < S; ++t) step(i + t, part[t]);
  }
  for (; i < steps; ++i) step(i, part[0]);
  if (Bits == 4 && (len & 1)) {  // the odd last row: low nibbles only (the pad is never read)
    V lo[kVecs], hi[kVecs];
    Isa::int4(w + steps * kGemmPanel, lo, hi);
    for (int r = 0; r < R; ++r) {
      const V x0 = Isa::bcast(x + r * ldx + 2 * steps);
      for (int v = 0; v < kVecs; ++v) part[0][r][v] = Isa::fma(x0, lo[v], part[0][r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      V sum = part[0][r][v];
      for (int t = 1; t < S; ++t) sum = Isa::add(sum, part[t][r][v]);
      acc[r][v] = sum;
    }
  }
}

// The end of segment sg (first column s0) of R rows on panel p: y += s * (sum x q - z * sum x), acc
// holding each row's sum x q and xsum its segment sums (RowPrep::xsum's layout); the first segment
// of the row writes bias + that. y: the rows' output rows, a.y_stride apart.
template <int R>
[[gnu::always_inline]] inline void finish_segment(const QuantGemmArgs& a, const Segments& segs, int64_t p, int64_t sg, const V (*acc)[kVecs],
                    const float* xsum, float* y) {
  const int64_t col0 = p * kGemmPanel, s0 = segs.start[sg];
  const int cols = static_cast<int>(std::min(kGemmPanel, a.n - col0));
  V s[kVecs], z[kVecs], bias[kVecs];
  group_params(a, p, segs.group[sg], s, z);
  const bool first = s0 == 0;
  load_bias(a, col0, cols, first, bias);
  for (int r = 0; r < R; ++r) {
    const V xs = Isa::bcast(xsum + r * segs.count() + sg);
    V out[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      out[v] = Isa::mul(s[v], Isa::fnma(z[v], xs, acc[r][v]));
      if (first) out[v] = Isa::add(out[v], bias[v]);
    }
    put(y + r * a.y_stride + col0, out, cols, !first);
  }
}

// The in-register path: R rows (x, ldx apart: a.x's, or RowPrep::pairs for int4; xsum their segment
// sums; y their output rows, a.y_stride apart) against panel p's slice at k0 (w), segment by
// segment (finish_segment at each one's end).
template <int R, int Bits>
void direct_slice(const QuantGemmArgs& a, const Segments& segs, int64_t slice, int64_t p, int64_t k0, const uint8_t* w,
                  const uint8_t* ahead, const float* x, int64_t ldx, const float* xsum, float* y) {
  for (int64_t sg = segs.first[slice]; sg < segs.first[slice + 1]; ++sg) {
    const int64_t s0 = segs.start[sg], len = segs.start[sg + 1] - s0;
    V acc[R][kVecs];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < kVecs; ++v) acc[r][v] = Isa::zero();
    }
    const int64_t at = (s0 - k0) * kGemmPanel * Bits / 8;
    dot_segment<R, Bits>(x + s0, ldx, w + at, ahead + at, len, acc);
    finish_segment<R>(a, segs, p, sg, acc, xsum, y);
  }
}

// Panel p's slice at k0 (kc deep) dequantized to fp32: buf[i][16] = (q - z) * s.
template <int Bits>
void dequant_slice(const QuantGemmArgs& a, const Segments& segs, int64_t slice, int64_t p, int64_t k0, const uint8_t* w,
                   float* buf) {
  for (int64_t sg = segs.first[slice]; sg < segs.first[slice + 1]; ++sg) {
    const int64_t s0 = segs.start[sg], s1 = segs.start[sg + 1];
    V s[kVecs], z[kVecs];
    group_params(a, p, segs.group[sg], s, z);
    const auto store = [&](int64_t i, const V* q) {
      for (int v = 0; v < kVecs; ++v) Isa::store(buf + (i - k0) * kGemmPanel + v * kLanes, Isa::mul(Isa::sub(q[v], z[v]), s[v]));
    };
    for (int64_t i = s0; i < s1;) {
      const uint8_t* row = w + (i - k0) * kGemmPanel * Bits / 8;
      V lo[kVecs], hi[kVecs];
      if constexpr (Bits == 8) {
        Isa::int8(reinterpret_cast<const int8_t*>(row), lo);
        store(i++, lo);
      } else {
        Isa::int4(row, lo, hi);
        store(i++, lo);
        if (i < s1) store(i++, hi);
      }
    }
  }
}

// One register tile over a dequantized slice: c[R x cols] (+)= a[R x kc] * buf[kc x 16]; the first
// slice (add = false) starts from the bias.
template <int R>
void tile(const float* x, int64_t ldx, const float* buf, int64_t kc, float* y, int64_t ldy, int cols, bool add,
          const V* bias) {
  // Every loop over r unrolled: with one left rolled, GCC kept the accumulators on the stack and the
  // tile ran at a third of its FMA rate (AVX2, Zen 3: 32-row int4 / int8 GEMMs 2.7x slower than bf16).
  V acc[R][kVecs];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVecs; ++v) acc[r][v] = add ? Isa::zero() : bias[v];
  }
  for (int64_t i = 0; i < kc; ++i) {
    V b[kVecs];
    load16(buf + i * kGemmPanel, b);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V xr = Isa::bcast(x + r * ldx + i);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = Isa::fma(xr, b[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) put(y + r * ldy, acc[r], cols, add);
}

template <int Bits>
void panels_buffered(const QuantGemmArgs& a, const Segments& segs, int64_t p0, int64_t p1) {
  const int64_t panels = gemm_panels(a.n);
  alignas(64) float buf[kQuantKc * kGemmPanel];
  const int64_t kp = padded_depth(a.k, Bits);
  for (int64_t k0 = 0, slice = 0; k0 < a.k; k0 += kQuantKc, ++slice) {
    const int64_t kc = std::min(kQuantKc, a.k - k0);
    for (int64_t m0 = 0; m0 < a.m; m0 += kQuantMc) {
      const int64_t mc = std::min(kQuantMc, a.m - m0);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t col0 = p * kGemmPanel;
        const int cols = static_cast<int>(std::min(kGemmPanel, a.n - col0));
        dequant_slice<Bits>(a, segs, slice, p, k0, a.packed + slice_bytes(panels, kp, p, k0, Bits), buf);
        V bias[kVecs];
        load_bias(a, col0, cols, k0 == 0, bias);
        const float* x = a.x + m0 * a.x_stride + k0;
        float* y = a.y + m0 * a.y_stride + col0;
        row_tiles<Isa::kTileRows>(mc, [&]<int R>(int64_t, int64_t r) {
          tile<R>(x + r * a.x_stride, a.x_stride, buf, kc, y + r * a.y_stride, a.y_stride, cols, k0 > 0, bias);
        });
      }
    }
  }
}

// The in-register path over the thread's panels, its rows in tiles (row_tiles) that each decode a
// panel's slice while it is in L1: on AVX2 two tiles of 4 rows decoding twice ran 1.1x faster than
// one dequantized buffer under 6 + 2 rows.
template <int Bits>
void panels_direct(const QuantGemmArgs& a, const Segments& segs, const RowPrep& rows, int64_t p0, int64_t p1) {
  const int64_t panels = gemm_panels(a.n);
  const int64_t kp = padded_depth(a.k, Bits);
  const float* x = Bits == 4 ? rows.pairs.data() : a.x;
  const int64_t ldx = Bits == 4 ? kp : a.x_stride;
  for (int64_t k0 = 0, slice = 0; k0 < a.k; k0 += kQuantKc, ++slice) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* w = a.packed + slice_bytes(panels, kp, p, k0, Bits);
      const uint8_t* ahead = panel_ahead(a, k0, p, p0, p1);
      row_tiles<Isa::direct_tile_rows(Bits)>(a.m, [&]<int R>(int64_t, int64_t r) {
        direct_slice<R, Bits>(a, segs, slice, p, k0, w, ahead, x + r * ldx, ldx, rows.xsum.data() + r * segs.count(),
                              a.y + r * a.y_stride);
      });
    }
  }
}

// The thread's panels [p0, p1) with the path for a.m rows (`rows`: what the in-register path reads).
template <int Bits>
void run_panels(const QuantGemmArgs& a, const Segments& segs, const RowPrep& rows, int64_t p0, int64_t p1) {
  if (a.m > Isa::kDirectRows) {
    panels_buffered<Bits>(a, segs, p0, p1);
  } else {
    panels_direct<Bits>(a, segs, rows, p0, p1);
  }
}

void run(const QuantGemmArgs& a, const Segments& segs, const RowPrep& rows, int64_t p0, int64_t p1) {
  if (a.bits == 8) {
    run_panels<8>(a, segs, rows, p0, p1);
  } else {
    run_panels<4>(a, segs, rows, p0, p1);
  }
}
