// Continuous batching with chunked prefill, prefix caching and preemption by recompute.
//
// Each step: running sequences first (one decode token each, or their next prefill chunk), in
// admission order; then waiting sequences in arrival order, each taking a prefill chunk that
// fits the remaining token budget. When the pool runs dry, the most recently admitted running
// sequence is preempted: its blocks are freed and it goes back to the front of the queue.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kv_cache_manager.h"
#include "sequence.h"
#include "step_plan.h"

namespace nanovllm {

enum class SpecMethod : uint8_t { kNone, kNgram, kExternal };

// Speculative decoding (docs/design.md, "Speculative decoding"). kNgram: the core drafts from each
// sequence's own tokens; kExternal: drafts are handed in with postprocess (a draft model), and every
// sampled row gets `num_tokens` lookahead slots past its tokens for the drafter's KV.
struct SpecConfig {
  SpecMethod method = SpecMethod::kNone;
  int32_t num_tokens = 0;  // k: drafts per sequence and step, at most
  int32_t ngram_min = 1, ngram_max = 1;
  int32_t disable_by_batch_size = 0;  // no drafts while this many sequences run or wait; 0: never
  bool adaptive = true;               // per sequence, fewer drafts (down to none) while few are accepted
};

struct SchedulerConfig {
  int32_t num_blocks = 0;
  int32_t block_size = 16;
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 8192;
  int32_t max_model_len = 4096;
  bool enable_prefix_caching = true;
  std::vector<int32_t> eos_token_ids;
  int32_t vocab_size = 0;  // 0: unknown
  SpecConfig spec;
};

enum class FinishReason : uint8_t { kStop, kLength };

struct FinishedSeq {
  int64_t id;
  FinishReason reason;
  int32_t stop_token;  // -1 unless finished by an EOS or stop token id
};

// A new sequence forked from a parent sampled in the step in flight: it shares the parent's
// blocks and takes `token` where the parent takes its own sample (parallel sampling, beams).
struct ForkRequest {
  int64_t parent;
  int64_t child;
  int32_t token;
};

// What a step produced, for postprocess. Row r (the r-th sample of the plan) gained
// sampled[offsets[r], offsets[r + 1]) (no offsets: sampled[r] alone): its accepted drafts, then
// one more token. Each is checked for a stop in order and the rest dropped (kept[r], if given,
// gets the number it took); rejected draft positions are rolled back. `forks` name parents
// sampled in this step: each child is forked after the parent's tokens of this step are computed
// and before the parent appends its own sample. `drafts` (SpecMethod::kExternal): row r's
// proposals for its next step, drafts[draft_offsets[r], draft_offsets[r + 1]).
struct StepTokens {
  std::span<const int32_t> sampled = {};
  std::span<const int32_t> offsets = {};
  std::span<const ForkRequest> forks = {};
  std::span<const int32_t> drafts = {}, draft_offsets = {};
  std::span<int32_t> kept = {};
};

struct SchedulerStats {
  int64_t num_preemptions = 0;
  int64_t spec_num_drafts = 0;          // rows verified with at least one draft
  int64_t spec_num_draft_tokens = 0;    // drafts verified
  int64_t spec_num_accepted_tokens = 0;
  std::vector<int64_t> spec_accepted_per_pos;  // [k]: drafts accepted at position i
  int64_t prefix_cache_queries = 0;  // tokens looked up on admission
  int64_t prefix_cache_hits = 0;     // of those, tokens served from the cache
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerConfig config);

  const SchedulerConfig& config() const { return config_; }
  // The longest a sequence may grow: max_model_len, or what the whole pool holds if less.
  int32_t max_seq_len() const;
  bool contains(int64_t id) const { return seqs_.count(id) != 0; }
  const Sequence& sequence(int64_t id) const { return *seqs_.at(id); }
  bool in_flight() const { return in_flight_; }
  bool in_current_batch(int64_t id) const;

  // `num_samples` (n, at most max_num_seqs): sequences its first sample fans out into.
  void add(int64_t id, std::vector<int32_t> prompt, StopParams stop, bool use_prefix_cache = true,
           int32_t num_samples = 1);
  void abort(int64_t id);
  void fork(int64_t parent_id, int64_t child_id);
  const StepPlan& schedule();
  // The tokens of the plan in flight, in plan order, and what else postprocess takes (StepTokens).
  std::vector<FinishedSeq> postprocess(const StepTokens& in);
  // A sequence that must not speculate (beam search): call before its first schedule.
  void disable_spec(int64_t id) { seqs_.at(id)->spec.enabled = false; }

  // Forget every cached prefix (vLLM's reset_prefix_cache): only when no block is in use, so no
  // running sequence's blocks change under it. Returns whether it did.
  bool reset_prefix_cache();

  const StepPlan& plan() const { return plan_; }
  const KVCacheManager& kv() const { return kv_; }
  const SchedulerStats& stats() const { return stats_; }
  // (sequence id, prompt tokens the prefix cache held) of each sequence first scheduled since the
  // last call: its num_cached_tokens, handed out once.
  std::vector<std::pair<int64_t, int32_t>> take_first_hits() { return std::exchange(first_hits_, {}); }
  size_t num_waiting() const { return waiting_.size(); }
  size_t num_running() const { return running_.size(); }
  bool has_unfinished() const { return !seqs_.empty(); }

 private:
  struct Scheduled {
    Sequence* seq;
    int32_t num_new;  // its drafts included
    bool sample;
    int32_t num_drafts;
  };

  void schedule_running(int32_t& budget, bool& preempted);
  void schedule_waiting(int32_t& budget);
  void preempt(Sequence& seq);
  // Appends the token and, if the sequence is done, releases it and records why.
  bool append_and_check(Sequence& seq, int32_t token, std::vector<FinishedSeq>& finished);
  void fork_in_step(const Sequence& parent, int64_t child_id, int32_t token, std::vector<FinishedSeq>& finished);
  bool check_finished(const Sequence& seq, FinishedSeq& out) const;
  // Drafts for a decode of `seq` (into seq.spec.draft), at most `room`; returns how many.
  int32_t take_drafts(Sequence& seq, int32_t room);
  int32_t lookahead(const Sequence& seq, int32_t num_new, bool sample) const;
  void record_verification(Sequence& seq, int32_t drafted, int32_t accepted);
  size_t plan_capacity() const { return static_cast<size_t>(config_.max_num_seqs); }
  void release(Sequence& seq);

  SchedulerConfig config_;
  KVCacheManager kv_;
  StepPlan plan_;
  std::unordered_map<int64_t, std::unique_ptr<Sequence>> seqs_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;  // admission order
  std::vector<Scheduled> batch_;    // the plan in flight, in plan order
  std::vector<std::pair<int32_t, int32_t>> copies_;
  bool in_flight_ = false;
  bool spec_this_step_ = false;
  SchedulerStats stats_;
  std::vector<std::pair<int64_t, int32_t>> first_hits_;  // take_first_hits()
};

}  // namespace nanovllm
