// Per-request token state that scheduling needs. Text and sampling settings live in Python.
#pragma once

#include <cstdint>
#include <vector>

#include "ngram_proposer.h"

namespace nanovllm {

enum class SeqStatus : uint8_t { kWaiting, kRunning, kFinished };

struct StopParams {
  int32_t max_tokens = 16;
  int32_t min_tokens = 0;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
};

// Speculative decoding's per-sequence state (docs/design.md, "Speculative decoding").
struct SpecState {
  bool enabled = true;        // false: never drafts (beam search)
  int32_t k = 0;              // drafts it may take next (adapts to its acceptance)
  int32_t misses = 0;         // verifications in a row that accepted nothing
  int32_t cooldown = 0;       // steps left without drafting
  int32_t backoff = 1;        // the next cooldown
  std::vector<int32_t> draft; // proposed tokens for its next decode (drafted or handed in)
  NgramIndex ngram;
};

struct Sequence {
  int64_t id = 0;
  std::vector<int32_t> tokens;  // prompt then generated tokens
  int32_t num_prompt_tokens = 0;
  // Tokens whose K/V are in the cache. The newest sampled token is never computed yet.
  int32_t num_computed = 0;
  // Prompt tokens the prefix cache held when it was first scheduled (vLLM's num_cached_tokens);
  // -1 until then.
  int32_t num_cached_tokens = -1;
  std::vector<int32_t> block_table;
  // Chained hashes of the first block_hashes.size() full blocks of `tokens`.
  std::vector<uint64_t> block_hashes;
  // Full, computed blocks already offered to the prefix cache.
  int32_t num_registered_blocks = 0;
  StopParams stop;
  SeqStatus status = SeqStatus::kWaiting;
  // Changes (to a value never used before) whenever block_table changes other than by
  // appending, so a cached block-table row can tell whether it is still valid.
  uint64_t table_epoch = 0;
  // False for requests that need every prompt position computed (prompt logprobs).
  bool use_prefix_cache = true;
  // Running slots it takes (of max_num_seqs): n for a prompt whose first sample fans out into
  // n sequences, reserved from admission so the fan-out never runs past the cap; then 1.
  int32_t num_samples = 1;
  SpecState spec;
  bool in_batch = false;       // scheduled in the plan in flight
  bool abort_pending = false;  // aborted while in flight: released by postprocess

  int32_t num_tokens() const { return static_cast<int32_t>(tokens.size()); }
  int32_t num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
};

}  // namespace nanovllm
