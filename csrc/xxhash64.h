// XXH64, written from the xxHash specification (doc/xxhash_spec.md, "XXH64 Algorithm").
// Bit-exact with the reference implementation for any input and seed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace nanovllm {

uint64_t xxh64(std::span<const uint8_t> data, uint64_t seed = 0);

// One link of the prefix-cache chain (docs/design.md, "Core semantics", prefix hashing):
// XXH64(parent as 8 little-endian bytes || each token id as int64 little-endian), seed 0.
// `has_parent == false` for a sequence's first block, which hashes its tokens alone.
uint64_t hash_block_tokens(bool has_parent, uint64_t parent, std::span<const int32_t> tokens);

}  // namespace nanovllm
