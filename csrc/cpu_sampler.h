// The sampler's CPU kernels: what torch does on the CPU in many full-vocabulary passes (argmax,
// uniform noise for every entry, sort or topk, cumsum, log_softmax), done per row in one or two
// passes. Each row is independent, so rows are split over threads.
//
// Semantics (those of nanovllm/sample/sampler.py, in vLLM's order): temperature -> min-p (drop what
// is below min_p x the most likely) -> top-k -> top-p (the smallest most-likely prefix whose mass
// reaches top_p of what min-p and top-k left) -> sample. A row draws one uniform `u` and takes the
// token where the running sum of the kept probabilities, in candidate order, first exceeds u x their
// total: the row's result depends only on its logits and its u, never on its batch.
#pragma once

#include <cstdint>

namespace nanovllm {

// Temperatures at or below this are greedy (as GREEDY_EPS in the Python sampler).
inline constexpr float kGreedyTemperature = 1e-5f;

// Rows of fp32 logits, `stride` floats apart, `vocab` entries each.
struct LogitRows {
  const float* data;
  int64_t rows, vocab, stride;
};

struct SampleArgs {
  LogitRows logits;
  const float* temperature;  // [rows]; <= kGreedyTemperature: argmax (first of equal maxima)
  const int64_t* top_k;      // [rows]; <= 0 or >= vocab: off
  const float* top_p;        // [rows]; >= 1: off
  const float* min_p;        // [rows]; <= 0: off
  const double* uniform;     // [rows] in [0, 1): the row's draw (unused by greedy rows)
  int64_t* out;              // [rows] token ids
};
void sample(const SampleArgs& a, int num_threads);

// The first maximum of each row (every row greedy: no parameters to read).
void argmax_rows(const LogitRows& logits, int64_t* out, int num_threads);

// log_softmax of each row, read at the chosen token and at the row's k most likely tokens.
struct LogprobArgs {
  LogitRows logits;
  const int64_t* chosen;   // [rows]
  int64_t k;               // alternatives per row (the batch's largest ask)
  double* chosen_logprob;  // [rows]
  int64_t* chosen_rank;    // [rows]: 1 + tokens strictly more likely than the chosen one
  int64_t* top_ids;        // [rows, k], most likely first (ties: lower id first)
  double* top_logprobs;    // [rows, k]
};
void logprobs(const LogprobArgs& a, int num_threads);

// In place on logits row rows[i], from the sequence's dense penalty row seen[slots[i]]
// ([2, vocab]: prompt presence, output counts): repetition divides positive (multiplies negative)
// logits of tokens seen in the prompt or the output; frequency subtracts count x penalty and
// presence subtracts the penalty once, for tokens in the output (vLLM's / OpenAI's definitions).
struct PenaltyArgs {
  float* logits;
  int64_t vocab, stride, rows;
  const int64_t* logit_rows;  // [rows]
  const float* seen;          // [slots, 2, vocab]
  const int64_t* slots;       // [rows]
  const float* repetition;    // [rows]
  const float* frequency;     // [rows]
  const float* presence;      // [rows]
};
void apply_penalties(const PenaltyArgs& a, int num_threads);

}  // namespace nanovllm
