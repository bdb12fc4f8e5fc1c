#include "scheduler.h"

#include <algorithm>

namespace nanovllm {

namespace {

int32_t blocks_per_seq(const SchedulerConfig& c) {
  return (c.max_model_len + c.block_size - 1) / c.block_size;
}

}  // namespace

Scheduler::Scheduler(SchedulerConfig config)
    : config_(std::move(config)),
      kv_(config_.num_blocks, config_.block_size, config_.enable_prefix_caching),
      plan_(config_.max_num_batched_tokens, config_.max_num_seqs, blocks_per_seq(config_), config_.block_size) {
  batch_.reserve(config_.max_num_seqs);
  running_.reserve(config_.max_num_seqs);
  copies_.reserve(config_.max_num_seqs);
  stats_.spec_accepted_per_pos.assign(static_cast<size_t>(config_.spec.num_tokens), 0);
}

int32_t Scheduler::max_seq_len() const {
  const int64_t pool_tokens = static_cast<int64_t>(config_.num_blocks) * config_.block_size;
  return static_cast<int32_t>(std::min<int64_t>(config_.max_model_len, pool_tokens));
}

bool Scheduler::in_current_batch(int64_t id) const {
  const auto it = seqs_.find(id);
  return it != seqs_.end() && it->second->in_batch;
}

void Scheduler::add(int64_t id, std::vector<int32_t> prompt, StopParams stop, bool use_prefix_cache,
                    int32_t num_samples) {
  auto seq = std::make_unique<Sequence>();
  seq->id = id;
  seq->num_prompt_tokens = static_cast<int32_t>(prompt.size());
  seq->tokens = std::move(prompt);
  seq->tokens.reserve(std::min<size_t>(seq->tokens.size() + stop.max_tokens, config_.max_model_len));
  seq->stop = std::move(stop);
  seq->use_prefix_cache = use_prefix_cache;
  seq->num_samples = num_samples;
  seq->spec.k = config_.spec.num_tokens;
  waiting_.push_back(seq.get());
  seqs_.emplace(id, std::move(seq));
}

void Scheduler::release(Sequence& seq) {
  kv_.free(seq);
  seq.status = SeqStatus::kFinished;
}

void Scheduler::abort(int64_t id) {
  Sequence& seq = *seqs_.at(id);
  if (seq.in_batch) {
    seq.abort_pending = true;  // its tokens are in the plan in flight; postprocess releases it
    return;
  }
  if (seq.status == SeqStatus::kWaiting) {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), &seq));
  } else {
    running_.erase(std::find(running_.begin(), running_.end(), &seq));
  }
  release(seq);
  seqs_.erase(id);
}

void Scheduler::fork(int64_t parent_id, int64_t child_id) {
  const Sequence& parent = *seqs_.at(parent_id);
  auto child = std::make_unique<Sequence>();
  child->id = child_id;
  kv_.fork(parent, *child);
  child->spec.enabled = parent.spec.enabled;
  child->spec.k = config_.spec.num_tokens;
  child->status = parent.status;
  if (parent.status == SeqStatus::kRunning) {
    running_.push_back(child.get());
  } else {
    // Right behind its parent, so the two are admitted together and share cached blocks.
    waiting_.insert(std::find(waiting_.begin(), waiting_.end(), &parent) + 1, child.get());
  }
  seqs_.emplace(child_id, std::move(child));
}

void Scheduler::preempt(Sequence& seq) {
  kv_.free(seq);
  seq.status = SeqStatus::kWaiting;
  waiting_.push_front(&seq);
  ++stats_.num_preemptions;
}

void Scheduler::schedule_running(int32_t& budget, bool& preempted) {
  for (size_t i = 0; i < running_.size() && budget > 0 && batch_.size() < plan_capacity(); ++i) {
    Sequence* seq = running_[i];
    const int32_t pending = seq->num_tokens() - seq->num_computed;
    int32_t num_new = std::min(pending, budget);
    const bool sample = num_new == pending;
    const int32_t drafts = spec_this_step_ && pending == 1 ? take_drafts(*seq, budget - 1) : 0;
    num_new += drafts;
    const int32_t extra = lookahead(*seq, num_new, sample);
    bool fits = true;
    while (!kv_.allocate_slots(*seq, num_new + extra, copies_)) {
      // The newest running sequence sits last and has not been scheduled this step.
      Sequence* victim = running_.back();
      running_.pop_back();
      preempt(*victim);
      preempted = true;
      if (victim == seq) {
        fits = false;
        break;
      }
    }
    if (!fits) break;
    batch_.push_back({seq, num_new, sample, drafts});
    budget -= num_new;
  }
}

void Scheduler::schedule_waiting(int32_t& budget) {
  // Running slots: a prompt about to fan out holds one per sample, so the sequences (and the rows
  // a step samples) never exceed max_num_seqs; a large fan-out waits until it fits.
  int64_t slots = 0;
  for (const Sequence* s : running_) slots += s->num_samples;
  while (!waiting_.empty() && budget > 0 && batch_.size() < plan_capacity() &&
         slots + waiting_.front()->num_samples <= config_.max_num_seqs) {
    Sequence* seq = waiting_.front();
    const std::vector<int32_t> hits = kv_.find_cached_prefix(*seq);
    const int32_t hit_tokens = static_cast<int32_t>(hits.size()) * config_.block_size;
    const int32_t num_new = std::min(seq->num_tokens() - hit_tokens, budget);
    const bool sample = hit_tokens + num_new == seq->num_tokens();
    if (!kv_.allocate_with_prefix(*seq, hits, num_new + lookahead(*seq, hit_tokens + num_new, sample), copies_)) break;
    if (config_.enable_prefix_caching) {
      stats_.prefix_cache_queries += seq->num_tokens();
      stats_.prefix_cache_hits += hit_tokens;
    }
    if (seq->num_cached_tokens < 0) {  // a preempted sequence's later hits are not its request's
      seq->num_cached_tokens = hit_tokens;
      first_hits_.emplace_back(seq->id, hit_tokens);
    }
    waiting_.pop_front();
    seq->status = SeqStatus::kRunning;
    running_.push_back(seq);
    slots += seq->num_samples;
    batch_.push_back({seq, num_new, sample, 0});
    budget -= num_new;
  }
}

int32_t Scheduler::take_drafts(Sequence& seq, int32_t room) {
  SpecState& sp = seq.spec;
  if (!sp.enabled) return 0;
  if (sp.cooldown > 0) {
    --sp.cooldown;
    return 0;
  }
  // Every token a row emits is one of its drafts or the one after them: never past max_tokens
  // or the longest a sequence may grow.
  const int32_t cap = std::min({sp.k, room, seq.stop.max_tokens - seq.num_output_tokens() - 1,
                                max_seq_len() - seq.num_tokens() - 1});
  const SpecConfig& c = config_.spec;
  if (c.method == SpecMethod::kNgram) {
    sp.draft.clear();
    if (cap > 0) sp.ngram.propose(seq.tokens, c.ngram_min, c.ngram_max, cap, sp.draft);
  } else if (static_cast<int32_t>(sp.draft.size()) > std::max(cap, 0)) {
    sp.draft.resize(std::max(cap, 0));
  }
  return static_cast<int32_t>(sp.draft.size());
}

int32_t Scheduler::lookahead(const Sequence& seq, int32_t num_new, bool sample) const {
  // A draft model proposes after this step's tokens, writing its own KV at the positions that
  // follow them: those slots must exist (and are trimmed again by postprocess).
  if (!sample || config_.spec.method != SpecMethod::kExternal || !seq.spec.enabled) return 0;
  const int32_t end = seq.num_computed + num_new;
  return std::max(0, std::min(config_.spec.num_tokens, max_seq_len() - end));
}

void Scheduler::record_verification(Sequence& seq, int32_t drafted, int32_t accepted) {
  ++stats_.spec_num_drafts;
  stats_.spec_num_draft_tokens += drafted;
  stats_.spec_num_accepted_tokens += accepted;
  for (int32_t i = 0; i < accepted; ++i) ++stats_.spec_accepted_per_pos[i];
  if (!config_.spec.adaptive) return;
  // A draft model's drafts cost a forward each: as Hugging Face's assisted generation, two more
  // after a fully accepted row, one fewer after any rejection. N-gram drafts cost nothing to make
  // and only their verification rows' tokens, ~80 us each against a ~2.2 ms step at batch 1 on a
  // CPU (disable_by_batch_size ends drafting before steps grow compute-bound): their k stays.
  // Measured at batch 1 the two rules are within the host's noise (k 4: 1.97x fixed, 1.76x
  // shrinking; k 8: 1.78x / 1.86x; benchmarks/RESULTS.md, "Paired runs").
  // Either way a sequence that keeps accepting nothing stops drafting for a while, for twice as
  // long after each failed retry, so a workload it does not suit pays (almost) nothing for it.
  SpecState& sp = seq.spec;
  const int32_t k = config_.spec.num_tokens;
  if (config_.spec.method != SpecMethod::kNgram) {
    sp.k = accepted == drafted ? std::min(k, sp.k + 2) : std::max(1, sp.k - 1);
  }
  if (accepted > 0) {
    sp.misses = 0;
    sp.backoff = 1;
  } else if (++sp.misses >= 2) {
    sp.misses = 0;
    sp.cooldown = sp.backoff;
    sp.backoff = std::min(64, 2 * sp.backoff);
  }
}

const StepPlan& Scheduler::schedule() {
  batch_.clear();
  copies_.clear();
  int32_t budget = config_.max_num_batched_tokens;
  bool preempted = false;
  const SpecConfig& spec = config_.spec;
  // vLLM's rule: the requests in the engine (running and waiting), so that a burst of arrivals,
  // whose prefills fill the steps anyway, turns drafting off before they all run.
  const size_t enqueued = running_.size() + waiting_.size();
  spec_this_step_ = spec.method != SpecMethod::kNone && spec.num_tokens > 0 &&
                    (spec.disable_by_batch_size == 0 || enqueued < static_cast<size_t>(spec.disable_by_batch_size));
  schedule_running(budget, preempted);
  // Admitting while evicting would only preempt the newcomers again.
  if (!preempted) schedule_waiting(budget);

  // Decodes first, then prefill chunks, each group in scheduling order.
  std::stable_partition(batch_.begin(), batch_.end(), [](const Scheduled& s) { return s.num_new == 1; });
  plan_.begin();
  bool decodes_done = false;
  for (const Scheduled& s : batch_) {
    if (!decodes_done && s.num_new != 1) {
      plan_.mark_decodes_done();
      decodes_done = true;
    }
    plan_.add_sequence(*s.seq, s.num_new, s.sample, s.num_drafts);
    s.seq->in_batch = true;
  }
  if (!decodes_done) plan_.mark_decodes_done();
  for (const auto& [src, dst] : copies_) plan_.add_copy(src, dst);
  in_flight_ = true;
  return plan_;
}

bool Scheduler::check_finished(const Sequence& seq, FinishedSeq& out) const {
  const int32_t token = seq.tokens.back();
  const int32_t num_output = seq.num_output_tokens();
  out = {seq.id, FinishReason::kStop, -1};
  if (num_output > seq.stop.min_tokens) {
    const auto& eos = config_.eos_token_ids;
    const auto& stop_ids = seq.stop.stop_token_ids;
    const bool is_eos = !seq.stop.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end();
    if (is_eos || std::find(stop_ids.begin(), stop_ids.end(), token) != stop_ids.end()) {
      out.stop_token = token;
      return true;
    }
  }
  out.reason = FinishReason::kLength;
  return num_output >= seq.stop.max_tokens || seq.num_tokens() >= max_seq_len();
}

bool Scheduler::append_and_check(Sequence& seq, int32_t token, std::vector<FinishedSeq>& finished) {
  seq.tokens.push_back(token);
  FinishedSeq f;
  if (!check_finished(seq, f)) return false;
  finished.push_back(f);
  release(seq);
  return true;
}

void Scheduler::fork_in_step(const Sequence& parent, int64_t child_id, int32_t token,
                             std::vector<FinishedSeq>& finished) {
  auto child = std::make_unique<Sequence>();
  child->id = child_id;
  kv_.fork(parent, *child);
  child->spec.enabled = parent.spec.enabled;
  child->spec.k = config_.spec.num_tokens;
  if (append_and_check(*child, token, finished)) return;  // done at once: never runs
  child->status = SeqStatus::kRunning;
  running_.push_back(child.get());
  seqs_.emplace(child_id, std::move(child));
}

std::vector<FinishedSeq> Scheduler::postprocess(const StepTokens& in) {
  std::vector<FinishedSeq> finished;
  size_t next_sample = 0;
  bool any_removed = false;
  const bool external = config_.spec.method == SpecMethod::kExternal;
  for (const Scheduled& s : batch_) {
    Sequence& seq = *s.seq;
    seq.in_batch = false;
    if (!s.sample) {
      seq.num_computed += s.num_new;
      kv_.cache_full_blocks(seq);
      if (seq.abort_pending) {
        release(seq);
        any_removed = true;
      }
      continue;
    }
    const size_t row = next_sample++;
    const size_t lo = in.offsets.empty() ? row : static_cast<size_t>(in.offsets[row]);
    const size_t hi = in.offsets.empty() ? row + 1 : static_cast<size_t>(in.offsets[row + 1]);
    if (seq.abort_pending) {
      seq.num_computed += s.num_new - s.num_drafts;
      kv_.cache_full_blocks(seq);
      release(seq);
      any_removed = true;
      continue;
    }
    const int32_t accepted = static_cast<int32_t>(hi - lo) - 1;
    if (s.num_drafts > 0) record_verification(seq, s.num_drafts, accepted);
    // The positions whose KV holds the right tokens: the row's own, then its accepted drafts.
    seq.num_computed += s.num_new - s.num_drafts + accepted;
    int32_t taken = 0;
    bool done = false;
    for (size_t j = lo; j + 1 < hi && !done; ++j, ++taken) done = append_and_check(seq, in.sampled[j], finished);
    if (!done) {
      kv_.cache_full_blocks(seq);
      seq.num_samples = 1;  // its first sample fanned out (the forks below): one slot each now
      for (const ForkRequest& f : in.forks) {
        if (f.parent == seq.id) fork_in_step(seq, f.child, f.token, finished);
      }
      done = append_and_check(seq, in.sampled[hi - 1], finished);
      ++taken;
    }
    if (!in.kept.empty()) in.kept[row] = taken;
    if (done) {
      any_removed = true;
      continue;
    }
    kv_.trim(seq);  // rejected drafts' and lookahead slots
    if (external) {
      const auto first = in.drafts.begin() + (in.draft_offsets.empty() ? 0 : in.draft_offsets[row]);
      const auto last = in.drafts.begin() + (in.draft_offsets.empty() ? 0 : in.draft_offsets[row + 1]);
      seq.spec.draft.assign(first, last);
    }
  }
  if (any_removed) {
    std::erase_if(running_, [](const Sequence* s) { return s->status == SeqStatus::kFinished; });
    for (const Scheduled& s : batch_) {
      if (s.seq->status == SeqStatus::kFinished) seqs_.erase(s.seq->id);
    }
  }
  batch_.clear();
  in_flight_ = false;
  return finished;
}

bool Scheduler::reset_prefix_cache() {
  if (in_flight_ || kv_.pool().num_used() > 0) return false;
  kv_.pool().reset_prefix_cache();
  return true;
}

}  // namespace nanovllm
