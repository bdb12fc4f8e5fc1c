#include "xxhash64.h"

#include <bit>
#include <cstring>
#include <vector>

namespace nanovllm {
namespace {

constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kPrime3 = 0x165667B19E3779F9ULL;
constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t kPrime5 = 0x27D4EB2F165667C5ULL;

static_assert(std::endian::native == std::endian::little,
              "the chained block hash is defined over little-endian bytes");

inline uint64_t read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline uint32_t read32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline uint64_t round(uint64_t acc, uint64_t lane) {
  acc += lane * kPrime2;
  acc = std::rotl(acc, 31);
  return acc * kPrime1;
}

inline uint64_t merge_accumulator(uint64_t acc, uint64_t lane_acc) {
  acc ^= round(0, lane_acc);
  return acc * kPrime1 + kPrime4;
}

inline uint64_t avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime2;
  h ^= h >> 29;
  h *= kPrime3;
  h ^= h >> 32;
  return h;
}

}  // namespace

uint64_t xxh64(std::span<const uint8_t> data, uint64_t seed) {
  const uint8_t* p = data.data();
  const size_t len = data.size();
  const uint8_t* const end = p + len;
  uint64_t h;

  if (len >= 32) {
    uint64_t v1 = seed + kPrime1 + kPrime2;
    uint64_t v2 = seed + kPrime2;
    uint64_t v3 = seed;
    uint64_t v4 = seed - kPrime1;
    const uint8_t* const limit = end - 32;
    do {
      v1 = round(v1, read64(p));
      v2 = round(v2, read64(p + 8));
      v3 = round(v3, read64(p + 16));
      v4 = round(v4, read64(p + 24));
      p += 32;
    } while (p <= limit);
    h = std::rotl(v1, 1) + std::rotl(v2, 7) + std::rotl(v3, 12) + std::rotl(v4, 18);
    h = merge_accumulator(h, v1);
    h = merge_accumulator(h, v2);
    h = merge_accumulator(h, v3);
    h = merge_accumulator(h, v4);
  } else {
    h = seed + kPrime5;
  }

  h += static_cast<uint64_t>(len);

  while (p + 8 <= end) {
    h ^= round(0, read64(p));
    h = std::rotl(h, 27) * kPrime1 + kPrime4;
    p += 8;
  }
  if (p + 4 <= end) {
    h ^= static_cast<uint64_t>(read32(p)) * kPrime1;
    h = std::rotl(h, 23) * kPrime2 + kPrime3;
    p += 4;
  }
  while (p < end) {
    h ^= static_cast<uint64_t>(*p) * kPrime5;
    h = std::rotl(h, 11) * kPrime1;
    ++p;
  }
  return avalanche(h);
}

uint64_t hash_block_tokens(bool has_parent, uint64_t parent, std::span<const int32_t> tokens) {
  // Widening to int64 needs a scratch buffer; blocks are small, so keep it on the stack.
  constexpr size_t kStackTokens = 256;
  const size_t n_bytes = 8 * (tokens.size() + (has_parent ? 1 : 0));
  uint8_t stack_buf[8 * (kStackTokens + 1)];
  std::vector<uint8_t> heap_buf;
  uint8_t* buf = stack_buf;
  if (tokens.size() > kStackTokens) {
    heap_buf.resize(n_bytes);
    buf = heap_buf.data();
  }
  uint8_t* out = buf;
  if (has_parent) {
    std::memcpy(out, &parent, 8);
    out += 8;
  }
  for (const int32_t t : tokens) {
    const int64_t wide = t;
    std::memcpy(out, &wide, 8);
    out += 8;
  }
  return xxh64({buf, n_bytes});
}

}  // namespace nanovllm
