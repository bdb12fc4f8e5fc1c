// pybind11 module `nanovllm._cpu`: the CPU math kernels (paged attention, fused layers, sampler,
// GEMM, mixture of experts). They take raw pointers, sizes and strides; the Python wrappers in nanovllm/cpu/ check the
// tensors, and everything a pointer's extent depends on is checked again here, at the boundary.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "binding_checks.h"
#include "cpu_attention.h"
#include "cpu_decoder.h"
#include "cpu_fused_ops.h"
#include "cpu_gemm.h"
#include "cpu_gemm_quant.h"
#include "cpu_isa.h"
#include "cpu_moe.h"
#include "cpu_qkv_attention.h"
#include "cpu_sampler.h"

namespace py = pybind11;
using namespace nanovllm;
using namespace nanovllm::binding;

namespace {

// A CpuDtype argument (0 fp32, 1 bf16) from Python.
CpuDtype checked_dtype(int64_t dtype, const char* name) {
  return static_cast<CpuDtype>(checked_int32(dtype, name, 0, 1));
}

// The attention arguments every call reads (all but the query, the output and the caches), each
// checked: every row the kernel writes and every block it reads must exist, one pass over the used
// entries.
PagedAttentionArgs checked_attention_args(uintptr_t block_tables, uintptr_t context_lens, uintptr_t cu_seqlens_q,
                                          int64_t num_tokens, int64_t block_table_stride, int64_t num_seqs,
                                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                          int64_t block_size, int64_t num_blocks, double scale, int64_t dtype,
                                          const char* what) {
  PagedAttentionArgs a{};
  a.num_seqs = checked_int32(num_seqs, "num_seqs", 0);
  a.num_heads = checked_int32(num_heads, "num_heads", 1);
  a.num_kv_heads = checked_int32(num_kv_heads, "num_kv_heads", 1);
  if (a.num_heads % a.num_kv_heads != 0) value_error("num_heads must be a multiple of num_kv_heads");
  a.head_dim = checked_int32(head_dim, "head_dim", 1, 1 << 12);
  a.block_size = checked_int32(block_size, "block_size", 1, 1 << 16);
  a.block_table_stride = checked_int32(block_table_stride, "block_table_stride", 0);
  checked_int32(num_blocks, "num_blocks", 1);
  checked_int32(num_tokens, "num_tokens", 0);
  a.dtype = checked_dtype(dtype, "dtype");
  if (a.num_seqs > 0 && (!block_tables || !context_lens || !cu_seqlens_q)) {
    value_error(std::string("null pointer passed to ") + what);
  }
  a.block_tables = reinterpret_cast<const int32_t*>(block_tables);
  a.context_lens = reinterpret_cast<const int32_t*>(context_lens);
  a.cu_seqlens_q = reinterpret_cast<const int32_t*>(cu_seqlens_q);
  a.scale = static_cast<float>(scale);
  if (a.num_seqs > 0 && a.cu_seqlens_q[0] != 0) value_error("cu_seqlens_q[0] must be 0");
  for (int32_t i = 0; i < a.num_seqs; ++i) {
    const int64_t q_len = static_cast<int64_t>(a.cu_seqlens_q[i + 1]) - a.cu_seqlens_q[i];
    if (q_len < 0 || a.cu_seqlens_q[i + 1] > num_tokens) {
      value_error("cu_seqlens_q[" + std::to_string(i) + "] out of range");
    }
    const int64_t ctx = a.context_lens[i];
    const int64_t used = (ctx + a.block_size - 1) / a.block_size;
    if (ctx < q_len || used > a.block_table_stride) value_error("context_lens[" + std::to_string(i) + "] out of range");
    const int32_t* row = a.block_tables + static_cast<int64_t>(i) * a.block_table_stride;
    for (int64_t b = 0; b < used; ++b) {
      if (row[b] < 0 || row[b] >= num_blocks) {
        throw py::index_error("block_tables[" + std::to_string(i) + ", " + std::to_string(b) + "] = " +
                              std::to_string(row[b]) + " is not a block of the cache");
      }
    }
  }
  return a;
}

// slot_mapping[0, num_tokens) within [-1, num_slots).
void check_slots(const int32_t* slots, int64_t num_tokens, int64_t num_slots) {
  for (int64_t i = 0; i < num_tokens; ++i) {
    if (slots[i] >= num_slots || slots[i] < -1) {
      throw py::index_error("slot_mapping[" + std::to_string(i) + "] = " + std::to_string(slots[i]) +
                            " is not a slot of the cache");
    }
  }
}

void bind_cpu_attention(py::module_& m) {
  m.def(
      "paged_attention_cpu",
      [](uintptr_t query, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_tables, uintptr_t context_lens,
         uintptr_t cu_seqlens_q, uintptr_t out, int64_t num_tokens, int64_t block_table_stride, int64_t num_seqs,
         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
         double scale, int64_t dtype, int64_t num_threads) {
        PagedAttentionArgs a =
            checked_attention_args(block_tables, context_lens, cu_seqlens_q, num_tokens, block_table_stride, num_seqs,
                                   num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, dtype,
                                   "paged_attention_cpu");
        if (!query || !k_cache || !v_cache || !out) value_error("null pointer passed to paged_attention_cpu");
        a.query = reinterpret_cast<const void*>(query);
        a.k_cache = reinterpret_cast<const void*>(k_cache);
        a.v_cache = reinterpret_cast<const void*>(v_cache);
        a.out = reinterpret_cast<void*>(out);
        py::gil_scoped_release release;
        paged_attention(a, static_cast<int>(std::max<int64_t>(1, num_threads)));
      },
      py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
      py::arg("cu_seqlens_q"), py::arg("out"), py::arg("num_tokens"), py::arg("block_table_stride"),
      py::arg("num_seqs"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"),
      py::arg("num_blocks"), py::arg("scale"), py::arg("dtype"), py::arg("num_threads") = 1,
      "Paged attention (decode rows and prefill chunks) over the cache, fp32 (dtype 0) or bf16 (1), from raw "
      "pointers of contiguous host tensors (nanovllm.attention.cpu_backend checks the tensors before calling).");
  m.def(
      "write_kv_cache_cpu",
      [](uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache, uintptr_t slot_mapping,
         int64_t num_tokens, int64_t row_bytes, int64_t key_stride, int64_t value_stride, int64_t num_slots) {
        if (num_tokens < 0 || row_bytes < 1 || key_stride < row_bytes || value_stride < row_bytes) {
          value_error("write_kv_cache_cpu: bad sizes");
        }
        if (num_tokens > 0 && (!key || !value || !k_cache || !v_cache || !slot_mapping)) {
          value_error("null pointer passed to write_kv_cache_cpu");
        }
        const auto* slots = reinterpret_cast<const int32_t*>(slot_mapping);
        check_slots(slots, num_tokens, num_slots);
        const KVWriteArgs a{reinterpret_cast<const char*>(key), reinterpret_cast<const char*>(value),
                            reinterpret_cast<char*>(k_cache), reinterpret_cast<char*>(v_cache), slots,
                            num_tokens, row_bytes, key_stride, value_stride};
        py::gil_scoped_release release;
        write_kv_cache(a);
      },
      py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
      py::arg("num_tokens"), py::arg("row_bytes"), py::arg("key_stride"), py::arg("value_stride"),
      py::arg("num_slots"),
      "Scatter K/V rows into their cache slots (-1 = skip), from raw pointers (cpu_backend checks the tensors).");
  m.def(
      "qkv_attention_cpu",
      [](uintptr_t qkv, uintptr_t q_norm, uintptr_t k_norm, uintptr_t positions, uintptr_t inv_freq, uintptr_t scratch,
         uintptr_t slot_mapping, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_tables, uintptr_t context_lens,
         uintptr_t cu_seqlens_q, uintptr_t out, int64_t num_tokens, int64_t qkv_stride, int64_t slot_tokens,
         int64_t block_table_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
         int64_t block_size, int64_t num_blocks, double eps, double scale, int64_t dtype, int64_t num_threads) {
        QkvAttentionArgs a{};
        a.attn = checked_attention_args(block_tables, context_lens, cu_seqlens_q, num_tokens, block_table_stride,
                                        num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
                                        dtype, "qkv_attention_cpu");
        if (head_dim % 2 || head_dim > kMaxRotaryDim) {
          value_error("qkv_attention_cpu: head_dim must be even and at most " + std::to_string(kMaxRotaryDim));
        }
        if (qkv_stride < (num_heads + 2 * num_kv_heads) * head_dim || slot_tokens < 0 || slot_tokens > num_tokens) {
          value_error("qkv_attention_cpu: bad sizes");
        }
        if ((q_norm == 0) != (k_norm == 0)) value_error("qkv_attention_cpu: q_norm and k_norm come together");
        if (!k_cache || !v_cache || !out ||
            (num_tokens > 0 && (!qkv || !positions || !inv_freq || !scratch || (slot_tokens > 0 && !slot_mapping)))) {
          value_error("null pointer passed to qkv_attention_cpu");
        }
        a.qkv = reinterpret_cast<const void*>(qkv);
        a.q_norm = reinterpret_cast<const void*>(q_norm);
        a.k_norm = reinterpret_cast<const void*>(k_norm);
        a.positions = reinterpret_cast<const int32_t*>(positions);
        a.inv_freq = reinterpret_cast<const float*>(inv_freq);
        a.scratch = reinterpret_cast<void*>(scratch);
        a.slot_mapping = reinterpret_cast<const int32_t*>(slot_mapping);
        a.k_cache = reinterpret_cast<void*>(k_cache);
        a.v_cache = reinterpret_cast<void*>(v_cache);
        a.attn.out = reinterpret_cast<void*>(out);
        a.tokens = num_tokens;
        a.qkv_stride = qkv_stride;
        a.slot_tokens = slot_tokens;
        a.eps = static_cast<float>(eps);
        check_slots(a.slot_mapping, slot_tokens, num_blocks * block_size);
        py::gil_scoped_release release;
        qkv_attention(a, static_cast<int>(std::clamp<int64_t>(num_threads, 1, 1024)));
      },
      py::arg("qkv"), py::arg("q_norm"), py::arg("k_norm"), py::arg("positions"), py::arg("inv_freq"),
      py::arg("scratch"), py::arg("slot_mapping"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
      py::arg("context_lens"), py::arg("cu_seqlens_q"), py::arg("out"), py::arg("num_tokens"), py::arg("qkv_stride"),
      py::arg("slot_tokens"), py::arg("block_table_stride"), py::arg("num_seqs"), py::arg("num_heads"),
      py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"), py::arg("num_blocks"), py::arg("eps"),
      py::arg("scale"), py::arg("dtype"), py::arg("num_threads") = 1,
      "q/k RMSNorm (when given), rotary, the K/V write and paged attention of one layer from its qkv rows, from raw "
      "pointers (cpu_backend checks the tensors).");
}

void bind_cpu_fused_ops(py::module_& m) {
  m.def(
      "rms_norm_cpu",
      [](uintptr_t x, uintptr_t residual, uintptr_t weight, uintptr_t out, uintptr_t residual_out, int64_t rows,
         int64_t hidden, int64_t heads, int64_t x_stride, double eps, int64_t dtype, int64_t num_threads) {
        if (rows < 0 || hidden < 1 || heads < 1 || x_stride < heads * hidden) value_error("rms_norm_cpu: bad sizes");
        if ((rows > 0 && (!x || !weight || !out)) || (residual && !residual_out)) {
          value_error("null pointer passed to rms_norm_cpu");
        }
        const RmsNormArgs a{reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(residual),
                            reinterpret_cast<const void*>(weight), reinterpret_cast<void*>(out),
                            reinterpret_cast<void*>(residual_out), rows, hidden, heads, x_stride,
                            static_cast<float>(eps), checked_dtype(dtype, "dtype")};
        py::gil_scoped_release release;
        rms_norm(a, static_cast<int>(std::clamp<int64_t>(num_threads, 1, 1024)));
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("out"), py::arg("residual_out"), py::arg("rows"),
      py::arg("hidden"), py::arg("heads"), py::arg("x_stride"), py::arg("eps"), py::arg("dtype"),
      py::arg("num_threads") = 1,
      "RMSNorm (with an optional fused residual add) from raw pointers (nanovllm.cpu.fused_ops checks the tensors).");
  m.def(
      "silu_and_mul_cpu",
      [](uintptr_t x, uintptr_t out, int64_t rows, int64_t inner, int64_t x_stride, int64_t dtype, int64_t num_threads) {
        if (rows < 0 || inner < 1 || x_stride < 2 * inner) value_error("silu_and_mul_cpu: bad sizes");
        if (rows > 0 && (!x || !out)) value_error("null pointer passed to silu_and_mul_cpu");
        const SiluAndMulArgs a{reinterpret_cast<const void*>(x), reinterpret_cast<void*>(out), rows, inner, x_stride,
                               checked_dtype(dtype, "dtype")};
        py::gil_scoped_release release;
        silu_and_mul(a, static_cast<int>(std::clamp<int64_t>(num_threads, 1, 1024)));
      },
      py::arg("x"), py::arg("out"), py::arg("rows"), py::arg("inner"), py::arg("x_stride"), py::arg("dtype"),
      py::arg("num_threads") = 1,
      "silu(gate) * up over [rows, 2 * inner] rows, from raw pointers (nanovllm.cpu.fused_ops checks the tensors).");
  m.def(
      "rotary_cpu",
      [](uintptr_t q, uintptr_t k, uintptr_t positions, uintptr_t inv_freq, int64_t tokens, int64_t q_heads,
         int64_t k_heads, int64_t head_dim, int64_t q_stride, int64_t k_stride, int64_t dtype, int64_t num_threads) {
        if (tokens < 0 || q_heads < 0 || k_heads < 0 || head_dim < 2 || head_dim % 2 || head_dim > kMaxRotaryDim ||
            q_stride < q_heads * head_dim || k_stride < k_heads * head_dim) {
          value_error("rotary_cpu: bad sizes (head_dim must be even and at most " + std::to_string(kMaxRotaryDim) + ")");
        }
        if (tokens > 0 && (!q || !k || !positions || !inv_freq)) value_error("null pointer passed to rotary_cpu");
        const RotaryArgs a{reinterpret_cast<void*>(q), reinterpret_cast<void*>(k),
                           reinterpret_cast<const int32_t*>(positions), reinterpret_cast<const float*>(inv_freq),
                           tokens, q_heads, k_heads, head_dim, q_stride, k_stride,
                           checked_dtype(dtype, "dtype")};
        py::gil_scoped_release release;
        rotary(a, static_cast<int>(std::clamp<int64_t>(num_threads, 1, 1024)));
      },
      py::arg("q"), py::arg("k"), py::arg("positions"), py::arg("inv_freq"), py::arg("tokens"), py::arg("q_heads"),
      py::arg("k_heads"), py::arg("head_dim"), py::arg("q_stride"), py::arg("k_stride"), py::arg("dtype"),
      py::arg("num_threads") = 1,
      "Rotary embedding in place on q and k rows from raw pointers (nanovllm.cpu.fused_ops checks the tensors).");
}


LogitRows logit_rows(uintptr_t data, int64_t rows, int64_t vocab, int64_t stride, const char* what) {
  if (rows < 0 || vocab < 1 || vocab > std::numeric_limits<int32_t>::max() || stride < vocab) {
    value_error(std::string(what) + ": bad logits sizes");
  }
  if (rows > 0 && !data) value_error(std::string("null logits passed to ") + what);
  return {reinterpret_cast<const float*>(data), rows, vocab, stride};
}

int clamp_threads(int64_t n) { return static_cast<int>(std::clamp<int64_t>(n, 1, 1024)); }

void bind_cpu_sampler(py::module_& m) {
  m.def(
      "sample_cpu",
      [](uintptr_t logits, int64_t rows, int64_t vocab, int64_t stride, uintptr_t temperature, uintptr_t top_k,
         uintptr_t top_p, uintptr_t min_p, uintptr_t uniform, uintptr_t out, int64_t num_threads) {
        const LogitRows l = logit_rows(logits, rows, vocab, stride, "sample_cpu");
        if (rows > 0 && (!temperature || !top_k || !top_p || !min_p || !uniform || !out)) {
          value_error("null pointer passed to sample_cpu");
        }
        const SampleArgs a{l, reinterpret_cast<const float*>(temperature), reinterpret_cast<const int64_t*>(top_k),
                           reinterpret_cast<const float*>(top_p), reinterpret_cast<const float*>(min_p),
                           reinterpret_cast<const double*>(uniform), reinterpret_cast<int64_t*>(out)};
        py::gil_scoped_release release;
        sample(a, clamp_threads(num_threads));
      },
      py::arg("logits"), py::arg("rows"), py::arg("vocab"), py::arg("stride"), py::arg("temperature"),
      py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("uniform"), py::arg("out"),
      py::arg("num_threads") = 1,
      "One token per row of fp32 logits, from raw pointers (nanovllm.cpu.sampler checks the arrays).");
  m.def(
      "argmax_cpu",
      [](uintptr_t logits, int64_t rows, int64_t vocab, int64_t stride, uintptr_t out, int64_t num_threads) {
        const LogitRows l = logit_rows(logits, rows, vocab, stride, "argmax_cpu");
        if (rows > 0 && !out) value_error("null pointer passed to argmax_cpu");
        py::gil_scoped_release release;
        argmax_rows(l, reinterpret_cast<int64_t*>(out), clamp_threads(num_threads));
      },
      py::arg("logits"), py::arg("rows"), py::arg("vocab"), py::arg("stride"), py::arg("out"),
      py::arg("num_threads") = 1, "The first maximum of each row of fp32 logits, from raw pointers.");
  m.def(
      "logprobs_cpu",
      [](uintptr_t logits, int64_t rows, int64_t vocab, int64_t stride, uintptr_t chosen, int64_t k,
         uintptr_t chosen_logprob, uintptr_t chosen_rank, uintptr_t top_ids, uintptr_t top_logprobs,
         int64_t num_threads) {
        const LogitRows l = logit_rows(logits, rows, vocab, stride, "logprobs_cpu");
        if (k < 0 || k > vocab) value_error("logprobs_cpu: k must be in [0, vocab]");
        if (rows > 0 && (!chosen || !chosen_logprob || !chosen_rank || (k > 0 && (!top_ids || !top_logprobs)))) {
          value_error("null pointer passed to logprobs_cpu");
        }
        const LogprobArgs a{l, reinterpret_cast<const int64_t*>(chosen), k, reinterpret_cast<double*>(chosen_logprob),
                            reinterpret_cast<int64_t*>(chosen_rank), reinterpret_cast<int64_t*>(top_ids),
                            reinterpret_cast<double*>(top_logprobs)};
        py::gil_scoped_release release;
        logprobs(a, clamp_threads(num_threads));
      },
      py::arg("logits"), py::arg("rows"), py::arg("vocab"), py::arg("stride"), py::arg("chosen"), py::arg("k"),
      py::arg("chosen_logprob"), py::arg("chosen_rank"), py::arg("top_ids"), py::arg("top_logprobs"),
      py::arg("num_threads") = 1,
      "Logprobs of the chosen and the k most likely tokens per row, from raw pointers (nanovllm.cpu.sampler checks them).");
  m.def(
      "apply_penalties_cpu",
      [](uintptr_t logits, int64_t vocab, int64_t stride, int64_t rows, uintptr_t logit_rows, uintptr_t seen,
         uintptr_t slots, uintptr_t repetition, uintptr_t frequency, uintptr_t presence, int64_t num_threads) {
        if (rows < 0 || vocab < 1 || stride < vocab) value_error("apply_penalties_cpu: bad sizes");
        if (rows > 0 && (!logits || !logit_rows || !seen || !slots || !repetition || !frequency || !presence)) {
          value_error("null pointer passed to apply_penalties_cpu");
        }
        const PenaltyArgs a{reinterpret_cast<float*>(logits), vocab, stride, rows,
                            reinterpret_cast<const int64_t*>(logit_rows), reinterpret_cast<const float*>(seen),
                            reinterpret_cast<const int64_t*>(slots), reinterpret_cast<const float*>(repetition),
                            reinterpret_cast<const float*>(frequency), reinterpret_cast<const float*>(presence)};
        py::gil_scoped_release release;
        apply_penalties(a, clamp_threads(num_threads));
      },
      py::arg("logits"), py::arg("vocab"), py::arg("stride"), py::arg("rows"), py::arg("logit_rows"), py::arg("seen"),
      py::arg("slots"), py::arg("repetition"), py::arg("frequency"), py::arg("presence"), py::arg("num_threads") = 1,
      "Repetition, frequency and presence penalties in place, from raw pointers (nanovllm.cpu.sampler checks them).");
}

// That this CPU runs gemm_bf16() on a pair-packed bf16 weight of depth k.
void check_gemm_bf16_weights(const std::string& what, int64_t k) {
  if (!has_avx512_bf16() || k % 2 != 0) value_error(what + ": gemm_bf16 needs AVX512-BF16 and an even k");
}

// That this CPU runs gemm() on a weight of `weights` packed with `pairs` or without.
void check_gemm_weights(const std::string& what, CpuDtype weights, bool pairs) {
  if (!has_avx2_fma()) value_error(what + " needs a CPU with AVX2 and FMA");
  if (pairs && (!has_avx512f() || weights != CpuDtype::kFloat32)) {
    value_error(what + ": pairs need fp32 weights and a CPU with AVX-512F (bf16 pairs: gemm_bf16_cpu)");
  }
}

// An LM head call's arguments (gemm_logits_cpu, gemm_greedy_cpu), checked; y null, y_stride n.
GemmLogitsArgs checked_head_args(const std::string& what, uintptr_t x, int64_t x_dtype, uintptr_t packed,
                                 int64_t packed_dtype, bool pairs, int64_t m, int64_t n, int64_t k, int64_t x_stride) {
  const CpuDtype rows = checked_dtype(x_dtype, "x_dtype");
  const CpuDtype weights = checked_dtype(packed_dtype, "packed_dtype");
  if (pairs && weights == CpuDtype::kBFloat16) {
    check_gemm_bf16_weights(what, k);
  } else {
    check_gemm_weights(what, weights, pairs);
  }
  if (m < 0 || n < 1 || k < 1 || x_stride < k) value_error(what + ": bad sizes");
  if (m > 0 && (!x || !packed)) value_error("null pointer passed to " + what);
  return {reinterpret_cast<const void*>(x), rows, reinterpret_cast<const void*>(packed), weights, pairs, nullptr,
          m, n, k, x_stride, n};
}

void bind_cpu_gemm(py::module_& m) {
  m.def("has_avx2_fma", &has_avx2_fma, "Whether this CPU runs the AVX2 + FMA kernels (gemm_cpu, attention tiles).");
  m.def("gemm_packed_elements", [](int64_t n, int64_t k) {
        if (n < 1 || k < 1) value_error("gemm_packed_elements: n and k must be >= 1");
        if (gemm_panels(n) > std::numeric_limits<int64_t>::max() / kGemmPanel / k) {
          value_error("gemm_packed_elements: the packed weight would not fit int64");
        }
        return gemm_packed_elements(n, k);
      }, py::arg("n"), py::arg("k"), "Elements of gemm_pack_cpu's copy of an [n, k] weight.");
  m.def("has_avx512f", &has_avx512f, "Whether this CPU runs the AVX-512 fp32 pair tiles (gemm_cpu with pairs).");
  m.def("has_avx512_bf16", &has_avx512_bf16, "Whether this CPU runs the AVX512-BF16 pair tiles (bf16 linear layers and MoE experts).");
  m.def("has_amx_bf16", &has_amx_bf16,
        "Whether this process runs gemm_bf16_cpu on AMX tiles (a CPU with AMX-BF16, the tiles granted by the OS).");
  m.def(
      "gemm_pack_cpu",
      [](uintptr_t w, int64_t dtype, int64_t n, int64_t k, int64_t w_stride, uintptr_t packed, bool pairs) {
        const auto type = checked_dtype(dtype, "dtype");
        if (n < 1 || k < 1 || w_stride < k) value_error("gemm_pack_cpu: bad sizes");
        if (pairs && type == CpuDtype::kBFloat16 && k % 2 != 0) value_error("gemm_pack_cpu: bf16 pairs need k even");
        if (!w || !packed) value_error("null pointer passed to gemm_pack_cpu");
        py::gil_scoped_release release;
        gemm_pack(reinterpret_cast<const void*>(w), type, n, k, w_stride, reinterpret_cast<void*>(packed), pairs);
      },
      py::arg("w"), py::arg("dtype"), py::arg("n"), py::arg("k"), py::arg("w_stride"), py::arg("packed"),
      py::arg("pairs") = false,
      "Pack an [n, k] weight (fp32 0 / bf16 1) into gemm_packed_elements(n, k) elements of the same dtype "
      "(nanovllm.cpu.gemm allocates them): for gemm_cpu's AVX2 tiles, or with pairs for the AVX-512 pair tiles "
      "(fp32: gemm_cpu with pairs; bf16, k even: gemm_bf16_cpu).");
  m.def(
      "gemm_cpu",
      [](uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t m, int64_t n, int64_t k, int64_t x_stride,
         int64_t y_stride, int64_t packed_dtype, int64_t num_threads, bool pairs, bool amx) {
        const CpuDtype weights = checked_dtype(packed_dtype, "packed_dtype");
        check_gemm_weights("gemm_cpu", weights, pairs);
        if (m < 0 || n < 1 || k < 1 || x_stride < k || y_stride < n) value_error("gemm_cpu: bad sizes");
        if (m > 0 && (!x || !packed || !y)) value_error("null pointer passed to gemm_cpu");
        const GemmArgs a{reinterpret_cast<const float*>(x), reinterpret_cast<const void*>(packed),
                         reinterpret_cast<const float*>(bias), reinterpret_cast<float*>(y), m, n, k, x_stride,
                         y_stride, weights, pairs, amx};
        py::gil_scoped_release release;
        gemm(a, clamp_threads(num_threads));
      },
      py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"),
      py::arg("x_stride"), py::arg("y_stride"), py::arg("packed_dtype"), py::arg("num_threads") = 1,
      py::arg("pairs") = false, py::arg("amx") = true,
      "y [m, n] = x [m, k] W^T (+ bias) in fp32 on gemm_pack_cpu's copy of W (packed with the same pairs), from "
      "raw pointers (nanovllm.cpu.gemm checks the tensors; nothing here tells the layouts apart: "
      "PackedWeight.pairs does). With pairs, from amx_fp32_min_rows() rows on AMX tiles where the process "
      "has them (the fp32 values split into bf16 pieces: within fp32's rounding bound, as the FMA tiles), "
      "unless amx is false.");
  m.def("amx_fp32_min_rows", [] { return kAmxFp32MinRows; },
        "The row count from which gemm_cpu takes pair-packed fp32 weights to AMX tiles.");
  m.def(
      "gemm_bf16_cpu",
      [](uintptr_t x, uintptr_t packed, uintptr_t bias, uintptr_t y, int64_t m, int64_t n, int64_t k, int64_t x_stride,
         int64_t y_stride, int64_t num_threads, bool amx, uintptr_t y_bf16) {
        if (!has_avx512_bf16()) value_error("gemm_bf16_cpu needs a CPU with AVX512-BF16");
        if (m < 0 || n < 1 || k < 2 || k % 2 != 0 || x_stride < k || y_stride < n) {
          value_error("gemm_bf16_cpu: bad sizes (k even)");
        }
        if (m > 0 && (!x || !packed || !y)) value_error("null pointer passed to gemm_bf16_cpu");
        const GemmBf16Args a{reinterpret_cast<const Bf16*>(x), reinterpret_cast<const Bf16*>(packed),
                             reinterpret_cast<const float*>(bias), reinterpret_cast<float*>(y), m, n, k, x_stride,
                             y_stride, amx};
        py::gil_scoped_release release;
        if (y_bf16 != 0) {
          gemm_bf16_narrowed(a, reinterpret_cast<Bf16*>(y_bf16), clamp_threads(num_threads));
        } else {
          gemm_bf16(a, clamp_threads(num_threads));
        }
      },
      py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("y"), py::arg("m"), py::arg("n"), py::arg("k"),
      py::arg("x_stride"), py::arg("y_stride"), py::arg("num_threads") = 1, py::arg("amx") = true,
      py::arg("y_bf16") = 0,
      "y [m, n] fp32 = x [m, k] bf16 W^T (+ fp32 bias) on gemm_pack_cpu's copy of W with pairs (AVX512-BF16; "
      "on AMX tiles where has_amx_bf16() and k is a multiple of 32, unless amx is false), "
      "from raw pointers (nanovllm.cpu.gemm checks the tensors; nothing here tells a pair-packed weight "
      "from another: PackedWeight.pairs does). With y_bf16 (rows n apart) the product rounded to bf16 there, "
      "as the decoder stack's bf16 layers take it (y then scratch, left unwritten on AMX tiles).");
  m.def(
      "gemm_logits_cpu",
      [](uintptr_t x, int64_t x_dtype, uintptr_t packed, int64_t packed_dtype, bool pairs, uintptr_t y, int64_t m,
         int64_t n, int64_t k, int64_t x_stride, int64_t y_stride, int64_t num_threads) {
        GemmLogitsArgs a =
            checked_head_args("gemm_logits_cpu", x, x_dtype, packed, packed_dtype, pairs, m, n, k, x_stride);
        if (y_stride < n) value_error("gemm_logits_cpu: bad sizes");
        if (m > 0 && !y) value_error("null pointer passed to gemm_logits_cpu");
        a.y = reinterpret_cast<float*>(y);
        a.y_stride = y_stride;
        py::gil_scoped_release release;
        gemm_logits(a, clamp_threads(num_threads));
      },
      py::arg("x"), py::arg("x_dtype"), py::arg("packed"), py::arg("packed_dtype"), py::arg("pairs"), py::arg("y"),
      py::arg("m"), py::arg("n"), py::arg("k"), py::arg("x_stride"), py::arg("y_stride"), py::arg("num_threads") = 1,
      "An LM head's fp32 logits y [m, n] from rows x [m, k] (fp32 0 / bf16 1) on gemm_pack_cpu's copy of its "
      "weight (with pairs: fp32 for gemm_cpu's, bf16 for gemm_bf16_cpu's), each rounded to bf16 where x is bf16 "
      "(cpu/gemm.py's linear, then .float()), from raw pointers (nanovllm.cpu.gemm checks the tensors).");
  m.def(
      "gemm_greedy_cpu",
      [](uintptr_t x, int64_t x_dtype, uintptr_t packed, int64_t packed_dtype, bool pairs, int64_t m, int64_t n,
         int64_t k, int64_t x_stride, int64_t num_threads) {
        const GemmLogitsArgs a =
            checked_head_args("gemm_greedy_cpu", x, x_dtype, packed, packed_dtype, pairs, m, n, k, x_stride);
        std::vector<int64_t> ids(m);
        {
          py::gil_scoped_release release;
          gemm_greedy(a, ids.data(), clamp_threads(num_threads));
        }
        // The step's host tokens as the sampler hands them on: no torch tensor, whose calls after a
        // step's weights streamed through the caches cost tens of microseconds each.
        py::array_t<int32_t> tokens(m);
        std::copy(ids.begin(), ids.end(), tokens.mutable_data());
        return tokens;
      },
      py::arg("x"), py::arg("x_dtype"), py::arg("packed"), py::arg("packed_dtype"), py::arg("pairs"), py::arg("m"),
      py::arg("n"), py::arg("k"), py::arg("x_stride"), py::arg("num_threads") = 1,
      "The argmax of each row of gemm_logits_cpu's logits as a numpy int32 [m] (the first largest, NaNs passed "
      "over, 0 for a row of NaNs), without writing the logits where it can (bf16 rows on AMX tiles), from raw "
      "pointers (nanovllm.cpu.gemm checks the tensors).");
}

// Whether every group of input columns starts on an even column: int4 values and bf16 activations
// come in pairs of input columns, so a group may not start inside a pair.
bool groups_pair(int64_t group_size, int64_t k) { return group_size % 2 == 0 || group_size >= k; }

void bind_cpu_gemm_quant(py::module_& m) {
  m.def("quant_isa_supported", [](int64_t isa) { return quant_isa_supported(static_cast<QuantIsa>(checked_int32(isa, "isa", 0, 4))); },
        py::arg("isa"), "Whether this CPU runs quant_gemm_cpu with isa (0 auto, 1 portable, 2 AVX2, 3 AVX-512, 4 AVX-512 with "
        "bf16 activations on AMX tiles).");
  m.def("quant_isa_best", [] { return static_cast<int>(quant_isa_best()); }, "The isa quant_gemm_cpu picks by default.");
  m.def("quant_has_bf16", &quant_has_bf16, "Whether quant_gemm_cpu takes bf16 activations (AVX512-BF16).");
  m.def("quant_has_vnni512", &quant_has_vnni512,
        "Whether quant_gemm_cpu takes one to four bf16 rows against int4 as 16-bit integers on AVX512-VNNI.");
  m.def("quant_gemm_packed_bytes", [](int64_t n, int64_t k, int64_t bits) {
        if (n < 1 || k < 1 || (bits != 4 && bits != 8)) value_error("quant_gemm_packed_bytes: n, k >= 1 and bits 4 or 8");
        if (gemm_panels(n) > std::numeric_limits<int64_t>::max() / kGemmPanel / (k + 1)) {
          value_error("quant_gemm_packed_bytes: the packed weight would not fit int64");
        }
        return quant_gemm_packed_bytes(n, k, static_cast<int>(bits));
      }, py::arg("n"), py::arg("k"), py::arg("bits"), "Bytes of quant_gemm_cpu's packed int4 / int8 [n, k] weight.");
  m.def(
      "quant_gemm_cpu",
      [](uintptr_t x, uintptr_t packed, uintptr_t scales, uintptr_t zeros, uintptr_t bias, uintptr_t y, int64_t m,
         int64_t n, int64_t k, int64_t x_stride, int64_t y_stride, int64_t group_size, int64_t bits, double zero_offset,
         int64_t isa, int64_t num_threads, uintptr_t x_bf16, bool y_bf16) {
        const auto which = static_cast<QuantIsa>(checked_int32(isa, "isa", 0, 4));
        if (!quant_isa_supported(which)) value_error("quant_gemm_cpu: this CPU does not run isa " + std::to_string(isa));
        if (bits != 4 && bits != 8) value_error("quant_gemm_cpu: bits must be 4 or 8, got " + std::to_string(bits));
        if (m < 0 || n < 1 || k < 1 || x_stride < k || y_stride < n || group_size < 1 || group_size > k) {
          value_error("quant_gemm_cpu: bad sizes");
        }
        if (bits == 4 && !groups_pair(group_size, k)) value_error("quant_gemm_cpu: int4 needs an even group size");
        if (x_bf16 && x_stride < k + k % 2) value_error("quant_gemm_cpu: bf16 rows must hold k rounded up to even");
        if (x_bf16 && !groups_pair(group_size, k)) value_error("quant_gemm_cpu: bf16 activations need even groups");
        if (m > 0 && (!(x || x_bf16) || !packed || !scales || !y)) value_error("null pointer passed to quant_gemm_cpu");
        const QuantGemmArgs a{reinterpret_cast<const float*>(x), reinterpret_cast<const uint16_t*>(x_bf16),
                              reinterpret_cast<const uint8_t*>(packed),
                              reinterpret_cast<const float*>(scales), reinterpret_cast<const int8_t*>(zeros),
                              reinterpret_cast<const float*>(bias), y_bf16 ? nullptr : reinterpret_cast<float*>(y),
                              m, n, k, x_stride, y_stride, group_size, static_cast<int>(bits),
                              static_cast<float>(zero_offset), y_bf16 ? reinterpret_cast<uint16_t*>(y) : nullptr};
        py::gil_scoped_release release;
        quant_gemm(a, which, clamp_threads(num_threads));
      },
      py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("zeros"), py::arg("bias"), py::arg("y"), py::arg("m"),
      py::arg("n"), py::arg("k"), py::arg("x_stride"), py::arg("y_stride"), py::arg("group_size"), py::arg("bits"),
      py::arg("zero_offset"), py::arg("isa") = 0, py::arg("num_threads") = 1, py::arg("x_bf16") = 0,
      py::arg("y_bf16") = false,
      "y [m, n] = x [m, k] dequant(W)^T (+ bias) on a packed int4 / int8 weight, from raw pointers: x fp32, or bf16 "
      "rows with x_bf16; y fp32, or bf16 (rounded from the fp32 sums) with y_bf16 "
      "(nanovllm.layers.quantization.cpu_kernel checks the tensors).");
}

// The routing arguments every MoE binding takes: the sizes, and that the ids fit int32 offsets.
void check_moe_sizes(const char* what, int64_t rows, int64_t experts, int64_t top_k, int64_t logits_stride) {
  checked_int32(experts, "experts", 1);
  checked_int32(top_k, (std::string(what) + ": top_k (experts per token), at most experts,").c_str(), 1, experts);
  if (rows < 0 || logits_stride < experts || rows > kInt32Max / top_k) value_error(std::string(what) + ": bad sizes");
}

// A packed int8 / int4 weight's bits and groups over its k input columns.
void check_quant_layout(const std::string& what, int64_t bits, int64_t group_size, int64_t k) {
  if (bits != 4 && bits != 8) value_error(what + " bits must be 4 or 8, got " + std::to_string(bits));
  if (group_size < 1 || group_size > k) value_error(what + " group_size must be in [1, " + std::to_string(k) + "]");
  if (bits == 4 && !groups_pair(group_size, k)) value_error(what + ": int4 needs an even group size");
}

// One of a quantized MoE layer's two weights (n x k per expert, `experts` of them back to back),
// checked against the sizes quant_gemm reads.
MoeQuantWeights quant_expert_weights(const char* name, uintptr_t packed, int64_t packed_bytes, uintptr_t scales,
                                     int64_t scales_elements, uintptr_t zeros, int64_t zeros_elements,
                                     int64_t group_size, int64_t bits, double zero_offset, int64_t n, int64_t k,
                                     int64_t experts) {
  const std::string what = std::string("moe_quant_experts_cpu: ") + name;
  check_quant_layout(what, bits, group_size, k);
  const int64_t per_packed = quant_gemm_packed_bytes(n, k, static_cast<int>(bits));
  const int64_t per_scales = gemm_panels(n) * ((k + group_size - 1) / group_size) * kGemmPanel;
  if (per_packed > std::numeric_limits<int64_t>::max() / experts || per_scales > std::numeric_limits<int64_t>::max() / 4 / experts) {
    value_error(what + ": sizes overflow");
  }
  if (packed_bytes != experts * per_packed || scales_elements != experts * per_scales) {
    value_error(what + ": " + std::to_string(packed_bytes) + " packed bytes and " + std::to_string(scales_elements) +
                " scales for " + std::to_string(experts) + " experts that need " + std::to_string(experts * per_packed) +
                " and " + std::to_string(experts * per_scales));
  }
  if (zeros_elements != (zeros ? experts * per_scales : 0)) {
    value_error(what + ": " + std::to_string(zeros_elements) + " zero points, expected " +
                std::to_string(zeros ? experts * per_scales : 0) + " (as many as scales, or none)");
  }
  if (!packed || !scales) value_error("null pointer passed to moe_quant_experts_cpu");
  return {reinterpret_cast<const uint8_t*>(packed), per_packed, reinterpret_cast<const float*>(scales), per_scales,
          reinterpret_cast<const int8_t*>(zeros), group_size, static_cast<int>(bits), static_cast<float>(zero_offset)};
}

// A MoE layer's shape, routing and dtype, checked; its rows, x, logits and out are each call's
// (MoeLayerArgs::on_rows, check_moe_rows).
MoeLayerArgs checked_moe_layer(const char* what, int64_t hidden, int64_t inter, int64_t experts, int64_t top_k,
                               bool renormalize, int64_t dtype) {
  check_moe_sizes(what, 0, experts, top_k, experts);
  if (hidden < 1 || hidden > kInt32Max || inter < 1 || inter > kInt32Max) value_error(std::string(what) + ": bad sizes");
  return {nullptr, hidden, nullptr, experts, 0, hidden, inter, experts, top_k, renormalize, nullptr, hidden,
          checked_dtype(dtype, "dtype")};
}

// A dense MoE layer's packed experts (gemm_pack_cpu's copies) and shape, checked.
MoeExpertsArgs checked_moe_experts(const char* what, uintptr_t w13, int64_t w13_elements, uintptr_t w2,
                                   int64_t w2_elements, int64_t weight_dtype, bool pairs, int64_t hidden, int64_t inter,
                                   int64_t experts, int64_t top_k, bool renormalize, int64_t dtype) {
  const std::string name(what);
  if (!has_avx2_fma()) value_error(name + " needs a CPU with AVX2 and FMA");
  MoeExpertsArgs a{};
  a.layer = checked_moe_layer(what, hidden, inter, experts, top_k, renormalize, dtype);
  const CpuDtype type = a.layer.dtype, weights = checked_dtype(weight_dtype, "weight_dtype");
  const bool bf16_pairs = pairs && weights == CpuDtype::kBFloat16;  // MoeExpertsArgs::bf16_pairs()
  if (bf16_pairs && (!has_avx512_bf16() || type != CpuDtype::kBFloat16 || hidden % 2 != 0)) {
    value_error(name + ": bf16 pairs need an AVX512-BF16 CPU, bf16 activations and an even hidden size");
  }
  if (pairs && weights == CpuDtype::kFloat32 && !has_avx512f()) value_error(name + ": fp32 pairs need a CPU with AVX-512F");
  // Each expert's packed weights must fit int64 offsets.
  const int64_t per_w13 = gemm_packed_elements(moe_gate_up_rows(inter), hidden);
  const int64_t per_w2 = gemm_packed_elements(hidden, moe_down_depth(inter, bf16_pairs));
  if (per_w13 > std::numeric_limits<int64_t>::max() / 2 / experts ||
      per_w2 > std::numeric_limits<int64_t>::max() / 2 / experts) {
    value_error(name + ": sizes overflow");
  }
  if (w13_elements != experts * per_w13 || w2_elements != experts * per_w2) {
    value_error(name + ": the packed experts hold " + std::to_string(w13_elements) + " and " +
                std::to_string(w2_elements) + " elements, " + std::to_string(experts) + " experts of this shape need " +
                std::to_string(experts * per_w13) + " and " + std::to_string(experts * per_w2));
  }
  if (!w13 || !w2) value_error("null pointer passed to " + name);
  a.w13 = reinterpret_cast<const void*>(w13);
  a.w2 = reinterpret_cast<const void*>(w2);
  a.weight_dtype = weights;
  a.pairs = pairs;
  return a;
}

// A forward's rows of a MoE layer: the strides, and every row buffer of the call within int64 offsets.
void check_moe_rows(const char* what, int64_t rows, int64_t logits_stride, int64_t x_stride, int64_t out_stride,
                    const MoeLayerArgs& layer) {
  check_moe_sizes(what, rows, layer.experts, layer.top_k, logits_stride);
  if (x_stride < layer.hidden || out_stride < layer.hidden ||
      rows * layer.top_k > std::numeric_limits<int64_t>::max() / 8 /
                               (moe_gate_up_rows(layer.inter) + layer.inter + 2 * layer.hidden)) {
    value_error(std::string(what) + ": bad sizes");
  }
}

// Whether a quantized MoE layer can take bf16 rows (quant_gemm's x_bf16 path on AVX512-BF16).
void check_moe_bf16_rows(const char* what, CpuDtype type, int64_t hidden, const MoeQuantWeights& w13,
                         const MoeQuantWeights& w2, int64_t inter) {
  if (!quant_has_bf16() || type != CpuDtype::kBFloat16 || hidden % 2 != 0 || !groups_pair(w13.group_size, hidden) ||
      !groups_pair(w2.group_size, inter)) {
    value_error(std::string(what) + ": bf16 rows need an AVX512-BF16 CPU, bf16 activations, an even hidden size and "
                "groups of an even size");
  }
}

void bind_cpu_moe(py::module_& m) {
  m.def(
      "moe_route_cpu",
      [](uintptr_t logits, int64_t rows, int64_t experts, int64_t logits_stride, int64_t top_k, bool renormalize,
         uintptr_t topk_ids, uintptr_t topk_weights, uintptr_t expert_offsets, uintptr_t sorted, int64_t num_threads) {
        check_moe_sizes("moe_route_cpu", rows, experts, top_k, logits_stride);
        if (!expert_offsets || (rows > 0 && (!logits || !topk_ids || !topk_weights || !sorted))) {
          value_error("null pointer passed to moe_route_cpu");
        }
        const MoeRouteArgs a{reinterpret_cast<const float*>(logits), logits_stride, rows, experts, top_k, renormalize,
                             reinterpret_cast<int32_t*>(topk_ids), reinterpret_cast<float*>(topk_weights),
                             reinterpret_cast<int32_t*>(expert_offsets), reinterpret_cast<int32_t*>(sorted)};
        py::gil_scoped_release release;
        moe_route(a, clamp_threads(num_threads));
      },
      py::arg("logits"), py::arg("rows"), py::arg("experts"), py::arg("logits_stride"), py::arg("top_k"),
      py::arg("renormalize"), py::arg("topk_ids"), py::arg("topk_weights"), py::arg("expert_offsets"),
      py::arg("sorted"), py::arg("num_threads") = 1,
      "Softmax top-k routing of fp32 router logits and the assignments grouped by expert, from raw pointers "
      "(nanovllm.cpu.moe checks the tensors).");
  m.def(
      "moe_combine_cpu",
      [](uintptr_t y, int64_t y_stride, uintptr_t sorted, uintptr_t topk_weights, int64_t rows, int64_t top_k,
         int64_t hidden, uintptr_t out, int64_t out_stride, int64_t dtype, int64_t num_threads) {
        if (rows < 0 || top_k < 1 || hidden < 1 || y_stride < hidden || out_stride < hidden ||
            rows > kInt32Max / top_k) {
          value_error("moe_combine_cpu: bad sizes");
        }
        if (rows > 0 && (!y || !sorted || !topk_weights || !out)) value_error("null pointer passed to moe_combine_cpu");
        // `sorted` must be a permutation of the assignments: its inverse is written through it.
        const auto* order = reinterpret_cast<const int32_t*>(sorted);
        std::vector<bool> seen(rows * top_k);
        for (int64_t i = 0; i < rows * top_k; ++i) {
          if (order[i] < 0 || order[i] >= rows * top_k || seen[order[i]]) {
            value_error("moe_combine_cpu: sorted is not a permutation of the assignments");
          }
          seen[order[i]] = true;
        }
        const MoeCombineArgs a{reinterpret_cast<const void*>(y), y_stride, order,
                               reinterpret_cast<const float*>(topk_weights), rows, top_k, hidden,
                               reinterpret_cast<void*>(out), out_stride, checked_dtype(dtype, "dtype")};
        py::gil_scoped_release release;
        moe_combine(a, clamp_threads(num_threads));
      },
      py::arg("y"), py::arg("y_stride"), py::arg("sorted"), py::arg("topk_weights"), py::arg("rows"),
      py::arg("top_k"), py::arg("hidden"), py::arg("out"), py::arg("out_stride"), py::arg("dtype"),
      py::arg("num_threads") = 1,
      "The weighted sum of the experts' outputs (one row per assignment, in moe_route_cpu's sorted order) back "
      "into token order, from raw pointers (nanovllm.cpu.moe checks the tensors).");
  m.def(
      "moe_experts_cpu",
      [](uintptr_t x, int64_t x_stride, uintptr_t logits, int64_t logits_stride, uintptr_t w13, int64_t w13_elements,
         uintptr_t w2, int64_t w2_elements, int64_t weight_dtype, bool pairs, int64_t rows, int64_t hidden,
         int64_t inter, int64_t experts, int64_t top_k, bool renormalize, uintptr_t out, int64_t out_stride,
         int64_t dtype, int64_t num_threads) {
        MoeExpertsArgs a = checked_moe_experts("moe_experts_cpu", w13, w13_elements, w2, w2_elements, weight_dtype,
                                               pairs, hidden, inter, experts, top_k, renormalize, dtype);
        check_moe_rows("moe_experts_cpu", rows, logits_stride, x_stride, out_stride, a.layer);
        if (rows > 0 && (!x || !logits || !out)) value_error("null pointer passed to moe_experts_cpu");
        a.layer = a.layer.on_rows(reinterpret_cast<const void*>(x), x_stride, reinterpret_cast<const float*>(logits),
                                  logits_stride, rows, reinterpret_cast<void*>(out), out_stride);
        py::gil_scoped_release release;
        moe_experts(a, clamp_threads(num_threads));
      },
      py::arg("x"), py::arg("x_stride"), py::arg("logits"), py::arg("logits_stride"), py::arg("w13"),
      py::arg("w13_elements"), py::arg("w2"), py::arg("w2_elements"), py::arg("weight_dtype"), py::arg("pairs"),
      py::arg("rows"), py::arg("hidden"), py::arg("inter"), py::arg("experts"), py::arg("top_k"),
      py::arg("renormalize"), py::arg("out"), py::arg("out_stride"), py::arg("dtype"), py::arg("num_threads") = 1,
      "A mixture-of-experts layer (routing, every chosen expert's SiLU MLP, the weighted sum) on experts packed "
      "by gemm_pack_cpu, with pairs or without (gate/up rows interleaved: moe_gate_up_rows), from raw "
      "pointers (nanovllm.cpu.moe checks the tensors).");
  m.def(
      "moe_quant_experts_cpu",
      [](uintptr_t x, int64_t x_stride, uintptr_t logits, int64_t logits_stride, int64_t rows, int64_t hidden,
         int64_t inter, int64_t experts, int64_t top_k, bool renormalize, uintptr_t out, int64_t out_stride,
         int64_t dtype, bool bf16_rows, uintptr_t w13_packed, int64_t w13_packed_bytes, uintptr_t w13_scales,
         int64_t w13_scales_elements, uintptr_t w13_zeros, int64_t w13_zeros_elements, int64_t w13_group_size,
         int64_t w13_bits, double w13_zero_offset, uintptr_t w2_packed, int64_t w2_packed_bytes, uintptr_t w2_scales,
         int64_t w2_scales_elements, uintptr_t w2_zeros, int64_t w2_zeros_elements, int64_t w2_group_size,
         int64_t w2_bits, double w2_zero_offset, int64_t num_threads) {
        const MoeLayerArgs layer =
            checked_moe_layer("moe_quant_experts_cpu", hidden, inter, experts, top_k, renormalize, dtype);
        check_moe_rows("moe_quant_experts_cpu", rows, logits_stride, x_stride, out_stride, layer);
        const MoeQuantWeights w13 =
            quant_expert_weights("w13", w13_packed, w13_packed_bytes, w13_scales, w13_scales_elements, w13_zeros,
                                 w13_zeros_elements, w13_group_size, w13_bits, w13_zero_offset,
                                 moe_gate_up_rows(inter), hidden, experts);
        const MoeQuantWeights w2 =
            quant_expert_weights("w2", w2_packed, w2_packed_bytes, w2_scales, w2_scales_elements, w2_zeros,
                                 w2_zeros_elements, w2_group_size, w2_bits, w2_zero_offset, hidden, inter, experts);
        if (bf16_rows) check_moe_bf16_rows("moe_quant_experts_cpu", layer.dtype, hidden, w13, w2, inter);
        if (rows > 0 && (!x || !logits || !out)) value_error("null pointer passed to moe_quant_experts_cpu");
        const MoeQuantExpertsArgs a{layer.on_rows(reinterpret_cast<const void*>(x), x_stride,
                                                  reinterpret_cast<const float*>(logits), logits_stride, rows,
                                                  reinterpret_cast<void*>(out), out_stride),
                                    w13, w2, bf16_rows};
        py::gil_scoped_release release;
        moe_quant_experts(a, clamp_threads(num_threads));
      },
      py::arg("x"), py::arg("x_stride"), py::arg("logits"), py::arg("logits_stride"), py::arg("rows"),
      py::arg("hidden"), py::arg("inter"), py::arg("experts"), py::arg("top_k"), py::arg("renormalize"), py::arg("out"),
      py::arg("out_stride"), py::arg("dtype"), py::arg("bf16_rows"), py::arg("w13_packed"), py::arg("w13_packed_bytes"),
      py::arg("w13_scales"), py::arg("w13_scales_elements"), py::arg("w13_zeros"), py::arg("w13_zeros_elements"),
      py::arg("w13_group_size"),
      py::arg("w13_bits"), py::arg("w13_zero_offset"), py::arg("w2_packed"), py::arg("w2_packed_bytes"), py::arg("w2_scales"),
      py::arg("w2_scales_elements"), py::arg("w2_zeros"), py::arg("w2_zeros_elements"), py::arg("w2_group_size"), py::arg("w2_bits"),
      py::arg("w2_zero_offset"), py::arg("num_threads") = 1,
      "A mixture-of-experts layer on int8 / int4 experts packed for quant_gemm_cpu, expert after expert (w13: "
      "[moe_gate_up_rows(inter), hidden] with gate/up rows interleaved; w2: [hidden, inter]), from raw pointers "
      "(nanovllm.layers.quantization.cpu_moe checks the tensors).");
  m.def("moe_gate_up_rows", [](int64_t inter) {
        if (inter < 1 || inter > kInt32Max) value_error("moe_gate_up_rows: inter must be in [1, 2^31)");
        return moe_gate_up_rows(inter);
      }, py::arg("inter"), "Rows of an expert's packed gate/up weight: 8 gate and 8 up rows per 16-row panel.");
}
// A projection of the decoder stack: its sizes must be the layer's, its kernel one this CPU runs
// on the stack's activations (`dtype`).
void check_decoder_linear(const DecoderLinear& w, int64_t n, int64_t k, CpuDtype dtype, const char* name) {
  const std::string what = std::string("DecoderStack: ") + name;
  if (w.n != n || w.k != k) {
    value_error(what + " is [" + std::to_string(w.n) + ", " + std::to_string(w.k) + "], the layer needs [" +
                std::to_string(n) + ", " + std::to_string(k) + "]");
  }
  if (!w.packed) value_error(what + ": null weight");
  switch (w.kind) {
    case DecoderLinear::Kind::kDense:
      check_gemm_weights(what, w.packed_dtype, w.pairs);
      break;
    case DecoderLinear::Kind::kDenseBf16:
      if (dtype != CpuDtype::kBFloat16) value_error(what + ": a bf16 weight for gemm_bf16 in a stack of fp32 rows");
      check_gemm_bf16_weights(what, k);
      break;
    case DecoderLinear::Kind::kQuant:
      if (!w.scales) value_error(what + ": null scales");
      check_quant_layout(what, w.bits, w.group_size, k);
      if (w.bf16_min_rows > 0 && !groups_pair(w.group_size, k)) value_error(what + ": bf16 activations need even groups");
      break;
  }
}

void bind_cpu_decoder(py::module_& m) {
  // Module-local: a second build of _cpu loaded beside this one (an A/B of two kernels in one process)
  // registers its own.
  py::class_<DecoderLinear>(m, "DecoderLinear", py::module_local(),
                            "One projection's weight for DecoderStack (nanovllm/models/cpu_stack.py makes them).")
      .def_static(
          "dense",
          [](uintptr_t packed, int64_t packed_dtype, int64_t n, int64_t k, bool pairs, uintptr_t bias) {
            DecoderLinear w;
            w.kind = DecoderLinear::Kind::kDense;
            w.packed = reinterpret_cast<const void*>(packed);
            w.packed_dtype = checked_dtype(packed_dtype, "packed_dtype");
            w.n = n;
            w.k = k;
            w.pairs = pairs;
            w.bias = reinterpret_cast<const float*>(bias);
            return w;
          },
          py::arg("packed"), py::arg("packed_dtype"), py::arg("n"), py::arg("k"), py::arg("pairs"), py::arg("bias"),
          "gemm_cpu's weight (gemm_pack_cpu's copy), fp32 bias or 0.")
      .def_static(
          "dense_bf16",
          [](uintptr_t packed, int64_t n, int64_t k, uintptr_t bias) {
            DecoderLinear w;
            w.kind = DecoderLinear::Kind::kDenseBf16;
            w.packed = reinterpret_cast<const void*>(packed);
            w.packed_dtype = CpuDtype::kBFloat16;
            w.n = n;
            w.k = k;
            w.bias = reinterpret_cast<const float*>(bias);
            return w;
          },
          py::arg("packed"), py::arg("n"), py::arg("k"), py::arg("bias"),
          "gemm_bf16_cpu's weight (a pair-packed bf16 copy), fp32 bias or 0.")
      .def_static(
          "quant",
          [](uintptr_t packed, uintptr_t scales, uintptr_t zeros, uintptr_t bias, int64_t n, int64_t k,
             int64_t group_size, int64_t bits, double zero_offset, int64_t bf16_min_rows, int64_t bf16_max_rows) {
            DecoderLinear w;
            w.kind = DecoderLinear::Kind::kQuant;
            w.packed = reinterpret_cast<const void*>(packed);
            w.scales = reinterpret_cast<const float*>(scales);
            w.zeros = reinterpret_cast<const int8_t*>(zeros);
            w.bias = reinterpret_cast<const float*>(bias);
            w.n = n;
            w.k = k;
            w.group_size = group_size;
            w.bits = static_cast<int>(checked_int32(bits, "bits", 4, 8));
            w.zero_offset = static_cast<float>(zero_offset);
            w.bf16_min_rows = bf16_min_rows;
            w.bf16_max_rows = bf16_max_rows;
            return w;
          },
          py::arg("packed"), py::arg("scales"), py::arg("zeros"), py::arg("bias"), py::arg("n"), py::arg("k"),
          py::arg("group_size"), py::arg("bits"), py::arg("zero_offset"), py::arg("bf16_min_rows"),
          py::arg("bf16_max_rows"),
          "quant_gemm_cpu's weight; bf16 activations go to it as bf16 at bf16_min_rows to bf16_max_rows rows (min 0: "
          "never; max 0: no limit), as cpu_kernel.bf16_row_range says.")
      .def_readonly("n", &DecoderLinear::n)
      .def_readonly("k", &DecoderLinear::k);
  py::class_<DecoderMoe>(m, "DecoderMoe", py::module_local(),
                         "A mixture-of-experts MLP for DecoderLayer: the router and the experts, as the Python layer calls "
                         "moe_experts_cpu / moe_quant_experts_cpu.")
      .def_static(
          "dense",
          [](DecoderLinear router, uintptr_t w13, int64_t w13_elements, uintptr_t w2, int64_t w2_elements,
             int64_t weight_dtype, bool pairs, int64_t hidden, int64_t inter, int64_t experts, int64_t top_k,
             bool renormalize, int64_t dtype) {
            DecoderMoe e;
            e.router = router;
            e.dense = checked_moe_experts("DecoderMoe", w13, w13_elements, w2, w2_elements, weight_dtype, pairs, hidden,
                                          inter, experts, top_k, renormalize, dtype);
            e.layer = e.dense.layer;
            return e;
          },
          py::arg("router"), py::arg("w13"), py::arg("w13_elements"), py::arg("w2"), py::arg("w2_elements"),
          py::arg("weight_dtype"), py::arg("pairs"), py::arg("hidden"), py::arg("inter"), py::arg("experts"),
          py::arg("top_k"), py::arg("renormalize"), py::arg("dtype"),
          "Experts packed by gemm_pack_cpu, as moe_experts_cpu takes them.")
      .def_static(
          "quant",
          [](DecoderLinear router, int64_t hidden, int64_t inter, int64_t experts, int64_t top_k, bool renormalize,
             int64_t dtype, double bf16_min_per_expert, uintptr_t w13_packed, int64_t w13_packed_bytes,
             uintptr_t w13_scales, int64_t w13_scales_elements, uintptr_t w13_zeros, int64_t w13_zeros_elements,
             int64_t w13_group_size, int64_t w13_bits, double w13_zero_offset, uintptr_t w2_packed,
             int64_t w2_packed_bytes, uintptr_t w2_scales, int64_t w2_scales_elements, uintptr_t w2_zeros,
             int64_t w2_zeros_elements, int64_t w2_group_size, int64_t w2_bits, double w2_zero_offset) {
            DecoderMoe e;
            e.router = router;
            e.quantized = true;
            e.layer = checked_moe_layer("DecoderMoe", hidden, inter, experts, top_k, renormalize, dtype);
            e.quant.w13 = quant_expert_weights("w13", w13_packed, w13_packed_bytes, w13_scales, w13_scales_elements,
                                               w13_zeros, w13_zeros_elements, w13_group_size, w13_bits, w13_zero_offset,
                                               moe_gate_up_rows(inter), hidden, experts);
            e.quant.w2 = quant_expert_weights("w2", w2_packed, w2_packed_bytes, w2_scales, w2_scales_elements, w2_zeros,
                                              w2_zeros_elements, w2_group_size, w2_bits, w2_zero_offset, hidden, inter,
                                              experts);
            if (bf16_min_per_expert > 0) check_moe_bf16_rows("DecoderMoe", e.layer.dtype, hidden, e.quant.w13, e.quant.w2, inter);
            e.bf16_min_per_expert = bf16_min_per_expert;
            return e;
          },
          py::arg("router"), py::arg("hidden"), py::arg("inter"), py::arg("experts"), py::arg("top_k"),
          py::arg("renormalize"), py::arg("dtype"), py::arg("bf16_min_per_expert"), py::arg("w13_packed"),
          py::arg("w13_packed_bytes"), py::arg("w13_scales"), py::arg("w13_scales_elements"), py::arg("w13_zeros"),
          py::arg("w13_zeros_elements"), py::arg("w13_group_size"), py::arg("w13_bits"), py::arg("w13_zero_offset"),
          py::arg("w2_packed"), py::arg("w2_packed_bytes"), py::arg("w2_scales"), py::arg("w2_scales_elements"),
          py::arg("w2_zeros"), py::arg("w2_zeros_elements"), py::arg("w2_group_size"), py::arg("w2_bits"),
          py::arg("w2_zero_offset"),
          "int8 / int4 experts as moe_quant_experts_cpu takes them; bf16 rows where a forward's assignments per "
          "chosen expert reach bf16_min_per_expert (0: never).");
  py::class_<DecoderLayerWeights>(m, "DecoderLayer", py::module_local(),
                                  "One layer's weights and KV cache for DecoderStack.")
      .def(py::init([](DecoderLinear qkv, DecoderLinear o, std::optional<DecoderLinear> gate_up,
                       std::optional<DecoderLinear> down, uintptr_t input_norm, uintptr_t post_norm, uintptr_t q_norm,
                       uintptr_t k_norm, uintptr_t inv_freq, uintptr_t k_cache, uintptr_t v_cache,
                       std::optional<DecoderMoe> moe) {
             if (!input_norm || !post_norm || !inv_freq || !k_cache || !v_cache || (q_norm == 0) != (k_norm == 0)) {
               value_error("DecoderLayer: null norm weight, inv_freq or cache (q_norm and k_norm come together)");
             }
             if (moe.has_value() == (gate_up.has_value() && down.has_value()) || gate_up.has_value() != down.has_value()) {
               value_error("DecoderLayer: an MLP of gate_up and down, or moe, one of the two");
             }
             return DecoderLayerWeights{qkv, o, gate_up.value_or(DecoderLinear{}), down.value_or(DecoderLinear{}), moe,
                                        reinterpret_cast<const void*>(input_norm),
                                        reinterpret_cast<const void*>(post_norm),
                                        reinterpret_cast<const void*>(q_norm), reinterpret_cast<const void*>(k_norm),
                                        reinterpret_cast<const float*>(inv_freq), reinterpret_cast<void*>(k_cache),
                                        reinterpret_cast<void*>(v_cache)};
           }),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("input_norm"),
           py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("inv_freq"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("moe") = py::none());
  py::class_<DecoderStack>(m, "DecoderStack", py::module_local(),
                           "A decoder's layers in one call per forward (csrc/cpu_decoder.h); the pointers "
                           "it was built from must outlive it.")
      .def(py::init([](int64_t dtype, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       int64_t inter, double eps, double scale, int64_t block_size, int64_t num_blocks,
                       std::vector<DecoderLayerWeights> layers, uintptr_t final_norm, uintptr_t embedding,
                       int64_t vocab) {
             DecoderShape s;
             s.dtype = checked_dtype(dtype, "dtype");
             s.hidden = checked_int32(hidden, "hidden", 1);
             s.heads = checked_int32(heads, "heads", 1);
             s.kv_heads = checked_int32(kv_heads, "kv_heads", 1);
             s.head_dim = checked_int32(head_dim, "head_dim", 2, kMaxRotaryDim);
             s.inter = checked_int32(inter, "inter", 1);
             s.eps = static_cast<float>(eps);
             s.scale = static_cast<float>(scale);
             if (s.heads % s.kv_heads != 0 || s.head_dim % 2 != 0) {
               value_error("DecoderStack: heads must be a multiple of kv_heads, head_dim even");
             }
             checked_int32(block_size, "block_size", 1, 1 << 16);
             checked_int32(num_blocks, "num_blocks", 1);
             if (!final_norm) value_error("DecoderStack: null final norm weight");
             if (!embedding || vocab < 1) value_error("DecoderStack: the embedding needs a table and vocab >= 1");
             const int64_t q_row = s.heads * s.head_dim;
             for (const DecoderLayerWeights& l : layers) {
               check_decoder_linear(l.qkv, q_row + 2 * s.kv_heads * s.head_dim, s.hidden, s.dtype, "qkv");
               check_decoder_linear(l.o, s.hidden, q_row, s.dtype, "o");
               if (l.moe) {
                 const MoeLayerArgs& e = l.moe->layer;
                 check_decoder_linear(l.moe->router, e.experts, s.hidden, s.dtype, "router");
                 if (e.hidden != s.hidden || e.dtype != s.dtype) {
                   value_error("DecoderStack: experts of another hidden size or dtype than the layers'");
                 }
               } else {
                 check_decoder_linear(l.gate_up, 2 * s.inter, s.hidden, s.dtype, "gate_up");
                 check_decoder_linear(l.down, s.hidden, s.inter, s.dtype, "down");
               }
             }
             return std::make_unique<DecoderStack>(s, std::move(layers), reinterpret_cast<const void*>(final_norm),
                                                   block_size, num_blocks, reinterpret_cast<const void*>(embedding),
                                                   vocab);
           }),
           py::arg("dtype"), py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("inter"), py::arg("eps"), py::arg("scale"), py::arg("block_size"), py::arg("num_blocks"),
           py::arg("layers"), py::arg("final_norm"), py::arg("embedding"), py::arg("vocab"))
      .def("adopt_buffers", &DecoderStack::adopt_buffers, py::arg("other"),
           "Take the buffers `other` grew (a stack built again for a new KV cache); `other` keeps none.")
      .def_property_readonly("buffer_bytes", &DecoderStack::buffer_bytes, "bytes of the buffers it keeps now")
      .def("time_parts", &DecoderStack::time_parts, py::arg("on"),
           "Start (from zero) or stop summing each forward's parts into part_times.")
      .def_property_readonly(
          "part_times",
          [](const DecoderStack& stack) {
            const DecoderPartTimes& p = stack.part_times();
            py::dict out;
            out["gemm"] = p.gemm;
            out["attention"] = p.attention;
            out["experts"] = p.experts;
            out["rest"] = p.rest;
            out["forwards"] = p.forwards;
            return out;
          },
          "Seconds in each part (gemm, attention, experts, rest) of the forwards since time_parts(True), and "
          "their count.")
      .def(
          "forward",
          [](DecoderStack& stack, uintptr_t input_ids, uintptr_t out, uintptr_t positions, uintptr_t slot_mapping,
             int64_t slot_tokens, uintptr_t block_tables, int64_t block_table_stride, uintptr_t context_lens,
             uintptr_t cu_seqlens_q, int64_t num_seqs, int64_t num_tokens, int64_t num_threads) {
            const DecoderShape& s = stack.shape();
            DecoderStep step;
            step.attn = checked_attention_args(block_tables, context_lens, cu_seqlens_q, num_tokens,
                                               block_table_stride, num_seqs, s.heads, s.kv_heads, s.head_dim,
                                               stack.block_size(), stack.num_blocks(), s.scale,
                                               static_cast<int64_t>(s.dtype), "DecoderStack.forward");
            if (slot_tokens < 0 || slot_tokens > num_tokens) value_error("DecoderStack.forward: bad slot_tokens");
            if (num_tokens > 0 && (!input_ids || !out || !positions || (slot_tokens > 0 && !slot_mapping))) {
              value_error("null pointer passed to DecoderStack.forward");
            }
            step.input_ids = reinterpret_cast<const int32_t*>(input_ids);
            for (int64_t i = 0; i < num_tokens; ++i) {
              if (step.input_ids[i] < 0 || step.input_ids[i] >= stack.vocab()) {
                throw py::index_error("DecoderStack.forward: token id " + std::to_string(step.input_ids[i]) +
                                      " is outside the embedding's " + std::to_string(stack.vocab()) + " rows");
              }
            }
            step.out = reinterpret_cast<void*>(out);
            step.positions = reinterpret_cast<const int32_t*>(positions);
            step.slot_mapping = reinterpret_cast<const int32_t*>(slot_mapping);
            step.tokens = num_tokens;
            step.slot_tokens = slot_tokens;
            step.covered = step.attn.num_seqs > 0 ? step.attn.cu_seqlens_q[step.attn.num_seqs] : 0;
            check_slots(step.slot_mapping, slot_tokens, stack.num_blocks() * stack.block_size());
            for (const DecoderLayerWeights& l : stack.layers()) {
              if (l.moe) check_moe_rows("DecoderStack.forward", num_tokens, l.moe->layer.experts, s.hidden, s.hidden, l.moe->layer);
            }
            py::gil_scoped_release release;
            stack.forward(step, clamp_threads(num_threads));
          },
          py::arg("input_ids"), py::arg("out"), py::arg("positions"), py::arg("slot_mapping"), py::arg("slot_tokens"),
          py::arg("block_tables"), py::arg("block_table_stride"), py::arg("context_lens"), py::arg("cu_seqlens_q"),
          py::arg("num_seqs"), py::arg("num_tokens"), py::arg("num_threads") = 1,
          "input_ids [num_tokens] int32, looked up in the stack's embedding -> out [num_tokens, hidden] (the final "
          "norm's output), writing this step's K/V; the attention metadata as qkv_attention_cpu takes it.");
}

}  // namespace

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "nanovllm's CPU kernels: paged attention, fused layers, sampler, GEMMs (dense and int8 / int4).";
  bind_cpu_attention(m);
  bind_cpu_fused_ops(m);
  bind_cpu_gemm(m);
  bind_cpu_gemm_quant(m);
  bind_cpu_moe(m);
  bind_cpu_sampler(m);
  bind_cpu_decoder(m);
}
