#include "spec_verify.h"

namespace nanovllm {

VerificationRows verification_rows(std::span<const int32_t> num_drafts, std::span<const int32_t> sample_indices,
                                   std::span<const int32_t> input_ids) {
  VerificationRows out;
  size_t rows = num_drafts.size();
  for (const int32_t d : num_drafts) rows += static_cast<size_t>(d);
  out.positions.reserve(rows);
  out.drafts.reserve(rows);
  for (size_t s = 0; s < num_drafts.size(); ++s) {
    const int64_t last = sample_indices[s];
    for (int64_t p = last - num_drafts[s]; p < last; ++p) {
      out.positions.push_back(p);
      out.drafts.push_back(input_ids[p + 1]);
    }
    out.positions.push_back(last);
    out.drafts.push_back(-1);
  }
  return out;
}

Accepted accept_greedy(std::span<const int64_t> tokens, std::span<const int64_t> drafts,
                       std::span<const int32_t> num_drafts) {
  Accepted out;
  out.offsets.reserve(num_drafts.size() + 1);
  out.offsets.push_back(0);
  int64_t row = 0;
  for (const int32_t d : num_drafts) {
    const int64_t end = row + d + 1;
    for (int64_t j = row; j < end; ++j) {
      out.tokens.push_back(static_cast<int32_t>(tokens[j]));
      out.rows.push_back(j);
      if (tokens[j] != drafts[j]) break;
    }
    out.offsets.push_back(static_cast<int32_t>(out.tokens.size()));
    row = end;
  }
  return out;
}

}  // namespace nanovllm
