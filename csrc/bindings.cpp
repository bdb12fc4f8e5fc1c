// pybind11 module `nanovllm._C`: the scheduling core (hashing, blocks, KV cache manager, scheduler,
// step plan, step ring). Every argument is validated here, at the boundary, so the core's hot
// loops can trust their inputs and nothing a caller passes can crash the process. The CPU math
// kernels are their own module, `nanovllm._cpu` (cpu_bindings.cpp).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <limits>
#include <string>
#include <unordered_set>

#include "binding_checks.h"
#include "block_pool.h"
#include "kv_cache_manager.h"
#include "scheduler.h"
#include "spec_verify.h"
#include "step_ring.h"
#include "xxhash64.h"

namespace py = pybind11;
using namespace nanovllm;
using namespace nanovllm::binding;

namespace {

// Token ids from a list/tuple of ints or an integer numpy array, each in [0, vocab) (vocab 0:
// no upper bound).
std::vector<int32_t> token_vector(py::handle obj, const char* name, int64_t vocab) {
  std::vector<int32_t> out;
  const int64_t hi = vocab > 0 ? vocab - 1 : kInt32Max;
  // `value` as text: an id too large for int64 is reported as the client wrote it.
  auto outside = [&](const std::string& value, size_t i) {
    value_error(std::string(name) + "[" + std::to_string(i) + "] = " + value + " is outside the vocabulary [0, " +
                std::to_string(hi + 1) + ")");
  };
  auto check = [&](int64_t v, size_t i) {
    if (v < 0 || v > hi) outside(std::to_string(v), i);
    out.push_back(static_cast<int32_t>(v));
  };
  if (py::isinstance<py::array>(obj)) {
    auto arr = py::reinterpret_borrow<py::array>(obj);
    const char kind = arr.dtype().kind();
    if (kind != 'i' && kind != 'u') value_error(std::string(name) + " must hold integers, got dtype " + std::string(py::str(arr.dtype())));
    if (arr.ndim() != 1) value_error(std::string(name) + " must be one-dimensional");
    auto wide = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    if (kind == 'u') {
      auto unsigned_view = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
      for (py::ssize_t i = 0; i < unsigned_view.size(); ++i) {
        if (unsigned_view.data()[i] > static_cast<uint64_t>(kInt32Max)) outside(std::to_string(unsigned_view.data()[i]), i);
      }
    }
    out.reserve(wide.size());
    for (py::ssize_t i = 0; i < wide.size(); ++i) check(wide.data()[i], i);
    return out;
  }
  if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj) || !py::isinstance<py::sequence>(obj)) {
    value_error(std::string(name) + " must be a sequence of token ids");
  }
  auto seq = py::reinterpret_borrow<py::sequence>(obj);
  out.reserve(seq.size());
  for (size_t i = 0; i < seq.size(); ++i) {
    py::object item = seq[i];
    if (!py::isinstance<py::int_>(item) || py::isinstance<py::bool_>(item)) {
      value_error(std::string(name) + "[" + std::to_string(i) + "] must be an int, got " +
                  std::string(py::str(py::type::of(item).attr("__name__"))));
    }
    int64_t v = 0;
    try {
      v = item.cast<int64_t>();
    } catch (const py::cast_error&) {
      outside(std::string(py::str(item)), i);
    }
    check(v, i);
  }
  return out;
}

template <typename T>
py::array view(const T* data, std::vector<py::ssize_t> shape, py::handle owner) {
  return py::array_t<T>(shape, data, owner);
}

Sequence& known(Scheduler& s, int64_t id) {
  if (!s.contains(id)) throw py::key_error("unknown sequence id " + std::to_string(id));
  return const_cast<Sequence&>(s.sequence(id));
}

void check_block(const BlockPool& pool, int64_t b) {
  if (b < 0 || b >= pool.num_blocks()) {
    throw py::index_error("block id " + std::to_string(b) + " out of range [0, " +
                          std::to_string(pool.num_blocks()) + ")");
  }
}

const char* status_name(SeqStatus s) {
  switch (s) {
    case SeqStatus::kWaiting: return "waiting";
    case SeqStatus::kRunning: return "running";
    case SeqStatus::kFinished: return "finished";
  }
  return "unknown";
}

std::vector<ForkRequest> parse_forks(const Scheduler& s, py::handle forks) {
  std::vector<ForkRequest> out;
  if (!py::isinstance<py::sequence>(forks)) value_error("forks must be a sequence of (parent_id, child_id, token)");
  const auto& plan = s.plan();
  const int64_t* sampled_begin = plan.sampled_seq_ids().data();
  const int64_t* sampled_end = sampled_begin + plan.num_samples();
  std::unordered_set<int64_t> children;
  for (py::handle item : py::reinterpret_borrow<py::sequence>(forks)) {
    if (!py::isinstance<py::tuple>(item) && !py::isinstance<py::list>(item)) value_error("each fork must be (parent_id, child_id, token)");
    auto t = py::reinterpret_borrow<py::sequence>(item);
    if (t.size() != 3) value_error("each fork must be (parent_id, child_id, token)");
    ForkRequest f{};
    try {
      f.parent = t[0].cast<int64_t>();
      f.child = t[1].cast<int64_t>();
    } catch (const py::cast_error&) {
      value_error("fork ids must be integers");
    }
    f.token = token_vector(py::make_tuple(t[2]), "fork token", s.config().vocab_size)[0];
    if (!s.contains(f.parent)) throw py::key_error("unknown sequence id " + std::to_string(f.parent));
    if (std::find(sampled_begin, sampled_end, f.parent) == sampled_end || s.sequence(f.parent).abort_pending) {
      value_error("cannot fork sequence " + std::to_string(f.parent) + ": it is not sampled in the step in flight");
    }
    if (s.contains(f.child) || !children.insert(f.child).second) {
      value_error("sequence id " + std::to_string(f.child) + " is already in use");
    }
    out.push_back(f);
  }
  return out;
}

py::list finished_list(const std::vector<FinishedSeq>& finished) {
  py::list out;
  for (const FinishedSeq& f : finished) {
    const char* reason = f.reason == FinishReason::kStop ? "stop" : "length";
    py::object stop_token = f.stop_token >= 0 ? py::object(py::int_(f.stop_token)) : py::object(py::none());
    out.append(py::make_tuple(f.id, reason, stop_token));
  }
  return out;
}

// Prefix sums over `rows` rows of `total` items: rows + 1 non-decreasing values from 0 to total.
std::vector<int32_t> offset_vector(py::handle obj, const char* name, int32_t rows, size_t total) {
  const auto v = token_vector(obj, name, 0);
  if (v.size() != static_cast<size_t>(rows) + 1 || v.front() != 0 || static_cast<size_t>(v.back()) != total) {
    value_error(std::string(name) + " must be " + std::to_string(rows + 1) + " prefix sums from 0 to " + std::to_string(total));
  }
  for (size_t i = 1; i < v.size(); ++i) {
    if (v[i] < v[i - 1]) value_error(std::string(name) + " must be non-decreasing");
  }
  return v;
}

py::dict scheduler_stats(const Scheduler& s) {
  const BlockPool& pool = s.kv().pool();
  py::dict d;
  d["num_preemptions"] = s.stats().num_preemptions;
  d["prefix_cache_queries"] = s.stats().prefix_cache_queries;
  d["prefix_cache_hits"] = s.stats().prefix_cache_hits;
  d["num_free_blocks"] = pool.num_free();
  d["num_used_blocks"] = pool.num_used();
  d["num_cached_blocks"] = pool.num_cached();
  d["num_total_blocks"] = pool.num_blocks();
  d["num_waiting"] = s.num_waiting();
  d["num_running"] = s.num_running();
  d["spec_num_drafts"] = s.stats().spec_num_drafts;
  d["spec_num_draft_tokens"] = s.stats().spec_num_draft_tokens;
  d["spec_num_accepted_tokens"] = s.stats().spec_num_accepted_tokens;
  d["spec_num_accepted_tokens_per_pos"] = s.stats().spec_accepted_per_pos;
  return d;
}

void bind_hashing(py::module_& m) {
  m.def(
      "xxh64",
      [](py::bytes data, uint64_t seed) {
        const std::string_view bytes = data;
        return xxh64({reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, seed);
      },
      py::arg("data"), py::arg("seed") = 0, "XXH64 of `data`, equal to xxhash.xxh64(data, seed).intdigest().");
  m.def(
      "hash_block_tokens",
      [](std::optional<uint64_t> parent, py::handle tokens) {
        const auto ids = token_vector(tokens, "token_ids", 0);
        return hash_block_tokens(parent.has_value(), parent.value_or(0), ids);
      },
      py::arg("parent_hash"), py::arg("token_ids"),
      "XXH64(parent as 8 LE bytes || tokens as int64 LE); parent_hash=None for a first block.");
  m.def(
      "hash_prompt_blocks",
      [](py::handle tokens, int64_t block_size) {
        const int32_t bs = checked_int32(block_size, "block_size", 1);
        Sequence seq;
        seq.tokens = token_vector(tokens, "token_ids", 0);
        hash_full_blocks(seq, bs);
        return seq.block_hashes;
      },
      py::arg("token_ids"), py::arg("block_size"), "Chained hashes of every full block of token_ids.");
}

void bind_block_pool(py::module_& m) {
  py::class_<BlockPool>(m, "BlockPool", "Physical KV blocks: ref counts, LRU free queue, hash -> block.")
      .def(py::init([](int64_t num_blocks, int64_t block_size) {
             const int32_t bs = checked_int32(block_size, "block_size", 1, 1 << 16);
             const int32_t nb = checked_int32(num_blocks, "num_blocks", 1, kInt32Max / bs);
             return BlockPool(nb, bs);
           }),
           py::arg("num_blocks"), py::arg("block_size"))
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("block_size", &BlockPool::block_size)
      .def_property_readonly("num_free_blocks", &BlockPool::num_free)
      .def_property_readonly("num_used_blocks", &BlockPool::num_used)
      .def_property_readonly("num_cached_blocks", &BlockPool::num_cached)
      .def("allocate",
           [](BlockPool& p) {
             if (p.num_free() == 0) throw py::value_error("no free block to allocate");
             return p.allocate();
           })
      .def("touch", [](BlockPool& p, int64_t b) { check_block(p, b); p.touch(static_cast<int32_t>(b)); }, py::arg("block_id"))
      .def("free",
           [](BlockPool& p, int64_t b) {
             check_block(p, b);
             if (p.ref_count(static_cast<int32_t>(b)) == 0) value_error("block " + std::to_string(b) + " is already free");
             p.free(static_cast<int32_t>(b));
           },
           py::arg("block_id"))
      .def("register",
           [](BlockPool& p, int64_t b, uint64_t hash, py::handle tokens) {
             check_block(p, b);
             const auto ids = token_vector(tokens, "token_ids", 0);
             if (static_cast<int64_t>(ids.size()) != p.block_size()) {
               value_error("a block holds " + std::to_string(p.block_size()) + " tokens, got " + std::to_string(ids.size()));
             }
             if (p.ref_count(static_cast<int32_t>(b)) == 0) value_error("block " + std::to_string(b) + " is free; only used blocks are registered");
             return p.register_block(static_cast<int32_t>(b), hash, ids);
           },
           py::arg("block_id"), py::arg("block_hash"), py::arg("token_ids"))
      .def("lookup",
           [](const BlockPool& p, uint64_t hash, py::handle tokens) {
             const auto ids = token_vector(tokens, "token_ids", 0);
             if (static_cast<int64_t>(ids.size()) != p.block_size()) {
               value_error("a block holds " + std::to_string(p.block_size()) + " tokens, got " + std::to_string(ids.size()));
             }
             return p.lookup(hash, ids);
           },
           py::arg("block_hash"), py::arg("token_ids"))
      .def("ref_count", [](const BlockPool& p, int64_t b) { check_block(p, b); return p.ref_count(static_cast<int32_t>(b)); }, py::arg("block_id"))
      .def("block_hash",
           [](const BlockPool& p, int64_t b) -> std::optional<uint64_t> {
             check_block(p, b);
             if (!p.has_hash(static_cast<int32_t>(b))) return std::nullopt;
             return p.hash_of(static_cast<int32_t>(b));
           },
           py::arg("block_id"))
      .def("free_queue", &BlockPool::free_queue, "Free blocks, head (next evicted) first.");
}

void bind_step_plan(py::module_& m) {
  using S = StepPlan;
  py::class_<PlanMirror>(m, "PlanMirror",
                         "What each block-table row of a copy of a StepPlan holds (a tensor-parallel ring "
                         "slot, all -1 to begin with), so StepPlan.copy_used writes only new entries.")
      .def(py::init([](int32_t max_seqs) {
             if (max_seqs < 0) throw py::value_error("max_seqs must be >= 0");
             return PlanMirror(max_seqs);
           }),
           py::arg("max_seqs"))
      .def_property_readonly("rows", &PlanMirror::rows);
  auto section = [](S::Section sec, auto length) {
    return [sec, length](py::object self) {
      const S& p = self.cast<const S&>();
      return view<int32_t>(p.section(sec), {static_cast<py::ssize_t>(length(p))}, self);
    };
  };
  py::class_<S>(m, "StepPlan", "The flat arrays of one forward pass; numpy views valid until the next schedule().")
      .def_property_readonly("num_seqs", &S::num_seqs)
      .def_property_readonly("num_tokens", &S::num_tokens)
      .def_property_readonly("num_prefill_tokens", &S::num_prefill_tokens)
      .def_property_readonly("num_decode_tokens", &S::num_decode_tokens)
      .def_property_readonly("num_decode_seqs", &S::num_decode_seqs)
      .def_property_readonly("num_samples", &S::num_samples)
      .def_property_readonly("num_draft_tokens", &S::num_draft_tokens)
      .def_property_readonly("num_drafts",
                             [](py::object self) {
                               const S& p = self.cast<const S&>();
                               return view<int32_t>(p.num_drafts().data(), {p.num_samples()}, self);
                             },
                             "Host only, per sample: its drafts, the tokens before its sample index.")
      .def_property_readonly("num_copies", &S::num_copies)
      .def_property_readonly("max_seqlen_q", &S::max_seqlen_q)
      .def_property_readonly("max_seqlen_k", &S::max_seqlen_k)
      .def_property_readonly("max_blocks_per_seq", &S::max_blocks_per_seq)
      .def_property_readonly("used_size", &S::used_size)
      .def_property_readonly("input_ids", section(S::kInputIds, [](const S& p) { return p.num_tokens(); }))
      .def_property_readonly("positions", section(S::kPositions, [](const S& p) { return p.num_tokens(); }))
      .def_property_readonly("slot_mapping", section(S::kSlotMapping, [](const S& p) { return p.num_tokens(); }))
      .def_property_readonly("cu_seqlens_q", section(S::kCuSeqlensQ, [](const S& p) { return p.num_seqs() + 1; }))
      .def_property_readonly("cu_seqlens_k", section(S::kCuSeqlensK, [](const S& p) { return p.num_seqs() + 1; }))
      .def_property_readonly("context_lens", section(S::kContextLens, [](const S& p) { return p.num_seqs(); }))
      .def_property_readonly("sample_indices", section(S::kSampleIndices, [](const S& p) { return p.num_samples(); }))
      .def_property_readonly("block_copies",
                             [](py::object self) {
                               const S& p = self.cast<const S&>();
                               return view<int32_t>(p.section(S::kBlockCopies), {p.num_copies(), 2}, self);
                             })
      .def_property_readonly("block_tables",
                             [](py::object self) {
                               const S& p = self.cast<const S&>();
                               return view<int32_t>(p.section(S::kBlockTables), {p.num_seqs(), p.max_blocks_per_seq()}, self);
                             })
      .def_property_readonly("seq_ids",
                             [](py::object self) {
                               const S& p = self.cast<const S&>();
                               return view<int64_t>(p.seq_ids().data(), {p.num_seqs()}, self);
                             })
      .def_property_readonly("sampled_seq_ids",
                             [](py::object self) {
                               const S& p = self.cast<const S&>();
                               return view<int64_t>(p.sampled_seq_ids().data(), {p.num_samples()}, self);
                             })
      .def_property_readonly("buffer",
                             [](py::object self) {
                               const S& p = self.cast<const S&>();
                               return view<int32_t>(p.buffer().data(), {static_cast<py::ssize_t>(p.buffer().size())}, self);
                             })
      .def(
          "copy_used",
          [](const S& p, uintptr_t counts, uintptr_t dst, size_t dst_size, PlanMirror& mirror) {
            if (dst_size < p.buffer().size()) throw py::value_error("the destination is smaller than the plan's buffer");
            if (mirror.rows() < p.num_seqs()) throw py::value_error("the mirror has fewer rows than the plan");
            p.copy_used(reinterpret_cast<int32_t*>(counts), reinterpret_cast<int32_t*>(dst), mirror);
          },
          py::arg("counts"), py::arg("dst"), py::arg("dst_size"), py::arg("mirror"),
          "Write the seven counts (num_tokens, num_seqs, num_samples, num_copies, num_decode_tokens, "
          "max_seqlen_q, max_seqlen_k) as int32 at address `counts`, and the used part of every section "
          "into the int32 buffer of `dst_size` ints at address `dst` (this plan's layout), whose "
          "block-table rows `mirror` describes: only the entries new to it are written. Raw addresses: "
          "the caller keeps both buffers alive and large enough.")
      .def_property_readonly("offsets", [](const S& p) {
        py::dict d;
        for (int s = 0; s < S::kNumSections; ++s) {
          d[py::str(std::string(S::kSectionNames[s]))] = p.offset(static_cast<S::Section>(s));
        }
        return d;
      });
}

void bind_step_ring(py::module_& m) {
  using W = StepRingWriter;
  py::class_<W>(m, "StepRingWriter",
                "Rank 0's end of the tensor-parallel step ring (nanovllm/distributed/shm_ring.py): one call "
                "per message.")
      .def(py::init([](uintptr_t control, int32_t num_workers, uintptr_t slots, int32_t num_slots, size_t slot_ints,
                       int32_t max_seqs, py::object /*owner*/) {
             if (num_workers < 1 || num_slots < 1 || slot_ints <= static_cast<size_t>(W::kHeaderInts) || max_seqs < 0) {
               throw py::value_error("bad ring geometry");
             }
             return W(reinterpret_cast<int64_t*>(control), num_workers, reinterpret_cast<int32_t*>(slots), num_slots,
                      slot_ints, max_seqs);
           }),
           py::arg("control"), py::arg("num_workers"), py::arg("slots"), py::arg("num_slots"), py::arg("slot_ints"),
           py::arg("max_seqs"), py::arg("owner"), py::keep_alive<1, 8>(),
           "Addresses into the mapped segment `owner` (kept alive with this writer).")
      .def("try_publish_step", &W::try_publish_step, py::arg("plan"))
      .def(
          "try_publish_rows",
          [](W& w, py::array_t<int32_t, py::array::c_style | py::array::forcecast> rows) {
            return w.try_publish_rows(rows.data(), static_cast<int32_t>(rows.size()));
          },
          py::arg("rows"))
      .def("try_publish_stop", &W::try_publish_stop)
      .def_property_readonly("next", &W::next, "The next message number.");
  using R = StepRingReader;
  py::class_<R>(m, "StepRingReader", "A worker's end of the tensor-parallel step ring.")
      .def(py::init([](uintptr_t control, int32_t num_workers, int32_t worker_index, uintptr_t slots,
                       int32_t num_slots, size_t slot_ints, py::object /*owner*/) {
             if (num_workers < 1 || num_slots < 1 || slot_ints <= static_cast<size_t>(W::kHeaderInts)) {
               throw py::value_error("bad ring geometry");
             }
             return R(reinterpret_cast<const int64_t*>(control), num_workers, worker_index,
                      reinterpret_cast<const int32_t*>(slots), num_slots, slot_ints);
           }),
           py::arg("control"), py::arg("num_workers"), py::arg("worker_index"), py::arg("slots"), py::arg("num_slots"),
           py::arg("slot_ints"), py::arg("owner"), py::keep_alive<1, 8>())
      .def("ready", &R::ready)
      .def(
          "poll",
          [](const R& r) -> py::object {
            if (!r.ready()) return py::none();
            const int32_t* h = r.header();
            // The header's first ten fields with the message number replaced by the slot.
            return py::make_tuple(r.slot(), h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8], h[9]);
          },
          "None until the next message is published; then (slot, kind, the seven counts, rows): the header's "
          "fields at their indices, the slot in place of the message number.")
      .def("ack", &R::ack);
}

void bind_scheduler(py::module_& m) {
  py::class_<Scheduler>(m, "Scheduler", "Continuous batching, chunked prefill, prefix caching, preemption.")
      .def(py::init([](int64_t num_blocks, int64_t block_size, int64_t max_num_seqs, int64_t max_num_batched_tokens,
                       int64_t max_model_len, bool enable_prefix_caching, py::handle eos_token_ids, int64_t vocab_size,
                       const std::string& spec_method, int64_t num_speculative_tokens, int64_t prompt_lookup_min,
                       int64_t prompt_lookup_max, int64_t disable_by_batch_size, bool adaptive_speculation) {
             SchedulerConfig c;
             c.block_size = checked_int32(block_size, "block_size", 1, 1 << 16);
             c.num_blocks = checked_int32(num_blocks, "num_blocks", 1, kInt32Max / c.block_size);
             c.max_num_seqs = checked_int32(max_num_seqs, "max_num_seqs", 1, 1 << 20);
             c.max_num_batched_tokens = checked_int32(max_num_batched_tokens, "max_num_batched_tokens", 1, 1 << 24);
             c.max_model_len = checked_int32(max_model_len, "max_model_len", 1, 1 << 24);
             c.vocab_size = checked_int32(vocab_size, "vocab_size", 0);
             c.enable_prefix_caching = enable_prefix_caching;
             c.eos_token_ids = token_vector(eos_token_ids, "eos_token_ids", c.vocab_size);
             SpecConfig& spec = c.spec;
             if (spec_method == "none") {
               spec.method = SpecMethod::kNone;
             } else if (spec_method == "ngram") {
               spec.method = SpecMethod::kNgram;
             } else if (spec_method == "external") {
               spec.method = SpecMethod::kExternal;
             } else {
               value_error("spec_method must be 'none', 'ngram' or 'external', got '" + spec_method + "'");
             }
             if (spec.method != SpecMethod::kNone) {
               spec.num_tokens = checked_int32(num_speculative_tokens, "num_speculative_tokens", 1, 64);
               spec.ngram_min = checked_int32(prompt_lookup_min, "prompt_lookup_min", 1, 1024);
               spec.ngram_max = checked_int32(prompt_lookup_max, "prompt_lookup_max", spec.ngram_min, 1024);
               spec.disable_by_batch_size = checked_int32(disable_by_batch_size, "disable_by_batch_size", 0);
               spec.adaptive = adaptive_speculation;
             }
             return std::make_unique<Scheduler>(std::move(c));
           }),
           py::arg("num_blocks"), py::arg("block_size"), py::arg("max_num_seqs"), py::arg("max_num_batched_tokens"),
           py::arg("max_model_len"), py::arg("enable_prefix_caching") = true,
           py::arg("eos_token_ids") = py::tuple(), py::arg("vocab_size") = 0, py::arg("spec_method") = "none",
           py::arg("num_speculative_tokens") = 0, py::arg("prompt_lookup_min") = 1, py::arg("prompt_lookup_max") = 1,
           py::arg("disable_by_batch_size") = 0, py::arg("adaptive_speculation") = true)
      .def("add",
           [](Scheduler& s, int64_t id, py::handle prompt, int64_t max_tokens, int64_t min_tokens, bool ignore_eos,
              py::handle stop_token_ids, bool use_prefix_cache, int64_t num_samples) {
             if (s.contains(id)) value_error("sequence id " + std::to_string(id) + " is already in use");
             auto tokens = token_vector(prompt, "prompt_token_ids", s.config().vocab_size);
             if (tokens.empty()) value_error("prompt_token_ids is empty: a prompt needs at least one token");
             const int64_t n = static_cast<int64_t>(tokens.size());
             if (n > s.config().max_model_len) {
               value_error("prompt has " + std::to_string(n) + " tokens, more than max_model_len=" +
                           std::to_string(s.config().max_model_len));
             }
             const int64_t pool_tokens = static_cast<int64_t>(s.config().num_blocks) * s.config().block_size;
             if (n > pool_tokens) {
               value_error("prompt has " + std::to_string(n) + " tokens but the whole KV cache holds only " +
                           std::to_string(pool_tokens) + " (" + std::to_string(s.config().num_blocks) + " blocks of " +
                           std::to_string(s.config().block_size) + ")");
             }
             StopParams stop;
             stop.max_tokens = checked_int32(max_tokens, "max_tokens", 1);
             stop.min_tokens = checked_int32(min_tokens, "min_tokens", 0, max_tokens);
             stop.ignore_eos = ignore_eos;
             stop.stop_token_ids = token_vector(stop_token_ids, "stop_token_ids", s.config().vocab_size);
             // More samples than max_num_seqs could never be admitted together: refuse, not deadlock.
             const int32_t samples = checked_int32(num_samples, "num_samples", 1, s.config().max_num_seqs);
             s.add(id, std::move(tokens), std::move(stop), use_prefix_cache, samples);
           },
           py::arg("seq_id"), py::arg("prompt_token_ids"), py::arg("max_tokens") = 16, py::arg("min_tokens") = 0,
           py::arg("ignore_eos") = false, py::arg("stop_token_ids") = py::tuple(), py::arg("use_prefix_cache") = true,
           py::arg("num_samples") = 1,
           "Queues a prompt. use_prefix_cache=False computes every prompt token (e.g. for prompt logprobs).")
      .def("abort",
           [](Scheduler& s, int64_t id) {
             known(s, id);
             s.abort(id);
           },
           py::arg("seq_id"), "Removes a waiting or running sequence and frees its blocks.")
      .def("fork",
           [](Scheduler& s, int64_t parent, int64_t child) {
             const Sequence& p = known(s, parent);
             if (s.contains(child)) value_error("sequence id " + std::to_string(child) + " is already in use");
             if (p.in_batch) value_error("cannot fork sequence " + std::to_string(parent) + " while its step is in flight; call postprocess first");
             s.fork(parent, child);
           },
           py::arg("parent_id"), py::arg("child_id"), "The child shares every block of the parent (copy-on-write).")
      .def("schedule",
           [](Scheduler& s) -> const StepPlan& {
             if (s.in_flight()) throw std::runtime_error("schedule() called twice: postprocess() the step in flight first");
             return s.schedule();
           },
           py::return_value_policy::reference_internal)
      .def("postprocess",
           [](Scheduler& s, py::handle sampled, py::handle forks) {
             if (!s.in_flight()) throw std::runtime_error("postprocess() called with no step in flight");
             const auto tokens = token_vector(sampled, "sampled_token_ids", s.config().vocab_size);
             if (static_cast<int64_t>(tokens.size()) != s.plan().num_samples()) {
               value_error("expected " + std::to_string(s.plan().num_samples()) + " sampled token ids, got " +
                           std::to_string(tokens.size()));
             }
             const std::vector<ForkRequest> fork_requests = parse_forks(s, forks);
             return finished_list(s.postprocess({.sampled = tokens, .forks = fork_requests}));
           },
           py::arg("sampled_token_ids"), py::arg("forks") = py::tuple(),
           "Appends one token per sample; `forks` is a sequence of (parent_id, child_id, token): each child "
           "shares its parent's blocks and takes `token` (the parent must be sampled in this step). Returns "
           "(seq_id, 'stop' | 'length', stop token or None) per finished sequence, children included.")
      .def("postprocess_spec",
           [](Scheduler& s, py::handle sampled, py::handle token_offsets, py::handle forks, py::handle drafts,
              py::handle draft_offsets) {
             if (!s.in_flight()) throw std::runtime_error("postprocess_spec() called with no step in flight");
             const StepPlan& plan = s.plan();
             const int32_t rows = plan.num_samples();
             const auto tokens = token_vector(sampled, "sampled_token_ids", s.config().vocab_size);
             const auto offsets = offset_vector(token_offsets, "token_offsets", rows, tokens.size());
             for (int32_t r = 0; r < rows; ++r) {
               const int32_t n = offsets[r + 1] - offsets[r];
               if (n < 1 || n > 1 + plan.num_drafts()[r]) {
                 value_error("row " + std::to_string(r) + " has " + std::to_string(n) + " tokens; it takes 1 to " +
                             std::to_string(1 + plan.num_drafts()[r]) + " (its accepted drafts, then one more)");
               }
             }
             const std::vector<ForkRequest> fork_requests = parse_forks(s, forks);
             std::vector<int32_t> draft_tokens, draft_offs;
             if (!drafts.is_none()) {
               if (s.config().spec.method != SpecMethod::kExternal) value_error("drafts are handed in only with spec_method='external'");
               draft_tokens = token_vector(drafts, "drafts", s.config().vocab_size);
               draft_offs = offset_vector(draft_offsets, "draft_offsets", rows, draft_tokens.size());
             }
             py::array_t<int32_t> kept(rows);
             std::fill(kept.mutable_data(), kept.mutable_data() + rows, 0);
             auto finished = s.postprocess({.sampled = tokens, .offsets = offsets, .forks = fork_requests,
                                            .drafts = draft_tokens, .draft_offsets = draft_offs,
                                            .kept = std::span<int32_t>(kept.mutable_data(), rows)});
             return py::make_tuple(finished_list(finished), kept);
           },
           py::arg("sampled_token_ids"), py::arg("token_offsets"), py::arg("forks") = py::tuple(),
           py::arg("drafts") = py::none(), py::arg("draft_offsets") = py::none(),
           "Several tokens per sample (speculative decoding): row r gained sampled_token_ids[token_offsets[r]:"
           "token_offsets[r + 1]], its accepted drafts then one more; each is checked for a stop in order and the "
           "rest dropped, rejected draft positions are rolled back. `drafts` / `draft_offsets` (spec_method "
           "'external'): each row's proposals for its next step. Returns (finished as postprocess(), kept: int32 "
           "[rows], the tokens each row took).")
      .def("disable_spec",
           [](Scheduler& s, int64_t id) {
             const Sequence& seq = known(s, id);
             if (seq.status != SeqStatus::kWaiting || seq.num_computed > 0) value_error("disable_spec() before the sequence first runs");
             s.disable_spec(id);
           },
           py::arg("seq_id"), "This sequence never speculates (beam search).")
      .def("has_unfinished", &Scheduler::has_unfinished)
      .def("take_first_hits", &Scheduler::take_first_hits,
           "[(seq_id, prompt tokens the prefix cache held)] of the sequences first scheduled since the last call.")
      .def("reset_prefix_cache", &Scheduler::reset_prefix_cache,
           "Forget every cached prefix; only while no block is in use. Returns whether it did.")
      .def_property_readonly("in_flight", &Scheduler::in_flight, "Whether a scheduled step awaits postprocess().")
      .def_property_readonly("plan", &Scheduler::plan, py::return_value_policy::reference_internal,
                             "The most recent plan (valid until the next schedule()).")
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("num_preemptions", [](const Scheduler& s) { return s.stats().num_preemptions; })
      .def_property_readonly("num_free_blocks", [](const Scheduler& s) { return s.kv().pool().num_free(); })
      .def_property_readonly("num_total_blocks", [](const Scheduler& s) { return s.kv().pool().num_blocks(); })
      .def("token_ids", [](Scheduler& s, int64_t id) { return known(s, id).tokens; }, py::arg("seq_id"))
      .def("num_computed_tokens", [](Scheduler& s, int64_t id) { return known(s, id).num_computed; }, py::arg("seq_id"))
      .def("block_table", [](Scheduler& s, int64_t id) { return known(s, id).block_table; }, py::arg("seq_id"))
      .def("status", [](Scheduler& s, int64_t id) { return status_name(known(s, id).status); }, py::arg("seq_id"))
      .def("ref_count",
           [](const Scheduler& s, int64_t b) {
             check_block(s.kv().pool(), b);
             return s.kv().pool().ref_count(static_cast<int32_t>(b));
           },
           py::arg("block_id"))
      .def("free_queue", [](const Scheduler& s) { return s.kv().pool().free_queue(); })
      .def("stats", &scheduler_stats);
}

template <typename T>
using InArray = py::array_t<T, py::array::c_style | py::array::forcecast>;

// A one-dimensional numpy integer array as T, every value checked to fit T: a float array or a
// value that would wrap is an error, not a conversion.
template <typename T>
InArray<T> int_array(py::handle obj, const char* name) {
  if (!py::isinstance<py::array>(obj)) value_error(std::string(name) + " must be a numpy integer array");
  const auto arr = py::reinterpret_borrow<py::array>(obj);
  const char kind = arr.dtype().kind();
  if (kind != 'i' && kind != 'u') value_error(std::string(name) + " must hold integers, got dtype " + std::string(py::str(arr.dtype())));
  if (arr.ndim() != 1) value_error(std::string(name) + " must be one-dimensional");
  auto bad = [name](py::ssize_t i, const std::string& v) {
    value_error(std::string(name) + "[" + std::to_string(i) + "] = " + v + " does not fit " +
                (sizeof(T) == 4 ? "int32" : "int64"));
  };
  if (kind == 'u') {
    const auto u = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    for (py::ssize_t i = 0; i < u.size(); ++i) {
      if (u.data()[i] > static_cast<uint64_t>(std::numeric_limits<T>::max())) bad(i, std::to_string(u.data()[i]));
    }
  } else {
    const auto w = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    for (py::ssize_t i = 0; i < w.size(); ++i) {
      const int64_t v = w.data()[i];
      if (v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) bad(i, std::to_string(v));
    }
  }
  return InArray<T>::ensure(arr);
}

template <typename T>
py::array_t<T> to_array(const std::vector<T>& v) {
  py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// A verification step's drafts per sample (num_drafts, each >= 0) and the logits rows they make.
struct DraftCounts {
  InArray<int32_t> array;
  std::span<const int32_t> counts;
  int64_t rows = 0;  // samples + drafts
};

DraftCounts checked_drafts(py::handle obj) {
  DraftCounts d{int_array<int32_t>(obj, "num_drafts"), {}, 0};
  d.counts = {d.array.data(), static_cast<size_t>(d.array.size())};
  d.rows = static_cast<int64_t>(d.counts.size());
  for (size_t s = 0; s < d.counts.size(); ++s) {
    if (d.counts[s] < 0) value_error("num_drafts[" + std::to_string(s) + "] = " + std::to_string(d.counts[s]) + " is negative");
    d.rows += d.counts[s];
  }
  return d;
}

void bind_spec_verify(py::module_& m) {
  m.def(
      "verification_rows",
      [](py::handle drafts_obj, py::handle samples_obj, py::handle inputs_obj) {
        const DraftCounts drafts = checked_drafts(drafts_obj);
        const auto sample_indices = int_array<int32_t>(samples_obj, "sample_indices");
        const auto input_ids = int_array<int32_t>(inputs_obj, "input_ids");
        const std::span<const int32_t> d = drafts.counts;
        if (static_cast<size_t>(sample_indices.size()) != d.size()) {
          value_error("sample_indices must have one entry per sample (" + std::to_string(d.size()) + ")");
        }
        for (size_t s = 0; s < d.size(); ++s) {
          const int64_t last = sample_indices.data()[s];
          if (last - d[s] < 0 || last >= input_ids.size()) {
            value_error("sample " + std::to_string(s) + ": sample index " + std::to_string(last) + " with " +
                        std::to_string(d[s]) + " drafts is outside the step's " + std::to_string(input_ids.size()) +
                        " tokens");
          }
        }
        const VerificationRows v =
            verification_rows(d, {sample_indices.data(), d.size()}, {input_ids.data(), static_cast<size_t>(input_ids.size())});
        return py::make_tuple(to_array(v.positions), to_array(v.drafts));
      },
      py::arg("num_drafts"), py::arg("sample_indices"), py::arg("input_ids"),
      "A verification step's logits rows: (positions int64 [rows], drafts int64 [rows]). Sample s takes rows "
      "sample_indices[s] - num_drafts[s] .. sample_indices[s]; a row's draft is the next input token, -1 for "
      "each sample's last row.");
  m.def(
      "accept_greedy",
      [](py::handle tokens_obj, py::handle drafts_obj, py::handle num_drafts_obj) {
        const auto tokens = int_array<int64_t>(tokens_obj, "tokens");
        const auto drafts = int_array<int64_t>(drafts_obj, "drafts");
        const DraftCounts d = checked_drafts(num_drafts_obj);
        if (tokens.size() != d.rows || drafts.size() != d.rows) {
          value_error("tokens and drafts must have one entry per verification row (" + std::to_string(d.rows) + ")");
        }
        const Accepted a = accept_greedy({tokens.data(), static_cast<size_t>(d.rows)},
                                         {drafts.data(), static_cast<size_t>(d.rows)}, d.counts);
        return py::make_tuple(to_array(a.tokens), to_array(a.offsets), to_array(a.rows));
      },
      py::arg("tokens"), py::arg("drafts"), py::arg("num_drafts"),
      "Greedy verification: each sample keeps its tokens up to its first that differs from the row's draft "
      "(rows as verification_rows). Returns (tokens int32, offsets int32 [samples + 1], rows int64: each "
      "emitted token's logits row).");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "nanovllm's C++ engine core: block pool, KV cache manager, scheduler, step plan.";
  bind_hashing(m);
  bind_block_pool(m);
  bind_step_plan(m);
  bind_step_ring(m);
  bind_scheduler(m);
  bind_spec_verify(m);
}
