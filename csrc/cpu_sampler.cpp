#include "cpu_sampler.h"

#include "cpu_math.h"
#include "cpu_parallel.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace nanovllm {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// exp(z) for z below this is under 1e-37: taken as exactly 0, so a masked (-inf) token can never
// be drawn (vec_exp clamps its input and would give it a tiny positive weight).
constexpr float kMinExponent = -85.0f;
// A top-p row without k first looks for its nucleus among its most likely kFirstCandidates tokens
// (LLM distributions put top_p's mass in a few dozen); a flat row that does not close it there
// selects it among the whole vocabulary (nucleus_select), without a sort.
constexpr int64_t kFirstCandidates = 64;
// Blocks the scans skip or sum as one vector pass.
constexpr int64_t kBlock = 64;
// Below n / kHeapFraction candidates a heap over the row (skipping blocks that cannot enter it) is
// cheaper than counting passes over all n (kth_largest).
constexpr int64_t kHeapFraction = 32;

[[gnu::always_inline]] inline float row_max(const float* x, int64_t n) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;  // std::max's form does not vectorize
  return m;
}

[[gnu::always_inline]] inline int64_t argmax(const float* x, int64_t n) {
  const float m = row_max(x, n);
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] == m) return i;
  }
  return 0;  // only NaNs
}

[[gnu::always_inline]] inline float weight(float logit, float best, float inv_t) {
  const float z = (logit - best) * inv_t;
  return z < kMinExponent ? 0.0f : vec_exp(z);
}

// A float's bits as a signed integer that orders as the floats do (-0 just below +0).
[[gnu::always_inline]] inline int32_t order_bits(float f) {
  const int32_t b = std::bit_cast<int32_t>(f);
  return b ^ ((b >> 31) & 0x7FFFFFFF);
}

// A candidate as one integer that orders as the candidates rank: more likely first, then the lower
// id (high half: order_bits, offset to unsigned; low half: ~id). Integer compares keep the
// selections and sorts below branch-light.
[[gnu::always_inline]] inline uint64_t rank_key(float logit, int64_t id) {
  const uint32_t bits = static_cast<uint32_t>(order_bits(logit)) ^ 0x80000000u;
  return (static_cast<uint64_t>(bits) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(id));
}

[[gnu::always_inline]] inline int64_t key_id(uint64_t key) { return 0xFFFFFFFFu - static_cast<uint32_t>(key); }

struct Weighted {
  uint64_t key;
  float weight;
};

struct Scratch {
  std::vector<uint64_t> candidates;
  std::vector<float> weights;
  std::vector<int32_t> bits;
  std::vector<Weighted> items;
};

// The k-th largest of bits[0, n) (1 <= k <= n) as a threshold: the k largest are the entries above
// it, then the first (k - above) equal to it. Bisection over the integers between the row's
// extremes, each step one vector counting pass; it stops early where exactly k entries are at or
// above the midpoint (then no ties need breaking).
struct Threshold {
  int32_t value;
  int64_t above;  // entries strictly greater than value
};

[[gnu::always_inline]] inline int32_t count_at_least(const int32_t* bits, int64_t n, int32_t t) {
  int32_t count = 0;  // 32-bit lanes: twice the width of a 64-bit count
#pragma omp simd reduction(+ : count)
  for (int64_t i = 0; i < n; ++i) count += bits[i] >= t ? 1 : 0;
  return count;
}

[[gnu::always_inline]] inline Threshold kth_largest(const int32_t* bits, int64_t n, int64_t k) {
  int32_t low = std::numeric_limits<int32_t>::max(), high = std::numeric_limits<int32_t>::min();
#pragma omp simd reduction(min : low) reduction(max : high)
  for (int64_t i = 0; i < n; ++i) {
    low = bits[i] < low ? bits[i] : low;
    high = bits[i] > high ? bits[i] : high;
  }
  // Invariant: count(>= lo) >= k, count(>= hi + 1) < k.
  int64_t lo = low, hi = high;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    const int32_t count = count_at_least(bits, n, static_cast<int32_t>(mid));
    if (count == k) return {static_cast<int32_t>(mid - 1), k};  // exactly the entries >= mid
    if (count > k) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return {static_cast<int32_t>(lo), count_at_least(bits, n, static_cast<int32_t>(lo) + 1)};
}

// The k most likely entries of x[0, n) as rank keys, best first, into s.candidates.
[[gnu::always_inline]] inline void top_candidates(const float* x, int64_t n, int64_t k, Scratch& s) {
  std::vector<uint64_t>& out = s.candidates;
  out.clear();
  const auto better = std::greater<uint64_t>();
  if (k * kHeapFraction >= n) {
    s.bits.resize(n);
    int32_t* bits = s.bits.data();
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) bits[i] = order_bits(x[i]);
    const Threshold t = kth_largest(bits, n, k);
    int64_t ties = k - t.above;  // entries equal to the threshold that still fit, lower ids first
    for (int64_t i = 0; i < n; ++i) {
      if (bits[i] > t.value || (bits[i] == t.value && ties-- > 0)) out.push_back(rank_key(x[i], i));
    }
    std::sort(out.begin(), out.end(), better);
    return;
  }
  for (int64_t i = 0; i < k; ++i) out.push_back(rank_key(x[i], i));
  std::make_heap(out.begin(), out.end(), better);  // front: the worst kept
  float worst = x[key_id(out.front())];
  for (int64_t b = k; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    // Ids only grow along the scan, so an entry as likely as the worst kept ranks after it.
    if (!(row_max(x + b, e - b) > worst)) continue;
    for (int64_t i = b; i < e; ++i) {
      if (!(x[i] > worst)) continue;
      std::pop_heap(out.begin(), out.end(), better);
      out.back() = rank_key(x[i], i);
      std::push_heap(out.begin(), out.end(), better);
      worst = x[key_id(out.front())];
    }
  }
  std::sort_heap(out.begin(), out.end(), better);
}

// Reorders items so that the nucleus comes first and returns its size: the items, in rank order,
// whose predecessors' weight is below `target` (the best item always). A quickselect on rank keys
// that carries the weight of what ranks before the range: expected O(n), no sort.
[[gnu::always_inline]] inline int64_t nucleus_select(std::vector<Weighted>& items, double target) {
  int64_t lo = 0, hi = static_cast<int64_t>(items.size());
  double before = 0.0;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    const uint64_t pivot = std::max(std::min(items[lo].key, items[mid].key),
                                    std::min(std::max(items[lo].key, items[mid].key), items[hi - 1].key));
    auto first = items.begin() + lo, last = items.begin() + hi;
    const auto split = std::partition(first, last, [pivot](const Weighted& w) { return w.key > pivot; });
    std::iter_swap(split, std::find_if(split, last, [pivot](const Weighted& w) { return w.key == pivot; }));
    const int64_t m = split - items.begin();
    double above = 0.0;
    for (int64_t i = lo; i < m; ++i) above += items[i].weight;
    if (before + above >= target && m > 0) {
      hi = m;  // the nucleus closes among the items above the pivot
    } else if (before + above + items[m].weight >= target) {
      return m + 1;  // the pivot closes it
    } else {
      before += above + items[m].weight;
      lo = m + 1;
    }
  }
  return lo;
}

[[gnu::always_inline]] inline double block_sum(const float* w, int64_t n) {
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += w[i];
  return sum;
}

// Index of the entry where the running sum of w[0, n) first exceeds u x their sum (w >= 0, some
// > 0), found a block at a time.
[[gnu::always_inline]] inline int64_t inverse_cdf(const float* w, int64_t n, double u) {
  const double target = u * block_sum(w, n);
  double running = 0.0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    const double block = block_sum(w + b, e - b);
    if (running + block <= target) {
      running += block;
      continue;
    }
    for (int64_t i = b; i < e; ++i) {
      running += w[i];
      if (w[i] > 0.0f && running > target) return i;
    }
  }
  // Rounding (block sums against the total) left u x total at or past the running sum: the last
  // token with a weight.
  for (int64_t i = n - 1; i > 0; --i) {
    if (w[i] > 0.0f) return i;
  }
  return 0;
}

// A row with neither top-k nor top-p: the whole vocabulary, in id order.
[[gnu::always_inline]] inline int64_t sample_plain(const float* x, int64_t V, float inv_t, float min_p, double u, Scratch& s) {
  const float best = row_max(x, V);
  if (!(best > kNegInf)) return argmax(x, V);
  s.weights.resize(V);
  float* w = s.weights.data();
  const float floor = std::max(min_p, 0.0f);  // the best token's weight is 1
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) {
    const float e = weight(x[i], best, inv_t);
    w[i] = e >= floor ? e : 0.0f;
  }
  return inverse_cdf(w, V, u);
}

// Of weights w[0, n), descending, the prefix whose predecessors weigh less than `target` (the first
// always), then min-p's cut (a suffix, as the weights descend): the count kept.
[[gnu::always_inline]] inline int64_t nucleus_prefix(const float* w, int64_t n, double target, float floor) {
  double before = 0.0;
  int64_t keep = 0;
  while (keep < n && (keep == 0 || before < target)) before += w[keep++];
  while (keep > 1 && w[keep - 1] < floor) --keep;
  return keep;
}

// A row with top-k and/or top-p, in vLLM's order: min-p's cut, the k best of what it kept, then
// their nucleus (top-p's mass measured against what min-p and k kept, or the whole row's).
[[gnu::always_inline]] inline int64_t sample_truncated(const float* x, int64_t V, float inv_t, int64_t k, float top_p,
                                                        float min_p, double u, Scratch& s) {
  const bool by_k = k > 0 && k < V;
  const float best = row_max(x, V);
  if (!(best > kNegInf)) return argmax(x, V);
  const float floor = std::max(min_p, 0.0f);  // the best token's weight is 1
  // A token's weight where min-p keeps it, else 0 (min-p keeps a prefix of the ranking, so the k
  // best of what it kept are the k best with the rest zeroed).
  const auto kept = [best, inv_t, floor](float logit) {
    const float e = weight(logit, best, inv_t);
    return e >= floor ? e : 0.0f;
  };
  double mass_total = 0.0;
  if (!by_k) {
#pragma omp simd reduction(+ : mass_total)
    for (int64_t i = 0; i < V; ++i) mass_total += kept(x[i]);
  }
  const int64_t size = by_k ? k : std::min(V, kFirstCandidates);
  top_candidates(x, V, size, s);
  s.weights.resize(size);
  float* w = s.weights.data();
  for (int64_t j = 0; j < size; ++j) w[j] = kept(x[key_id(s.candidates[j])]);
  if (by_k) mass_total = block_sum(w, size);
  const double target = top_p < 1.0f ? static_cast<double>(top_p) * mass_total : mass_total * 2.0;  // 2x: all
  const int64_t keep = nucleus_prefix(w, size, target, floor);
  // Done with k, with the whole row, or when the nucleus closed among the candidates (the sum is
  // taken only for a top-p row whose candidates were all kept).
  if (by_k || size == V || keep < size || block_sum(w, size) >= target) {
    return key_id(s.candidates[inverse_cdf(w, keep, u)]);
  }
  // A flat row: its nucleus is not among the first candidates; select it among all tokens.
  s.items.resize(V);
  for (int64_t i = 0; i < V; ++i) s.items[i] = {rank_key(x[i], i), kept(x[i])};
  const int64_t n = nucleus_select(s.items, target);
  s.weights.resize(n);
  w = s.weights.data();
  for (int64_t j = 0; j < n; ++j) w[j] = s.items[j].weight;
  return key_id(s.items[inverse_cdf(w, n, u)].key);
}

NANOVLLM_CLONES void sample_rows(const SampleArgs& a, int64_t begin, int64_t end) {
  const LogitRows& L = a.logits;
  Scratch s;
  for (int64_t r = begin; r < end; ++r) {
    const float* x = L.data + r * L.stride;
    const float t = a.temperature[r];
    if (!(t > kGreedyTemperature)) {
      a.out[r] = argmax(x, L.vocab);
      continue;
    }
    const bool truncated = (a.top_k[r] > 0 && a.top_k[r] < L.vocab) || a.top_p[r] < 1.0f;
    a.out[r] = truncated ? sample_truncated(x, L.vocab, 1.0f / t, a.top_k[r], a.top_p[r], a.min_p[r], a.uniform[r], s)
                         : sample_plain(x, L.vocab, 1.0f / t, a.min_p[r], a.uniform[r], s);
  }
}

NANOVLLM_CLONES void greedy_rows(const LogitRows& L, int64_t* out, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) out[r] = argmax(L.data + r * L.stride, L.vocab);
}

NANOVLLM_CLONES void logprob_rows(const LogprobArgs& a, int64_t begin, int64_t end) {
  const LogitRows& L = a.logits;
  Scratch s;
  for (int64_t r = begin; r < end; ++r) {
    const float* x = L.data + r * L.stride;
    const float best = row_max(x, L.vocab);
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < L.vocab; ++i) sum += weight(x[i], best, 1.0f);
    const double lse = static_cast<double>(best) + std::log(sum);
    const float chosen = x[a.chosen[r]];
    int64_t above = 0;
#pragma omp simd reduction(+ : above)
    for (int64_t i = 0; i < L.vocab; ++i) above += x[i] > chosen ? 1 : 0;
    a.chosen_logprob[r] = static_cast<double>(chosen) - lse;
    a.chosen_rank[r] = above + 1;
    if (a.k == 0) continue;
    top_candidates(x, L.vocab, a.k, s);
    for (int64_t j = 0; j < a.k; ++j) {
      const int64_t id = key_id(s.candidates[j]);
      a.top_ids[r * a.k + j] = id;
      a.top_logprobs[r * a.k + j] = static_cast<double>(x[id]) - lse;
    }
  }
}

NANOVLLM_CLONES void penalty_rows(const PenaltyArgs& a, int64_t begin, int64_t end) {
  const int64_t V = a.vocab;
  for (int64_t r = begin; r < end; ++r) {
    float* x = a.logits + a.logit_rows[r] * a.stride;
    const float* prompt = a.seen + a.slots[r] * 2 * V;
    const float* counts = prompt + V;
    const float rep = a.repetition[r], freq = a.frequency[r], pres = a.presence[r];
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) {
      const bool in_output = counts[i] > 0.0f;
      float v = x[i];
      if (in_output || prompt[i] > 0.0f) v = v > 0.0f ? v / rep : v * rep;
      x[i] = v - freq * counts[i] - (in_output ? pres : 0.0f);
    }
  }
}

}  // namespace

void sample(const SampleArgs& a, int num_threads) {
  parallel_rows(a.logits.rows, a.logits.vocab, num_threads, [&a](int64_t b, int64_t e) { sample_rows(a, b, e); });
}

void argmax_rows(const LogitRows& logits, int64_t* out, int num_threads) {
  parallel_rows(logits.rows, logits.vocab, num_threads,
                [&logits, out](int64_t b, int64_t e) { greedy_rows(logits, out, b, e); });
}

void logprobs(const LogprobArgs& a, int num_threads) {
  parallel_rows(a.logits.rows, a.logits.vocab, num_threads, [&a](int64_t b, int64_t e) { logprob_rows(a, b, e); });
}

void apply_penalties(const PenaltyArgs& a, int num_threads) {
  parallel_rows(a.rows, a.vocab, num_threads, [&a](int64_t b, int64_t e) { penalty_rows(a, b, e); });
}

}  // namespace nanovllm
