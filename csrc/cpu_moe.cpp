#include "cpu_moe.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cpu_bf16_avx512.h"
#include "cpu_gate_up_act.h"
#include "cpu_gemm.h"
#include "cpu_gemm_quant.h"
#include "cpu_isa.h"
#include "cpu_math.h"
#include "cpu_parallel.h"
#include "cpu_scratch.h"

// What has_avx512() asks for (F, BW, VL, DQ); with F alone the loops ran 3% slower (a bf16 prefill).
#define NANOVLLM_AVX512_LOOPS __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

namespace nanovllm {
namespace {

// The combine sums this many columns of a row at a time in registers.
constexpr int64_t kCombineColumns = 64;
// Up to this many rows per chosen expert on average, a layer splits its experts over the team whole
// rather than each expert's panels whatever the balance (experts_typed).
constexpr int64_t kMaxRowsPerExpertWhole = 8;
// An expert's weights' stream counted as this many of its rows' multiply-adds when the experts are
// shared out whole (Zen 3, 2 threads: ~13 for fp32 weights, ~7 for bf16).
constexpr int64_t kWeightRows = 8;
// Above a decode step's rows, experts go whole only if no thread's share costs more than this
// fraction over an even split: one hot expert is better cut by panels.
constexpr double kWholeImbalance = 0.05;

// The chosen experts cut into a team's contiguous shares (thread t's [first(t, team), first(t + 1,
// team))) whose costs (rows + kWeightRows each) cut the total as evenly as the experts' boundaries
// allow: the test of whether experts taken whole balance the team (they are then handed out one at
// a time, most_rows_first, which balanced a decode step's threads better than these shares).
class ExpertShares {
 public:
  ExpertShares(const std::vector<int32_t>& chosen, const std::vector<int32_t>& offsets) : prefix_(chosen.size() + 1, 0) {
    for (size_t i = 0; i < chosen.size(); ++i) {
      prefix_[i + 1] = prefix_[i] + offsets[chosen[i] + 1] - offsets[chosen[i]] + kWeightRows;
    }
  }
  // Whether no share of `team` costs more than kWholeImbalance over an even split.
  bool even(int64_t team) const {
    int64_t most = 0;
    for (int64_t t = 0; t < team; ++t) most = std::max(most, prefix_[first(t + 1, team)] - prefix_[first(t, team)]);
    return static_cast<double>(most * team) <= (1.0 + kWholeImbalance) * static_cast<double>(prefix_.back());
  }

 private:
  int64_t first(int64_t t, int64_t team) const {
    const int64_t goal = prefix_.back() * t / team;
    const auto at = std::lower_bound(prefix_.begin(), prefix_.end(), goal);
    int64_t i = at - prefix_.begin();
    if (i > 0 && goal - prefix_[i - 1] < prefix_[i] - goal) --i;  // the nearer boundary
    return i;
  }

  std::vector<int64_t> prefix_;
};

// The experts by rows, most first (ties in expert order): handed out one at a time from a shared
// counter, a thread that finishes early takes the next, and the last ones are the cheapest. Shares
// fixed ahead (ExpertShares) left the threads' ends of a decode step's experts 7.9% of the layer's
// time apart, as the two threads' streams' rates differ; handed out, 2.8% (bf16, Intel Xeon with AMX).
std::vector<int32_t> most_rows_first(std::vector<int32_t> experts, const std::vector<int32_t>& offsets) {
  std::stable_sort(experts.begin(), experts.end(), [&offsets](int32_t l, int32_t r) {
    return offsets[l + 1] - offsets[l] > offsets[r + 1] - offsets[r];
  });
  return experts;
}

void route_row(const float* logits, int64_t experts, int64_t k, bool renormalize, int32_t* ids, float* weights) {
  float max = logits[0];
  for (int64_t e = 1; e < experts; ++e) max = std::max(max, logits[e]);
  float sum = 0.0f;
  for (int64_t e = 0; e < experts; ++e) sum += std::exp(logits[e] - max);
  // The k largest logits (softmax keeps the order), by insertion into the sorted list of those so
  // far; `>` keeps the lower id ahead on a tie.
  int64_t n = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const float v = logits[e];
    if (n == k && !(v > logits[ids[k - 1]])) continue;
    int64_t i = n < k ? n++ : k - 1;
    for (; i > 0 && v > logits[ids[i - 1]]; --i) ids[i] = ids[i - 1];
    ids[i] = static_cast<int32_t>(e);
  }
  float total = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    weights[j] = std::exp(logits[ids[j]] - max) / sum;
    total += weights[j];
  }
  if (renormalize) {
    for (int64_t j = 0; j < k; ++j) weights[j] /= total;
  }
}

// Columns [col_begin, col_end) of rows [begin, end) of the combine; `position` is the inverse of
// `sorted`. An expert's output is rounded to TO first, as the torch layers hold it in the
// activations' dtype. Always inlined, so that it takes its caller's vector width: AVX2's eight
// lanes inside the fused layer (the baseline's four left the combine at 4-7% of a MoE prefill), the
// baseline in moe_combine, which also runs on CPUs without AVX2.
template <typename TY, typename TO>
[[gnu::always_inline]] inline void combine_rows(const TY* y, int64_t y_stride, const int32_t* position,
                                                const float* weights, int64_t k, TO* out, int64_t out_stride,
                                                int64_t begin, int64_t end, int64_t col_begin, int64_t col_end) {
  for (int64_t row = begin; row < end; ++row) {
    for (int64_t h0 = col_begin; h0 < col_end; h0 += kCombineColumns) {
      const int64_t cols = std::min(kCombineColumns, col_end - h0);
      float acc[kCombineColumns] = {};
      for (int64_t j = 0; j < k; ++j) {
        const float w = weights[row * k + j];
        const TY* __restrict src = y + position[row * k + j] * y_stride + h0;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) acc[c] += w * round_to<TO>(widen(src[c]));
      }
      TO* __restrict dst = out + row * out_stride + h0;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) narrow(acc[c], dst + c);
    }
  }
}

std::vector<int32_t> inverse(const int32_t* sorted, int64_t n) {
  std::vector<int32_t> position(n);
  for (int64_t r = 0; r < n; ++r) position[sorted[r]] = static_cast<int32_t>(r);
  return position;
}

// The calling thread's scratch (csrc/cpu_scratch.h: on huge pages from 2 MiB), kept from call to
// call and grown as needed (never released: a 2048-row step's layer-wide buffers are ~100 MB for the
// Qwen3-MoE-shaped model, a few hundred MB for a Qwen3-30B-A3B-shaped one); fresh ones (mmap'ed by
// malloc) took ~5,000 page faults per layer, every call. Slot 0 holds what the layer's team shares,
// slot 1 a team thread's own rows (the caller is a team thread too).
template <int Slot = 0>
std::byte* scratch(int64_t bytes) {
  thread_local GrowingScratch buffer;
  return buffer.at_least(bytes);
}

// Carves typed arrays, each 64-byte aligned, out of one scratch buffer.
class Carver {
 public:
  explicit Carver(std::byte* base) : base_(base) {}
  template <typename U>
  U* take(int64_t count) {
    U* at = reinterpret_cast<U*>(base_ + used_);
    used_ += (count * static_cast<int64_t>(sizeof(U)) + 63) / 64 * 64;
    return at;
  }

 private:
  std::byte* base_;
  int64_t used_ = 0;
};

// [begin, end) of n items split evenly over a team.
struct Share {
  int64_t begin, end;
  Share(int64_t n, int64_t thread, int64_t team) : begin(n * thread / team), end(n * (thread + 1) / team) {}
};

// Our GEMM's packed experts (gemm_panel_range): fp32 rows on the dense kernel's fp32 tiles (the
// AVX-512 pair tiles on fp32 weights packed in pairs, else AVX2's; bf16 weights widened), bf16 rows on
// the AVX512-BF16 pair tiles.
class DenseExperts {
 public:
  // With bf16 rows the GEMMs write the layer's bf16 values themselves: gate_up() SiLU(gate) * up
  // into act, down() its output rounded into y_bf16.
  static constexpr bool kBf16Epilogues = true;

  explicit DenseExperts(const MoeExpertsArgs& a)
      : a_(a),
        w13_bytes_(gemm_packed_elements(moe_gate_up_rows(a.layer.inter), a.layer.hidden) * weight_bytes()),
        w2_bytes_(gemm_packed_elements(a.layer.hidden, moe_down_depth(a.layer.inter, a.bf16_pairs())) *
                  weight_bytes()) {}

  template <typename A>
  void gate_up(int32_t e, const A* x, int64_t x_stride, float* y, int64_t y_stride, int64_t m, int64_t p0, int64_t p1,
               Bf16* act = nullptr) const {
    const char* packed = static_cast<const char*>(a_.w13) + e * w13_bytes_;
    const int64_t rows = moe_gate_up_rows(a_.layer.inter);
    if constexpr (std::is_same_v<A, Bf16>) {
      gemm(x, x_stride, packed, y, y_stride, m, rows, a_.layer.hidden, p0, p1, nullptr, act);
    } else {
      gemm(x, x_stride, packed, y, y_stride, m, rows, a_.layer.hidden, p0, p1);
    }
  }
  template <typename A>
  void down(int32_t e, const A* x, int64_t x_stride, float* y, int64_t y_stride, int64_t m, int64_t p0, int64_t p1,
            Bf16* y_bf16 = nullptr) const {
    const char* packed = static_cast<const char*>(a_.w2) + e * w2_bytes_;
    const int64_t depth = moe_down_depth(a_.layer.inter, a_.bf16_pairs());
    if constexpr (std::is_same_v<A, Bf16>) {
      gemm(x, x_stride, packed, y, y_stride, m, a_.layer.hidden, depth, p0, p1, y_bf16);
    } else {
      gemm(x, x_stride, packed, y, y_stride, m, a_.layer.hidden, depth, p0, p1);
    }
  }

 private:
  int64_t weight_bytes() const { return dtype_bytes(a_.weight_dtype); }
  void gemm(const float* x, int64_t x_stride, const char* packed, float* y, int64_t y_stride, int64_t m, int64_t n,
            int64_t k, int64_t p0, int64_t p1) const {
    gemm_panel_range({x, packed, nullptr, y, m, n, k, x_stride, y_stride, a_.weight_dtype, a_.pairs}, p0, p1);
  }
  void gemm(const Bf16* x, int64_t x_stride, const char* packed, float* y, int64_t y_stride, int64_t m, int64_t n,
            int64_t k, int64_t p0, int64_t p1, Bf16* y_bf16 = nullptr, Bf16* act = nullptr) const {
    GemmBf16Args g{x, reinterpret_cast<const Bf16*>(packed), nullptr, y, m, n, k, x_stride, y_stride};
    g.y_bf16 = y_bf16;
    g.act = act;
    gemm_bf16_panel_range(g, p0, p1);
  }

  const MoeExpertsArgs& a_;
  int64_t w13_bytes_, w2_bytes_;
};

// int8 / int4 experts (quant_gemm_panels): fp32 rows, or bf16 rows on the AVX512-BF16 path.
class QuantExperts {
 public:
  static constexpr bool kBf16Epilogues = false;  // quant_gemm_panels writes fp32 only

  explicit QuantExperts(const MoeQuantExpertsArgs& a) : a_(a) {}

  template <typename A>
  void gate_up(int32_t e, const A* x, int64_t x_stride, float* y, int64_t y_stride, int64_t m, int64_t p0,
               int64_t p1) const {
    gemm(a_.w13, e, x, x_stride, y, y_stride, m, moe_gate_up_rows(a_.layer.inter), a_.layer.hidden, p0, p1);
  }
  template <typename A>
  void down(int32_t e, const A* x, int64_t x_stride, float* y, int64_t y_stride, int64_t m, int64_t p0,
            int64_t p1) const {
    gemm(a_.w2, e, x, x_stride, y, y_stride, m, a_.layer.hidden, a_.layer.inter, p0, p1);
  }

 private:
  template <typename A>
  static void gemm(const MoeQuantWeights& w, int32_t e, const A* x, int64_t x_stride, float* y, int64_t y_stride,
                   int64_t m, int64_t n, int64_t k, int64_t p0, int64_t p1) {
    QuantGemmArgs g{};
    if constexpr (std::is_same_v<A, Bf16>) {
      g.x_bf16 = reinterpret_cast<const uint16_t*>(x);
    } else {
      g.x = x;
    }
    g.packed = w.packed + e * w.packed_stride;
    g.scales = w.scales + e * w.scales_stride;
    g.zeros = w.zeros == nullptr ? nullptr : w.zeros + e * w.scales_stride;
    g.y = y;
    g.m = m;
    g.n = n;
    g.k = k;
    g.x_stride = x_stride;
    g.y_stride = y_stride;
    g.group_size = w.group_size;
    g.bits = w.bits;
    g.zero_offset = w.zero_offset;
    quant_gemm_panels(g, QuantIsa::kAuto, p0, p1);
  }

  const MoeQuantExpertsArgs& a_;
};

// The layer's work, in one of two splits over the team:
//   - by experts (at least two chosen per thread): each thread takes chosen experts whole, one at a
//     time (gather, gate/up, SiLU-and-mul, down; most_rows_first), so that it streams each expert's
//     weights end to end, packs only its own experts' rows, and the layer has one barrier, before the
//     combine of its share of the columns. Taken on a decode step's few rows per expert (at most
//     kMaxRowsPerExpertWhole on average) whatever the shares' balance, on more rows when the shares
//     are even within kWholeImbalance;
//   - by panels (otherwise: few experts, one hot expert): each thread gathers its share of the
//     assignments' rows of x in expert order (xs, the GEMM input type A); after a barrier, its share
//     of the gate/up panels of every chosen expert (h), then SiLU(gate) * up of those panels' columns
//     (act): the packing interleaves 8 gate and 8 up rows per panel; after a barrier, its share of the
//     output panels of every chosen expert (y), then the combine of those columns for every row.
// By experts, the Qwen3-MoE-shaped model's 8 layers of fp32 experts (from DRAM, Zen 3, medians of
// pairs) ran 1.01-1.03x faster at 32 rows, 1.00-1.09x at one row, 1.00-1.05x at 512 (a prefill step:
// ~64 rows per expert; seven runs, none slower); the engine's fp32 / int4 / int8 batch prefill
// 1.05x / 1.05-1.09x / 1.02x, its int4 / int8 decode steps of 32 rows 1.00-1.06x / 1.03-1.06x (with
// the shares cut by count instead of cost, 0.88-1.00x / 0.90x).
// T is the activations' dtype; A the GEMMs' input: fp32 or bf16 rows (per kind of Experts).
#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics start from _mm*_undefined_*(), which -Wuninitialized reports once
// inlined (a known false positive), as in cpu_attention_bf16.h.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// combine_rows for fp32 or bf16 expert outputs into bf16 rows on AVX512-BF16 CPUs: the same roundings.
template <typename TY>
NANOVLLM_AVX512BF16 void combine_rows_bf16x16(const TY* y, int64_t y_stride, const int32_t* position,
                                                const float* weights, int64_t k, Bf16* out, int64_t out_stride,
                                                int64_t begin, int64_t end, int64_t col_begin, int64_t col_end) {
  using namespace bf16x16;
  for (int64_t row = begin; row < end; ++row) {
    for (int64_t c = col_begin; c < col_end; c += 16) {
      const __mmask16 live = lanes(col_end - c);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < k; ++j) {
        const TY* src = y + position[row * k + j] * y_stride + c;
        __m512 v;
        if constexpr (std::is_same_v<TY, Bf16>) {
          v = load(src, live);
        } else {
          v = round(_mm512_maskz_loadu_ps(live, src));
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(weights[row * k + j]), v, acc);
      }
      store(out + row * out_stride + c, acc, live);
    }
  }
}
#pragma GCC diagnostic pop
#endif

template <typename T, typename A, typename Experts>
void experts_typed(const MoeLayerArgs& a, const Experts& experts, int num_threads) {
  const int64_t k = a.top_k, assignments = a.rows * k, hidden = a.hidden, inter = a.inter;
  const int64_t inter8 = moe_gate_up_rows(inter) / 2, gate_up = 2 * inter8;
  std::vector<int32_t> ids(assignments), sorted(assignments), offsets(a.experts + 1);
  std::vector<float> weights(assignments);
  // Serial: a decode step's routing is a few microseconds, and a parallel region of its own
  // would add a synchronization of the team.
  moe_route({a.logits, a.logits_stride, a.rows, a.experts, k, a.renormalize, ids.data(), weights.data(),
             offsets.data(), sorted.data()},
            1);
  const std::vector<int32_t> position = inverse(sorted.data(), assignments);
  std::vector<int32_t> chosen;
  for (int64_t e = 0; e < a.experts; ++e) {
    if (offsets[e + 1] > offsets[e]) chosen.push_back(static_cast<int32_t>(e));
  }
  const int64_t a_bytes = static_cast<int64_t>(sizeof(A));
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  // Weights read plus multiply-adds, in elements: below kMinElementsPerThread a thread costs more.
  const int64_t work = static_cast<int64_t>(chosen.size() + assignments) * (gate_up + inter) * hidden;
  const int64_t threads = std::clamp<int64_t>(work / kMinElementsPerThread, 1, num_threads);
  const int64_t up_panels = gemm_panels(gate_up), down_panels = gemm_panels(hidden);
  const int64_t experts_hit = static_cast<int64_t>(chosen.size());
  const ExpertShares shares(chosen, offsets);
  const bool by_experts = experts_hit >= 2 * threads &&
                          (assignments <= kMaxRowsPerExpertWhole * experts_hit || shares.even(threads));
  // By experts: the chosen experts in the order they are handed out, and the next one's index.
  const std::vector<int32_t> by_rows = by_experts ? most_rows_first(chosen, offsets) : std::vector<int32_t>{};
  const int64_t most_rows = by_rows.empty() ? 0 : offsets[by_rows.front() + 1] - offsets[by_rows.front()];
  std::atomic<int64_t> next_expert{0};
  // The GEMMs' inputs and the gate/up products: assignment r's rows at r - origin. By experts each
  // thread keeps its own, reused expert after expert (they stay in its caches); by panels the team
  // shares one set for every assignment. The experts' outputs y are the combine's: one set.
  struct Rows {
    A* xs;
    float* h;
    A* act;
    int64_t origin;
  };
  const auto carve_rows = [&](Carver& carve, int64_t count) {
    A* xs = carve.take<A>(count * hidden);
    float* h = carve.take<float>(count * gate_up);
    return Rows{xs, h, carve.take<A>(count * inter8), 0};
  };
  const int64_t rows_bytes_each = (hidden + inter8) * a_bytes + gate_up * 4;
  // bf16 rows: the GEMMs write the layer's bf16 values themselves, the same bits. The gate/up GEMM
  // SiLU(gate) * up from its sums while they are in L1 (its fp32 product no longer goes to h and
  // back); the down GEMM the experts' outputs rounded (the combine rounds each before weighing it):
  // half the bytes written and read back, which at 2,048 tokens is 32 MB of fp32 a layer.
  constexpr bool kEpilogues = Experts::kBf16Epilogues && std::is_same_v<A, Bf16>;
  // Room for the rows shared by panels whichever way this call goes: a buffer sized by the first
  // call's way grew (all of its pages again) at the first call of the other, and the runner's warm-up
  // prefill (every token the same, a few experts: by experts) would not have sized it.
  Carver carve(scratch(assignments * (hidden * (kEpilogues ? 6 : 4) + rows_bytes_each) + 5 * 64));
  float* const y = carve.take<float>(assignments * hidden);
  Bf16* const y_bf16 = kEpilogues ? carve.take<Bf16>(assignments * hidden) : nullptr;
  const Rows shared = by_experts ? Rows{} : carve_rows(carve, assignments);

  const auto gather = [&](const Rows& w, int64_t begin, int64_t end) __attribute__((always_inline)) {
    for (int64_t r = begin; r < end; ++r) {
      const T* __restrict src = x + sorted[r] / k * a.x_stride;
      A* __restrict dst = w.xs + (r - w.origin) * hidden;
      if constexpr (std::is_same_v<T, A>) {
        std::copy_n(src, hidden, dst);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < hidden; ++c) narrow(widen(src[c]), dst + c);
      }
    }
  };
  // The 16-lane loops of csrc/cpu_bf16_avx512.h (bf16 rows' roundings by vcvtneps2bf16, SiLU) where
  // the CPU has AVX512-BF16.
  const bool bf16_convert = has_avx512_bf16();
  // Expert e's gate/up panels [p0, p1), then SiLU(gate) * up of their columns.
  static_assert(std::is_same_v<T, Bf16> || !std::is_same_v<A, Bf16>, "bf16 rows of SiLU-and-mul come rounded");
  const auto gate_up_act = [&](const Rows& w, int32_t e, int64_t p0, int64_t p1) __attribute__((always_inline)) {
    const int64_t first = offsets[e] - w.origin, m = offsets[e + 1] - offsets[e];
    if constexpr (kEpilogues) {  // SiLU(gate) * up by the GEMM, from its sums while they are in L1
      experts.gate_up(e, w.xs + first * hidden, hidden, w.h + first * gate_up, gate_up, m, p0, p1,
                      w.act + first * inter8);
      return;
    }
    experts.gate_up(e, w.xs + first * hidden, hidden, w.h + first * gate_up, gate_up, m, p0, p1);
    for (int64_t r = first; r < first + m; ++r) {
#if defined(__x86_64__)
      if constexpr (std::is_same_v<T, A>) {
        if (bf16_convert) {
          silu_mul_panels_x16(w.h + r * gate_up, w.act + r * inter8, p0, p1);
          continue;
        }
      }
#endif
      int64_t p = p0;
      // Two panels at a time: their 16 gate and 16 up columns gathered, then the math in 16 lanes
      // (AVX-512's registers; a panel's 8 filled half of one).
      for (; p + 2 <= p1; p += 2) {
        const float* __restrict pair = w.h + r * gate_up + p * kGemmPanel;
        A* __restrict dst = w.act + r * inter8 + p * kGemmPanel / 2;
        float g[kGemmPanel], u[kGemmPanel], v[kGemmPanel];
        for (int64_t c = 0; c < kGemmPanel / 2; ++c) {
          g[c] = pair[c];
          u[c] = pair[kGemmPanel / 2 + c];
          g[kGemmPanel / 2 + c] = pair[kGemmPanel + c];
          u[kGemmPanel / 2 + c] = pair[3 * kGemmPanel / 2 + c];
        }
#pragma omp simd
        for (int64_t c = 0; c < kGemmPanel; ++c) {
          v[c] = round_to<T>(round_to<T>(silu(round_to<T>(g[c]))) * round_to<T>(u[c]));
        }
#pragma omp simd
        for (int64_t c = 0; c < kGemmPanel; ++c) narrow_rounded(v[c], dst + c);
      }
      for (; p < p1; ++p) {
        const float* __restrict gate = w.h + r * gate_up + p * kGemmPanel;
        const float* __restrict up = gate + kGemmPanel / 2;
        A* __restrict dst = w.act + r * inter8 + p * kGemmPanel / 2;
        // In fp32 lanes first, then narrowed: one loop mixing fp32 math and bf16 stores vectorized in
        // half the lanes (a tenth of a bf16 prefill's time on AMX, where the GEMMs are fast).
        float v[kGemmPanel / 2];
#pragma omp simd
        for (int64_t c = 0; c < kGemmPanel / 2; ++c) {
          v[c] = round_to<T>(round_to<T>(silu(round_to<T>(gate[c]))) * round_to<T>(up[c]));
        }
#pragma omp simd
        for (int64_t c = 0; c < kGemmPanel / 2; ++c) narrow_rounded(v[c], dst + c);
      }
    }
  };
  const auto down = [&](const Rows& w, int32_t e, int64_t p0, int64_t p1) __attribute__((always_inline)) {
    const int64_t first = offsets[e];
    const A* act = w.act + (first - w.origin) * inter8;
    if constexpr (kEpilogues) {
      experts.down(e, act, inter8, y + first * hidden, hidden, offsets[e + 1] - first, p0, p1, y_bf16 + first * hidden);
    } else {
      experts.down(e, act, inter8, y + first * hidden, hidden, offsets[e + 1] - first, p0, p1);
    }
  };
  const auto thread_part = [&](int64_t t, int64_t team) __attribute__((always_inline)) {
    if (by_experts) {
      Carver own(scratch<1>(most_rows * rows_bytes_each + 3 * 64));
      Rows w = carve_rows(own, most_rows);
      for (int64_t i; (i = next_expert.fetch_add(1, std::memory_order_relaxed)) < experts_hit;) {
        const int32_t e = by_rows[i];
        w.origin = offsets[e];
        gather(w, offsets[e], offsets[e + 1]);
        gate_up_act(w, e, 0, up_panels);
        down(w, e, 0, down_panels);
      }
      // Every thread wrote rows of every column of y; the combine below reads them all.
#pragma omp barrier
    } else {
      const Share rows(assignments, t, team);
      gather(shared, rows.begin, rows.end);
#pragma omp barrier
      const PanelShare ups(up_panels, t, team);
      for (const int32_t e : chosen) gate_up_act(shared, e, ups.begin, ups.end);
#pragma omp barrier
      const PanelShare downs(down_panels, t, team);
      for (const int32_t e : chosen) down(shared, e, downs.begin, downs.end);  // the columns the combine reads
    }
    const PanelShare columns(down_panels, t, team);
    const int64_t col_begin = columns.begin * kGemmPanel, col_end = std::min(hidden, columns.end * kGemmPanel);
    // The experts' outputs as the down GEMM left them: rounded to bf16 (kEpilogues) or in fp32.
    const auto combine = [&](const auto* outputs) __attribute__((always_inline)) {
#if defined(__x86_64__)
      if constexpr (std::is_same_v<T, Bf16>) {
        if (bf16_convert) {
          combine_rows_bf16x16(outputs, hidden, position.data(), weights.data(), k, out, a.out_stride, 0, a.rows,
                               col_begin, col_end);
          return;
        }
      }
#endif
      combine_rows(outputs, hidden, position.data(), weights.data(), k, out, a.out_stride, 0, a.rows, col_begin,
                   col_end);
    };
    if constexpr (kEpilogues) {
      combine(y_bf16);
    } else {
      combine(y);
    }
  };
  // The gather, SiLU-and-mul and combine loops in AVX2's eight lanes where the CPU has them: in the
  // baseline's four, with bf16's rounding emulated, they were a fifth of a bf16 prefill's layer. On
  // AVX-512 CPUs in its registers (a bf16 batch prefill 1.04x faster on the Intel Xeon with AMX, where
  // the experts' GEMMs are fast). The quantized experts also run on CPUs without AVX2 (their portable
  // kernel), hence the choice.
  if (has_avx512()) {
    parallel_team(threads, [&](int64_t t, int64_t team) NANOVLLM_AVX512_LOOPS { thread_part(t, team); });
  } else if (has_avx2_fma()) {
    parallel_team(threads, [&](int64_t t, int64_t team) NANOVLLM_AVX2 { thread_part(t, team); });
  } else {
    parallel_team(threads, thread_part);
  }
}

}  // namespace

void moe_route(const MoeRouteArgs& a, int num_threads) {
  const int64_t k = a.top_k;
  parallel_rows(a.rows, a.experts * k, num_threads, [&a, k](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      route_row(a.logits + r * a.logits_stride, a.experts, k, a.renormalize, a.topk_ids + r * k,
                a.topk_weights + r * k);
    }
  });
  const int64_t assignments = a.rows * k;
  std::fill_n(a.expert_offsets, a.experts + 1, 0);
  for (int64_t i = 0; i < assignments; ++i) ++a.expert_offsets[a.topk_ids[i] + 1];
  std::partial_sum(a.expert_offsets, a.expert_offsets + a.experts + 1, a.expert_offsets);
  std::vector<int32_t> next(a.expert_offsets, a.expert_offsets + a.experts);
  for (int64_t i = 0; i < assignments; ++i) a.sorted[next[a.topk_ids[i]]++] = static_cast<int32_t>(i);
}

void moe_combine(const MoeCombineArgs& a, int num_threads) {
  const std::vector<int32_t> position = inverse(a.sorted, a.rows * a.top_k);
  parallel_rows(a.rows, a.top_k * a.hidden, num_threads, [&](int64_t begin, int64_t end) {
    if (a.dtype == CpuDtype::kFloat32) {
      combine_rows(static_cast<const float*>(a.y), a.y_stride, position.data(), a.topk_weights, a.top_k,
                   static_cast<float*>(a.out), a.out_stride, begin, end, 0, a.hidden);
    } else {
      combine_rows(static_cast<const Bf16*>(a.y), a.y_stride, position.data(), a.topk_weights, a.top_k,
                   static_cast<Bf16*>(a.out), a.out_stride, begin, end, 0, a.hidden);
    }
  });
}

namespace {
// The GEMMs' input per the activations' dtype: fp32 rows, or bf16 rows where the experts take them.
template <typename Experts>
void experts_for_dtype(const MoeLayerArgs& layer, const Experts& experts, bool bf16_inputs, int num_threads) {
  if (layer.rows == 0) return;
  if (layer.dtype == CpuDtype::kFloat32) {
    experts_typed<float, float>(layer, experts, num_threads);
  } else if (bf16_inputs) {
    experts_typed<Bf16, Bf16>(layer, experts, num_threads);
  } else {
    experts_typed<Bf16, float>(layer, experts, num_threads);
  }
}
}  // namespace

void moe_experts(const MoeExpertsArgs& a, int num_threads) {
  experts_for_dtype(a.layer, DenseExperts(a), a.bf16_pairs(), num_threads);
}

void moe_quant_experts(const MoeQuantExpertsArgs& a, int num_threads) {
  experts_for_dtype(a.layer, QuantExperts(a), a.bf16_rows, num_threads);
}

}  // namespace nanovllm
