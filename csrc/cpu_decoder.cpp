#include "cpu_decoder.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "cpu_fused_ops.h"
#include "cpu_gemm.h"
#include "cpu_gemm_quant.h"
#include "cpu_qkv_attention.h"

namespace nanovllm {

namespace {

using Clock = std::chrono::steady_clock;

// f(), its time added to *part where part is not null (DecoderStack::time_parts).
template <typename F>
void timed(double* part, const F& f) {
  if (part == nullptr) {
    f();
    return;
  }
  const Clock::time_point start = Clock::now();
  f();
  *part += std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

DecoderStack::DecoderStack(const DecoderShape& shape, std::vector<DecoderLayerWeights> layers, const void* final_norm,
                           int64_t block_size, int64_t num_blocks, const void* embedding, int64_t vocab)
    : shape_(shape), layers_(std::move(layers)), final_norm_(final_norm), block_size_(block_size),
      num_blocks_(num_blocks), embedding_(embedding), vocab_(vocab) {
  const int64_t half = shape_.head_dim / 2;
  shared_angles_ = !layers_.empty() && std::all_of(layers_.begin(), layers_.end(), [&](const DecoderLayerWeights& l) {
    return std::equal(l.inv_freq, l.inv_freq + half, layers_.front().inv_freq);
  });
}

void DecoderStack::adopt_buffers(DecoderStack& other) {
  for (size_t b = 0; b < scratch_.size(); ++b) scratch_[b] = std::exchange(other.scratch_[b], GrowingScratch{});
}

int64_t DecoderStack::buffer_bytes() const {
  int64_t total = 0;
  for (const GrowingScratch& b : scratch_) total += b.bytes;
  return total;
}

void DecoderStack::linear(const DecoderLinear& w, const void* x, void* y, int64_t m, int num_threads) {
  const bool bf16 = shape_.dtype == CpuDtype::kBFloat16;
  // fp32 rows of x: x itself in an fp32 model, else widened into scratch.
  const auto fp32_x = [&]() -> const float* {
    if (!bf16) return static_cast<const float*>(x);
    auto* wide = static_cast<float*>(buffer(kX32, m * w.k * static_cast<int64_t>(sizeof(float))));
    widen_n(static_cast<const Bf16*>(x), wide, m * w.k);
    return wide;
  };
  if (w.kind == DecoderLinear::Kind::kQuant) {
    // x / x_bf16 and y / y_bf16 by the activations' dtype, below.
    QuantGemmArgs a{.x = nullptr, .x_bf16 = nullptr, .packed = static_cast<const uint8_t*>(w.packed),
                    .scales = w.scales, .zeros = w.zeros, .bias = w.bias, .y = nullptr, .m = m, .n = w.n, .k = w.k,
                    .x_stride = w.k, .y_stride = w.n, .group_size = w.group_size, .bits = w.bits,
                    .zero_offset = w.zero_offset, .y_bf16 = nullptr};
    if (bf16 && w.bf16_min_rows > 0 && m >= w.bf16_min_rows && (w.bf16_max_rows == 0 || m <= w.bf16_max_rows)) {
      // bf16 activations in pairs of columns: an odd k gets a zero pad column (cpu_kernel._bf16_rows).
      a.x_stride = w.k + w.k % 2;
      if (w.k % 2 == 0) {
        a.x_bf16 = static_cast<const uint16_t*>(x);
      } else {
        auto* padded = static_cast<Bf16*>(buffer(kXBf16, m * a.x_stride * static_cast<int64_t>(sizeof(Bf16))));
        for (int64_t r = 0; r < m; ++r) {
          std::memcpy(padded + r * a.x_stride, static_cast<const Bf16*>(x) + r * w.k, w.k * sizeof(Bf16));
          padded[r * a.x_stride + w.k] = 0;
        }
        a.x_bf16 = padded;
      }
    } else {
      a.x = fp32_x();
    }
    if (bf16) {
      a.y_bf16 = static_cast<uint16_t*>(y);
    } else {
      a.y = static_cast<float*>(y);
    }
    quant_gemm(a, QuantIsa::kAuto, num_threads);
    return;
  }
  // Dense: the product in fp32, rounded to bf16 in a bf16 model (cpu/gemm.py's _gemm) by each thread
  // on its columns.
  float* out = bf16 ? static_cast<float*>(buffer(kY32, m * w.n * static_cast<int64_t>(sizeof(float))))
                    : static_cast<float*>(y);
  if (w.kind == DecoderLinear::Kind::kDenseBf16) {  // only in a bf16 stack (the binding checks)
    const GemmBf16Args g{static_cast<const Bf16*>(x), static_cast<const Bf16*>(w.packed), w.bias, out, m, w.n, w.k,
                         w.k, w.n};
    gemm_bf16_narrowed(g, static_cast<Bf16*>(y), num_threads);
    return;
  }
  const GemmArgs g{fp32_x(), w.packed, w.bias, out, m, w.n, w.k, w.k, w.n, w.packed_dtype, w.pairs};
  if (bf16) {
    gemm_narrowed(g, static_cast<Bf16*>(y), num_threads);
  } else {
    gemm(g, num_threads);
  }
}

void DecoderStack::experts(const DecoderMoe& e, const void* x, void* out, int64_t m, int num_threads) {
  const int64_t experts = e.layer.experts;
  void* logits = buffer(kLogits, m * experts * dtype_bytes(shape_.dtype));
  timed(clock(&DecoderPartTimes::gemm), [&] { linear(e.router, x, logits, m, num_threads); });
  const float* logits32 = static_cast<const float*>(logits);
  if (shape_.dtype == CpuDtype::kBFloat16) {
    auto* wide = static_cast<float*>(buffer(kLogits32, m * experts * static_cast<int64_t>(sizeof(float))));
    widen_n(static_cast<const Bf16*>(logits), wide, m * experts);
    logits32 = wide;
  }
  const MoeLayerArgs layer = e.layer.on_rows(x, e.layer.hidden, logits32, experts, m, out, e.layer.hidden);
  double* const experts_clock = clock(&DecoderPartTimes::experts);
  if (!e.quantized) {
    MoeExpertsArgs a = e.dense;
    a.layer = layer;
    timed(experts_clock, [&] { moe_experts(a, num_threads); });
    return;
  }
  MoeQuantExpertsArgs a = e.quant;
  a.layer = layer;
  const double assignments = static_cast<double>(m * layer.top_k);
  a.bf16_rows = e.bf16_min_per_expert > 0.0 &&
                assignments / std::max(1.0, std::min(static_cast<double>(experts), assignments)) >= e.bf16_min_per_expert;
  timed(experts_clock, [&] { moe_quant_experts(a, num_threads); });
}

void DecoderStack::forward(const DecoderStep& step, int num_threads) {
  const int64_t t = step.tokens;
  if (t == 0) return;
  const Clock::time_point start = timing_ ? Clock::now() : Clock::time_point{};
  const double timed_before = parts_.gemm + parts_.attention + parts_.experts;
  double* const gemm = clock(&DecoderPartTimes::gemm);
  const DecoderShape& s = shape_;
  const int64_t item = dtype_bytes(s.dtype);
  const int64_t q_row = s.heads * s.head_dim, kv_row = s.kv_heads * s.head_dim;
  const int64_t row = t * item;  // bytes of one column over the tokens
  void* normed = buffer(kNormed, row * s.hidden);
  void* qkv = buffer(kQkv, row * (q_row + 2 * kv_row));
  void* attn_scratch = buffer(kAttnScratch, row * (q_row + kv_row));
  void* attn_out = buffer(kAttnOut, row * q_row);
  void* layer_out = buffer(kLayerOut, row * s.hidden);
  void* residual[2] = {buffer(kResidual0, row * s.hidden), buffer(kResidual1, row * s.hidden)};
  // The layer's input and the residual stream: the embeddings alone before the first layer (whose
  // norm has no residual to add), then each layer's output and the stream its norm adds it to.
  // The embeddings: rows of the table (the binding checked the ids against vocab_).
  const int64_t row_bytes = s.hidden * item;
  auto* embedded = static_cast<std::byte*>(buffer(kEmbedded, t * row_bytes));
  for (int64_t i = 0; i < t; ++i) {
    std::memcpy(embedded + i * row_bytes, static_cast<const std::byte*>(embedding_) + step.input_ids[i] * row_bytes,
                row_bytes);
  }
  // The rotary angles once for every layer where they share inv_freq.
  float* angles = nullptr;
  if (shared_angles_) {
    angles = static_cast<float*>(buffer(kAngles, t * s.head_dim * static_cast<int64_t>(sizeof(float))));
    rotary_angles({nullptr, nullptr, step.positions, layers_.front().inv_freq, t, s.heads, s.kv_heads, s.head_dim, 0,
                   0, s.dtype},
                  angles, num_threads);
  }
  const void* hidden = embedded;
  const void* stream = nullptr;
  int next = 0;
  const auto norm = [&](const void* x, const void* weight, void* out) {
    void* stream_out = stream == nullptr ? nullptr : residual[next];
    rms_norm({x, stream, weight, out, stream_out, t, s.hidden, 1, s.hidden, s.eps, s.dtype}, num_threads);
    if (stream == nullptr) {
      stream = x;
    } else {
      stream = stream_out;
      next ^= 1;
    }
  };
  for (const DecoderLayerWeights& l : layers_) {
    norm(hidden, l.input_norm, normed);
    timed(gemm, [&] { linear(l.qkv, normed, qkv, t, num_threads); });
    QkvAttentionArgs qa{.qkv = qkv, .q_norm = l.q_norm, .k_norm = l.k_norm, .positions = step.positions,
                        .inv_freq = l.inv_freq, .scratch = attn_scratch, .slot_mapping = step.slot_mapping,
                        .k_cache = l.k_cache, .v_cache = l.v_cache, .tokens = t, .qkv_stride = q_row + 2 * kv_row,
                        .slot_tokens = step.slot_tokens, .eps = s.eps, .attn = step.attn, .angles = angles};
    qa.attn.out = attn_out;
    timed(clock(&DecoderPartTimes::attention), [&] { qkv_attention(qa, num_threads); });
    if (step.covered < t) {  // padding rows: zero, as cpu_backend's _zero_padding leaves them
      std::memset(static_cast<char*>(attn_out) + step.covered * q_row * item, 0, (t - step.covered) * q_row * item);
    }
    timed(gemm, [&] { linear(l.o, attn_out, layer_out, t, num_threads); });
    norm(layer_out, l.post_norm, normed);
    if (l.moe) {
      experts(*l.moe, normed, layer_out, t, num_threads);  // timed inside: the router's GEMM, the experts
    } else {
      void* gate_up = buffer(kGateUp, row * 2 * s.inter);
      void* act = buffer(kAct, row * s.inter);
      timed(gemm, [&] { linear(l.gate_up, normed, gate_up, t, num_threads); });
      silu_and_mul({gate_up, act, t, s.inter, 2 * s.inter, s.dtype}, num_threads);
      timed(gemm, [&] { linear(l.down, act, layer_out, t, num_threads); });
    }
    hidden = layer_out;
  }
  norm(hidden, final_norm_, step.out);
  if (timing_) {
    const double whole = std::chrono::duration<double>(Clock::now() - start).count();
    parts_.rest += whole - (parts_.gemm + parts_.attention + parts_.experts - timed_before);
    ++parts_.forwards;
  }
  if (t > kKeptTokens) {
    for (GrowingScratch& b : scratch_) b = GrowingScratch{};
  }
}

}  // namespace nanovllm
