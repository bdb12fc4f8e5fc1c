// The flat arrays of one forward pass (docs/design.md, "The step"), in one persistent int32 buffer.
//
// Every array sits at a fixed offset sized for the maximum batch, block tables last, so a
// runner moves a whole plan with one copy of buffer[0, used_size()) and takes views of it.
// Block-table rows persist across steps: each row remembers which table (by epoch) and how many
// entries it holds, and a step writes only entries that are new, so its cost follows the number
// of scheduled sequences, not their context lengths.
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "sequence.h"

namespace nanovllm {

class PlanMirror;

class StepPlan {
 public:
  enum Section : int { kInputIds, kPositions, kSlotMapping, kCuSeqlensQ, kCuSeqlensK, kContextLens,
                       kSampleIndices, kBlockCopies, kBlockTables, kNumSections };
  static constexpr std::string_view kSectionNames[kNumSections] = {
      "input_ids", "positions", "slot_mapping", "cu_seqlens_q", "cu_seqlens_k",
      "context_lens", "sample_indices", "block_copies", "block_tables"};

  StepPlan(int32_t max_tokens, int32_t max_seqs, int32_t max_blocks_per_seq, int32_t block_size);

  void begin();
  // Appends `num_new` tokens of `seq` starting at seq.num_computed, the last `num_drafts` of them
  // its drafts (seq.spec.draft); `sample` marks its last token as one that produces a sampled token
  // (with drafts, every draft position's logits are verified too: logits_indices()).
  void add_sequence(const Sequence& seq, int32_t num_new, bool sample, int32_t num_drafts = 0);
  void add_copy(int32_t src, int32_t dst);
  // Call after the decodes (query length 1), which come first in the batch.
  void mark_decodes_done() { num_decode_seqs_ = num_seqs_; num_decode_tokens_ = num_tokens_; }

  int32_t num_seqs() const { return num_seqs_; }
  int32_t num_tokens() const { return num_tokens_; }
  int32_t num_decode_tokens() const { return num_decode_tokens_; }
  int32_t num_decode_seqs() const { return num_decode_seqs_; }
  int32_t num_prefill_tokens() const { return num_tokens_ - num_decode_tokens_; }
  int32_t num_samples() const { return num_samples_; }
  int32_t num_draft_tokens() const { return num_draft_tokens_; }
  int32_t num_copies() const { return num_copies_; }
  int32_t max_seqlen_q() const { return max_seqlen_q_; }
  int32_t max_seqlen_k() const { return max_seqlen_k_; }
  int32_t max_blocks_per_seq() const { return max_blocks_; }
  size_t used_size() const { return offset_[kBlockTables] + static_cast<size_t>(num_seqs_) * max_blocks_; }

  // What a tensor-parallel worker receives (nanovllm/distributed/step_message.py), in one call: the
  // seven counts num_tokens, num_seqs, num_samples, num_copies, num_decode_tokens, max_seqlen_q,
  // max_seqlen_k into `counts`, and the used part of every section into `dst`, a buffer in this
  // plan's layout whose block-table rows are described by `mirror` (see PlanMirror).
  void copy_used(int32_t* counts, int32_t* dst, PlanMirror& mirror) const;

  const int32_t* section(Section s) const { return buffer_.data() + offset_[s]; }
  size_t offset(Section s) const { return offset_[s]; }
  const std::vector<int32_t>& buffer() const { return buffer_; }
  const std::vector<int64_t>& seq_ids() const { return seq_ids_; }
  const std::vector<int64_t>& sampled_seq_ids() const { return sampled_seq_ids_; }
  // Host only, per sample: its drafts, verified at the num_drafts tokens before its sample index.
  const std::vector<int32_t>& num_drafts() const { return num_drafts_; }

 private:
  int32_t* at(Section s) { return buffer_.data() + offset_[s]; }
  void write_block_table_row(int32_t row, const Sequence& seq);

  int32_t max_tokens_, max_seqs_, max_blocks_, block_size_;
  size_t offset_[kNumSections];
  std::vector<int32_t> buffer_;
  std::vector<int64_t> seq_ids_;          // [num_seqs] (capacity max_seqs)
  std::vector<int64_t> sampled_seq_ids_;  // [num_samples]
  std::vector<int32_t> num_drafts_;       // [num_samples]
  std::vector<uint64_t> row_epoch_;       // which table each block-table row holds
  std::vector<int32_t> row_len_;          // and how many of its entries

  int32_t num_seqs_ = 0, num_tokens_ = 0, num_samples_ = 0, num_copies_ = 0, num_draft_tokens_ = 0;
  int32_t num_decode_seqs_ = 0, num_decode_tokens_ = 0;
  int32_t max_seqlen_q_ = 0, max_seqlen_k_ = 0;
};

// Which table (by epoch) and how many entries each block-table row of a copy of a StepPlan holds
// (a tensor-parallel ring slot; it starts all -1, as a plan does), so that StepPlan::copy_used
// writes only the entries new to it: a decode step costs per sequence, not per context block,
// and every row of the copy reads exactly like the plan's (its table, then -1).
class PlanMirror {
 public:
  explicit PlanMirror(int32_t max_seqs) : row_epoch_(max_seqs, 0), row_len_(max_seqs, 0) {}
  int32_t rows() const { return static_cast<int32_t>(row_len_.size()); }

 private:
  friend class StepPlan;
  std::vector<uint64_t> row_epoch_;
  std::vector<int32_t> row_len_;
};

}  // namespace nanovllm
