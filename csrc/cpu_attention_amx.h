// Prefill tiles of paged attention on AMX tiles (csrc/cpu_attention_amx.cpp), taken by
// paged_attention (csrc/cpu_attention.cpp) for its tasks of many query vectors.
#pragma once

#include <cstdint>

#include "cpu_attention.h"

namespace nanovllm {

// Whether attend_rows_amx runs this call: bf16 caches, head_dim a multiple of 64, and a CPU and
// process with AMX tiles (and AVX-512 with BF16 for the softmax between them).
bool attention_amx_takes(const PagedAttentionArgs& a);

// Query rows [row_begin, row_end) of sequence `seq` for the query heads of KV heads [head_begin,
// head_end), each seeing all of its keys: their output rows written, as the vector path writes them
// up to bf16 rounding of the softmax weights.
void attend_rows_amx(const PagedAttentionArgs& a, int32_t seq, int32_t head_begin, int32_t head_end,
                     int32_t row_begin, int32_t row_end);

}  // namespace nanovllm
