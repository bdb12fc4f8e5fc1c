// A decoder's layers on the CPU in one call per forward: for each layer the input RMSNorm (with the
// residual add), the qkv projection, qkv_attention (q/k norm, rotary, K/V write, paged attention),
// the output projection, the post-attention RMSNorm, then gate/up, SiLU-and-mul and down, or a
// mixture of experts (the router, the experts' one call); then the final norm. Each step is the
// kernel the Python layers call (nanovllm/models/decoder.py), with the same inputs rounded the same
// way, so the hidden states are the same bits; what one call saves is the Python around ~12 kernel
// calls a layer (~0.15 ms a layer a step, most of a batch-1 decode step's time outside the
// kernels). nanovllm/models/cpu_stack.py builds it where a model's layers all take these kernels.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "cpu_attention.h"
#include "cpu_dtype.h"
#include "cpu_moe.h"
#include "cpu_scratch.h"

namespace nanovllm {

// One projection's weight, as its Python layer multiplies by it.
struct DecoderLinear {
  enum class Kind : int32_t {
    kDense = 0,      // gemm on gemm_pack's copy (fp32 or bf16 weights; fp32 activations)
    kDenseBf16 = 1,  // gemm_bf16 on a pair-packed bf16 weight (bf16 activations)
    kQuant = 2,      // quant_gemm on an int8 / int4 weight
  };
  Kind kind = Kind::kDense;
  int64_t n = 0, k = 0;
  const void* packed = nullptr;
  const float* bias = nullptr;  // nullable, fp32 [n]
  // kDense
  CpuDtype packed_dtype = CpuDtype::kFloat32;
  bool pairs = false;
  // kQuant
  const float* scales = nullptr;
  const int8_t* zeros = nullptr;
  int64_t group_size = 0;
  int bits = 0;
  float zero_offset = 0.0f;
  // bf16 activations go to quant_gemm as bf16 at bf16_min_rows (0: never) to bf16_max_rows (0: any)
  // rows: cpu_kernel.linear's rule (bf16_row_range).
  int64_t bf16_min_rows = 0, bf16_max_rows = 0;
};

// A mixture-of-experts MLP (in place of gate_up / down): the router's GEMM, its logits in the model
// dtype widened to fp32 (as the Python layer's .float()), then moe_experts or moe_quant_experts.
struct DecoderMoe {
  DecoderLinear router;  // [experts, hidden]
  // The layer's shape (hidden, inter, experts, top_k, renormalize, dtype); its rows, x, logits and
  // out are set per forward, as are the experts' below.
  MoeLayerArgs layer{};
  bool quantized = false;
  MoeExpertsArgs dense{};
  MoeQuantExpertsArgs quant{};
  // quantized: bf16 rows when a forward's assignments per chosen expert reach this (0: never):
  // cpu_moe._bf16_rows' rule.
  double bf16_min_per_expert = 0.0;
};

struct DecoderLayerWeights {
  DecoderLinear qkv, o, gate_up, down;  // gate_up and down unused with moe
  std::optional<DecoderMoe> moe;
  const void* input_norm = nullptr;  // [hidden], the model dtype
  const void* post_norm = nullptr;
  const void* q_norm = nullptr;      // nullable (no q/k norm): [head_dim]
  const void* k_norm = nullptr;
  const float* inv_freq = nullptr;   // [head_dim / 2]
  void* k_cache = nullptr;           // [num_blocks, block_size, kv_heads, head_dim]
  void* v_cache = nullptr;
};

struct DecoderShape {
  CpuDtype dtype = CpuDtype::kFloat32;
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t inter = 0;  // the dense MLPs'
  float eps = 0.0f;    // every RMSNorm's (the layers', the q/k norms', the final one)
  float scale = 0.0f;  // attention
};

// One forward's inputs. attn carries the step's attention metadata (block tables, lengths, sequence
// count, cache geometry); its query, caches and output are set per layer.
struct DecoderStep {
  const int32_t* input_ids = nullptr;  // [tokens], rows of the stack's embedding
  void* out = nullptr;                 // [tokens, hidden]: the final norm's output
  const int32_t* positions = nullptr;
  const int32_t* slot_mapping = nullptr;
  int64_t tokens = 0, slot_tokens = 0;
  int64_t covered = 0;  // rows the metadata's sequences cover; attention rows past them are zero
  PagedAttentionArgs attn{};
};

// Where the forwards' time went since DecoderStack::time_parts(true), in seconds (roofline.py's
// parts): the linear layers' GEMMs (a MoE router's too: roofline.py counts it with them),
// qkv_attention (q/k norm, rotary, the K/V write and paged attention), a MoE layer's experts, and
// the rest (the embedding rows, the RMSNorms, SiLU-and-mul, a router's logits widened). Read on the
// kernels as the engine runs them: timed on the Python layers under a profiler instead, attention
// read 1.2-1.3x its time here and the GEMMs 1.2-1.4x at 32 sequences (the parts summed past the
// step; Intel Xeon with AMX).
struct DecoderPartTimes {
  double gemm = 0.0, attention = 0.0, experts = 0.0, rest = 0.0;
  int64_t forwards = 0;
};

class DecoderStack {
 public:
  // The binding checks the weights' shapes against `shape` and that this CPU runs their kernels.
  // `embedding`: the token embedding [vocab, hidden] in the model dtype, which a step's input_ids
  // index (the lookup is a copy of rows: the Python embedding's torch calls cost tens of us a decode
  // step on caches the weights had just flushed).
  DecoderStack(const DecoderShape& shape, std::vector<DecoderLayerWeights> layers, const void* final_norm,
               int64_t block_size, int64_t num_blocks, const void* embedding, int64_t vocab);
  // Not reentrant: a forward uses the stack's buffers (one runner thread calls it).
  void forward(const DecoderStep& step, int num_threads);
  // Takes the buffers `other` grew, leaving it none: a stack built again for a new KV cache keeps
  // what the one before grew (the CPU runner's warm-up prefill runs before the cache exists).
  void adopt_buffers(DecoderStack& other);
  int64_t buffer_bytes() const;  // of the buffers kept now
  const DecoderShape& shape() const { return shape_; }
  const std::vector<DecoderLayerWeights>& layers() const { return layers_; }
  // The caches' geometry, which every forward's block tables and slots are checked against.
  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t vocab() const { return vocab_; }
  // Starts (from zero) or stops summing each forward's parts into part_times().
  void time_parts(bool on) {
    if (on) parts_ = {};
    timing_ = on;
  }
  const DecoderPartTimes& part_times() const { return parts_; }

 private:
  // x [tokens, k] in the model dtype -> y [tokens, n] in the model dtype.
  void linear(const DecoderLinear& w, const void* x, void* y, int64_t tokens, int num_threads);
  // A mixture-of-experts MLP: x [tokens, hidden] -> out [tokens, hidden], both in the model dtype.
  void experts(const DecoderMoe& e, const void* x, void* out, int64_t tokens, int num_threads);
  // A buffer for this forward (csrc/cpu_scratch.h: on huge pages from 2 MiB): kept for the next
  // while steps are at most kKeptTokens (decode, and prefill chunks up to the CPU's default budgets:
  // fresh buffers each 512-token step cost a dense bf16 batch prefill ~6% in page faults and cold
  // lines), released after a longer forward (a long prefill chunk's buffers run to hundreds of MB).
  static constexpr int64_t kKeptTokens = 2048;
  DecoderShape shape_;
  std::vector<DecoderLayerWeights> layers_;
  const void* final_norm_;
  int64_t block_size_, num_blocks_;
  const void* embedding_;
  int64_t vocab_;
  enum Buffer : int { kEmbedded, kResidual0, kResidual1, kNormed, kQkv, kAttnScratch, kAttnOut, kLayerOut, kGateUp, kAct,
                      kX32, kY32, kXBf16, kLogits, kLogits32, kAngles, kBuffers };
  // Whether every layer's inv_freq held the same values when the stack was built: a forward's
  // rotary cos and sin are then computed once, from the first layer's, for all layers
  // (rotary_angles). A layer's inv_freq changed in place later needs a new stack (nothing does so:
  // RotaryEmbedding replaces its tensor).
  bool shared_angles_ = false;
  std::array<GrowingScratch, kBuffers> scratch_;
  bool timing_ = false;
  DecoderPartTimes parts_;
  void* buffer(Buffer b, int64_t bytes) { return scratch_[b].at_least(bytes); }
  // Where a part's time goes while timing (time_parts), else null: DecoderPartTimes' field `p`.
  double* clock(double DecoderPartTimes::*p) { return timing_ ? &(parts_.*p) : nullptr; }
};

}  // namespace nanovllm
