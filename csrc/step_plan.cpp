#include "step_plan.h"

#include <algorithm>
#include <cstring>

namespace nanovllm {

StepPlan::StepPlan(int32_t max_tokens, int32_t max_seqs, int32_t max_blocks_per_seq, int32_t block_size)
    : max_tokens_(max_tokens), max_seqs_(max_seqs), max_blocks_(max_blocks_per_seq), block_size_(block_size) {
  const size_t sizes[kNumSections] = {
      static_cast<size_t>(max_tokens), static_cast<size_t>(max_tokens), static_cast<size_t>(max_tokens),
      static_cast<size_t>(max_seqs) + 1, static_cast<size_t>(max_seqs) + 1, static_cast<size_t>(max_seqs),
      static_cast<size_t>(max_seqs), 2 * static_cast<size_t>(max_seqs),
      static_cast<size_t>(max_seqs) * max_blocks_per_seq};
  size_t total = 0;
  for (int s = 0; s < kNumSections; ++s) {
    offset_[s] = total;
    total += sizes[s];
  }
  buffer_.assign(total, 0);
  std::fill(buffer_.begin() + offset_[kBlockTables], buffer_.end(), -1);
  seq_ids_.assign(max_seqs, 0);
  sampled_seq_ids_.assign(max_seqs, 0);
  num_drafts_.assign(max_seqs, 0);
  row_epoch_.assign(max_seqs, 0);
  row_len_.assign(max_seqs, 0);
}

void StepPlan::begin() {
  num_seqs_ = num_tokens_ = num_samples_ = num_copies_ = num_draft_tokens_ = 0;
  num_decode_seqs_ = num_decode_tokens_ = 0;
  max_seqlen_q_ = max_seqlen_k_ = 0;
  at(kCuSeqlensQ)[0] = 0;
  at(kCuSeqlensK)[0] = 0;
}

void StepPlan::add_sequence(const Sequence& seq, int32_t num_new, bool sample, int32_t num_drafts) {
  const int32_t row = num_seqs_++;
  const int32_t start = seq.num_computed;
  const int32_t context = start + num_new;
  int32_t* ids = at(kInputIds) + num_tokens_;
  int32_t* pos = at(kPositions) + num_tokens_;
  int32_t* slots = at(kSlotMapping) + num_tokens_;
  const int32_t* table = seq.block_table.data();
  const int32_t num_known = num_new - num_drafts;
  for (int32_t i = 0; i < num_new; ++i) {
    const int32_t p = start + i;
    ids[i] = i < num_known ? seq.tokens[p] : seq.spec.draft[i - num_known];
    pos[i] = p;
    slots[i] = table[p / block_size_] * block_size_ + p % block_size_;
  }
  num_tokens_ += num_new;
  at(kCuSeqlensQ)[row + 1] = num_tokens_;
  at(kCuSeqlensK)[row + 1] = at(kCuSeqlensK)[row] + context;
  at(kContextLens)[row] = context;
  seq_ids_[row] = seq.id;
  if (sample) {
    at(kSampleIndices)[num_samples_] = num_tokens_ - 1;
    sampled_seq_ids_[num_samples_] = seq.id;
    num_drafts_[num_samples_] = num_drafts;
    num_draft_tokens_ += num_drafts;
    ++num_samples_;
  }
  max_seqlen_q_ = std::max(max_seqlen_q_, num_new);
  max_seqlen_k_ = std::max(max_seqlen_k_, context);
  write_block_table_row(row, seq);
}

void StepPlan::write_block_table_row(int32_t row, const Sequence& seq) {
  int32_t* dst = at(kBlockTables) + static_cast<size_t>(row) * max_blocks_;
  const int32_t len = static_cast<int32_t>(seq.block_table.size());
  int32_t from = 0;
  if (row_epoch_[row] == seq.table_epoch) {
    from = row_len_[row];  // same table, only appended to since this row was written
  } else if (row_len_[row] > len) {
    std::fill(dst + len, dst + row_len_[row], -1);
  }
  std::copy(seq.block_table.begin() + from, seq.block_table.end(), dst + from);
  row_epoch_[row] = seq.table_epoch;
  row_len_[row] = len;
}

void StepPlan::add_copy(int32_t src, int32_t dst) {
  int32_t* pair = at(kBlockCopies) + 2 * static_cast<size_t>(num_copies_++);
  pair[0] = src;
  pair[1] = dst;
}

void StepPlan::copy_used(int32_t* counts, int32_t* dst, PlanMirror& mirror) const {
  const int32_t c[] = {num_tokens_, num_seqs_, num_samples_, num_copies_, num_decode_tokens_, max_seqlen_q_,
                       max_seqlen_k_};
  std::memcpy(counts, c, sizeof(c));
  const size_t used[kBlockTables] = {
      static_cast<size_t>(num_tokens_), static_cast<size_t>(num_tokens_), static_cast<size_t>(num_tokens_),
      static_cast<size_t>(num_seqs_) + 1, static_cast<size_t>(num_seqs_) + 1, static_cast<size_t>(num_seqs_),
      static_cast<size_t>(num_samples_), 2 * static_cast<size_t>(num_copies_)};
  for (int s = 0; s < kBlockTables; ++s) {
    std::memcpy(dst + offset_[s], buffer_.data() + offset_[s], used[s] * sizeof(int32_t));
  }
  // As write_block_table_row, with the mirror's rows in place of the sequences' tables.
  const int32_t* src = section(kBlockTables);
  int32_t* out = dst + offset_[kBlockTables];
  for (int32_t r = 0; r < num_seqs_; ++r) {
    const size_t base = static_cast<size_t>(r) * max_blocks_;
    const int32_t len = row_len_[r];
    int32_t& have = mirror.row_len_[r];
    int32_t from = 0;
    if (mirror.row_epoch_[r] == row_epoch_[r] && have <= len) {
      from = have;  // the same table, only appended to since the copy got it
    } else if (have > len) {
      std::fill(out + base + len, out + base + have, -1);
    }
    std::copy(src + base + from, src + base + len, out + base + from);
    mirror.row_epoch_[r] = row_epoch_[r];
    have = len;
  }
}

}  // namespace nanovllm
