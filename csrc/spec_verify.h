// The host-side bookkeeping of a verification step (speculative decoding): which hidden-state rows
// take logits, which draft each of them checks, and, for greedy rows, how many drafts each sequence
// keeps. One call each where the numpy version of the same took ~25 array operations a step, a
// fixed cost that ate into batch-1 speculation's gain.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace nanovllm {

// Sample s verifies num_drafts[s] drafts: the tokens at positions sample_indices[s] - num_drafts[s] + 1
// .. sample_indices[s] of the step's inputs. Its logits rows are positions sample_indices[s] -
// num_drafts[s] .. sample_indices[s]; row j checks the draft input_ids[position + 1], and the last
// row (the token after the drafts) checks none (-1).
struct VerificationRows {
  std::vector<int64_t> positions;  // [rows] hidden-state row of each logits row
  std::vector<int64_t> drafts;     // [rows] the draft a row's token must equal to go on, -1 for none
};
VerificationRows verification_rows(std::span<const int32_t> num_drafts, std::span<const int32_t> sample_indices,
                                   std::span<const int32_t> input_ids);

// Greedy acceptance: sample s keeps its target tokens up to and including its first row whose
// token differs from that row's draft (the last row always ends it). `tokens` and `drafts` are in
// verification_rows' order.
struct Accepted {
  std::vector<int32_t> tokens;   // emitted tokens, sample after sample
  std::vector<int32_t> offsets;  // [samples + 1] sample s emitted tokens[offsets[s]:offsets[s + 1]]
  std::vector<int64_t> rows;     // [tokens.size()] the logits row of each emitted token
};
Accepted accept_greedy(std::span<const int64_t> tokens, std::span<const int64_t> drafts,
                       std::span<const int32_t> num_drafts);

}  // namespace nanovllm
