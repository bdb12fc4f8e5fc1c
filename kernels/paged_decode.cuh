// Paged attention for decodes: one query token per sequence over its paged K/V.
//
// Work split. One CTA (128 threads) per (sequence, KV head, partition): it serves every query head
// of that KV head's GQA group (up to kMaxGroup of them; a larger group is split over several
// CTAs), so each K/V element is read from HBM once per group, not once per query head. Decode is
// bandwidth-bound, so everything below is organized around keeping HBM busy:
//
// - The context is walked in tiles of kTile tokens. A tile's K and V rows are copied into shared
//   memory with cp.async (16 bytes per thread per copy, consecutive threads on consecutive bytes
//   of one token's row: fully coalesced), double-buffered: tile i+1 is in flight while tile i is
//   computed, so the memory system always has the next tile's requests queued.
// - Scores: thread (token t, split j) dots q with the j-th slice of K row t for all heads of the
//   group (q sits in shared memory, pre-scaled by scale*log2(e), read as broadcasts). The splits'
//   partial sums meet in shared memory. Rows are padded by 16 bytes so that the 8 lanes of each
//   16-byte shared-memory phase hit distinct banks.
// - Online softmax per head (one warp per head): running max and denominator, exp2 domain.
// - P.V: thread (group r, chunk c) owns 16 bytes of the output row for every head and accumulates
//   over the tile's tokens r, r+kGroups, ...; the groups' accumulators are summed once, at the end.
//
// Split-KV. With few sequences the (sequence, KV head) grid cannot fill the GPU, so the context is
// also split into `num_partitions` ranges, each CTA writing an unnormalized partial output plus its
// running max and denominator; a second kernel combines them. The number of partitions is a launch
// parameter, but each sequence's range length is computed here from its own context length
// (ceil(ctx / partitions), rounded to whole tiles). That keeps the grid independent of the step's
// context lengths, which is what lets one CUDA graph serve every decode step of a batch size.
//
// Everything accumulates in fp32; q.k and p.v use the cache dtype only for storage.
#pragma once

#include <cfloat>

#include "common.cuh"
#include "launchers.h"

namespace nanovllm {

constexpr int kDecodeThreads = 128;
constexpr int kMaxGroup = 8;         // query heads per CTA at most
constexpr int kMaxPartitions = 256;  // split-KV: partitions per sequence at most

// Heads per CTA as compiled: the group size rounded up to 1, 2, 4 or 8, so the accumulators
// (kGroupCap x 16 bytes' worth of fp32 per thread) are no larger than the model needs; they set the
// register count and therefore how many CTAs (bytes in flight) an SM holds.
inline int group_cap(int group_size) { return group_size <= 1 ? 1 : group_size <= 2 ? 2 : group_size <= 4 ? 4 : 8; }

template <typename T, int D, int kGroupCap>
struct DecodeConfig {
  static constexpr int kThreads = kDecodeThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kVec = Vec16<T>::kSize;  // elements per 16-byte access
  static constexpr int kChunks = D / kVec;      // 16-byte chunks per K/V row
  // Tokens per tile: at least one warp's worth (the softmax maps tokens to lanes), and enough that
  // every thread has at least one 16-byte chunk of q.k work.
  static constexpr int kTile = (kThreads * kVec / D) > 32 ? (kThreads * kVec / D) : 32;
  static constexpr int kSplits = kThreads / kTile;           // threads sharing one token's q.k
  static constexpr int kSliceChunks = kChunks / kSplits;     // chunks of K each of them reads
  static constexpr int kGroups = kThreads / kChunks;         // P.V token groups
  static constexpr int kRow = D + kVec;                      // padded shared row, elements
  static constexpr int kStages = 2;
  static constexpr int kLoadIters = kTile * kChunks / kThreads;  // cp.async per thread per K tile

  static_assert(D % kVec == 0, "head_dim must be a whole number of 16-byte vectors");
  static_assert(kThreads % kTile == 0 && kSplits >= 1 && kSliceChunks >= 1, "bad q.k split");
  static_assert(kThreads % kChunks == 0 && kGroups >= 1, "bad P.V split");
  static_assert(kTile % 32 == 0 && kTile <= 64, "softmax handles one or two tokens per lane");
  static_assert((kTile * kChunks) % kThreads == 0, "tile load must split evenly");

  // Shared memory layout, in bytes from the (16-byte aligned) base.
  static constexpr int kQBytes = kGroupCap * D * 4;
  static constexpr int kKVBytes = kStages * 2 * kTile * kRow * static_cast<int>(sizeof(T));
  static constexpr int kRedBytes = kGroups * kGroupCap * D * 4;  // end-of-CTA reduction, aliases K/V
  static constexpr int kKVRegion = kKVBytes > kRedBytes ? kKVBytes : kRedBytes;
  static constexpr int kSPartBytes = kSplits * kGroupCap * kTile * 4;
  static constexpr int kPBytes = kGroupCap * kTile * 4;
  static constexpr int kStatBytes = 3 * kMaxGroup * 4;

  static constexpr int kQOff = 0;
  static constexpr int kKVOff = kQOff + kQBytes;
  static constexpr int kSPartOff = kKVOff + kKVRegion;
  static constexpr int kPOff = kSPartOff + kSPartBytes;
  static constexpr int kStatOff = kPOff + kPBytes;
  static constexpr int kSmemBytes = kStatOff + kStatBytes;
  static_assert(kKVOff % 16 == 0 && kSPartOff % 16 == 0, "16-byte aligned regions");
  // sm_90's opt-in maximum per block (227 KiB): a configuration over it would only fail at launch.
  static_assert(kSmemBytes <= 227 * 1024, "shared memory over the per-block limit");
};

template <typename T, int D, int kGroupCap>
__global__ void __launch_bounds__(kDecodeThreads)
    paged_decode_kernel(const DecodeParams p) {
  using C = DecodeConfig<T, D, kGroupCap>;
  NANOVLLM_DYNAMIC_SMEM(smem);
  float* q_s = reinterpret_cast<float*>(smem + C::kQOff);        // [kGroupCap][D]
  T* kv_s = reinterpret_cast<T*>(smem + C::kKVOff);              // [stage][K|V][kTile][kRow]
  float* s_part = reinterpret_cast<float*>(smem + C::kSPartOff);  // [kSplits][kGroupCap][kTile]
  float* p_s = reinterpret_cast<float*>(smem + C::kPOff);        // [kGroupCap][kTile]
  float* m_s = reinterpret_cast<float*>(smem + C::kStatOff);     // running max (log2 domain)
  float* l_s = m_s + kGroupCap;                                  // running denominator
  float* a_s = l_s + kGroupCap;                                  // this tile's rescale factor

  const int tid = threadIdx.x;
  const int seq = blockIdx.y;
  const int group_size = p.num_heads / p.num_kv_heads;
  const int head_chunks = ceil_div(group_size, kGroupCap);
  const int kv_head = blockIdx.x / head_chunks;
  const int g0 = (blockIdx.x - kv_head * head_chunks) * kGroupCap;
  const int G = min(kGroupCap, group_size - g0);  // query heads of this CTA
  const int head0 = kv_head * group_size + g0;
  const int num_parts = p.num_partitions;
  const int part = blockIdx.z;

  const int ctx = p.context_lens[seq];
  // This CTA's token range: partitions of whole tiles, sized from this sequence's own length.
  const int per_part = ceil_div(ceil_div(max(ctx, 0), num_parts), C::kTile) * C::kTile;
  const int start = part * per_part;
  const int end = min(ctx, start + per_part);

  T* out = static_cast<T*>(p.out);
  if (start >= end) {
    // Nothing to attend to: a zero-length context (CUDA-graph padding rows) or a partition past
    // the end of a short context. Uniform per CTA, so returning early is safe.
    if (num_parts == 1) {
      for (int i = tid; i < G * D; i += C::kThreads) {
        const int g = i / D, d = i - (i / D) * D;
        out[seq * p.o_stride_token + (head0 + g) * p.o_stride_head + d] = from_float<T>(0.f);
      }
    } else if (tid < G) {
      const int64_t idx = (static_cast<int64_t>(seq) * p.num_heads + head0 + tid) * num_parts + part;
      p.partial_max[idx] = -FLT_MAX;
      p.partial_sum[idx] = 0.f;  // marks the partition empty for the reduction
    }
    return;
  }

  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const int32_t* bt_row = p.block_tables + seq * p.block_table_stride;
  const int64_t k_head = kv_head * p.k_stride_head;
  const int64_t v_head = kv_head * p.v_stride_head;

  auto load_tile = [&](int tile, int stage) {
    T* k_dst = kv_s + stage * 2 * C::kTile * C::kRow;
    T* v_dst = k_dst + C::kTile * C::kRow;
    const int tile_start = start + tile * C::kTile;
#pragma unroll
    for (int it = 0; it < C::kLoadIters; ++it) {
      const int i = tid + it * C::kThreads;
      const int t = i / C::kChunks;
      const int c = i - t * C::kChunks;
      const int pos = tile_start + t;
      const T* k_src = k_cache;  // any valid address: a 0-byte copy reads nothing
      const T* v_src = v_cache;
      int bytes = 0;
      if (pos < end) {
        const int64_t block = bt_row[pos / p.block_size];
        const int64_t off = pos - (pos / p.block_size) * p.block_size;
        k_src = k_cache + block * p.k_stride_block + off * p.k_stride_slot + k_head + c * C::kVec;
        v_src = v_cache + block * p.v_stride_block + off * p.v_stride_slot + v_head + c * C::kVec;
        bytes = 16;
      }
      cp_async_16(k_dst + t * C::kRow + c * C::kVec, k_src, bytes);
      cp_async_16(v_dst + t * C::kRow + c * C::kVec, v_src, bytes);
    }
  };

  const int num_tiles = ceil_div(end - start, C::kTile);
  // The first tile's copies go out before q is read, so its block-table lookup and HBM latency
  // overlap the q loads instead of following them (q_s is first read after the loop's barrier).
  load_tile(0, 0);
  cp_async_commit();

  // q for the CTA's heads, pre-scaled so that q.k lands directly in the exp2 domain.
  const float qscale = p.scale * 1.4426950408889634f;  // log2(e)
  const T* query = static_cast<const T*>(p.query);
  for (int i = tid; i < kGroupCap * D; i += C::kThreads) {
    const int g = i / D, d = i - (i / D) * D;
    q_s[i] = g < G ? load_float(query + seq * p.q_stride_token + (head0 + g) * p.q_stride_head + d) * qscale : 0.f;
  }
  if (tid < kGroupCap) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.f;
  }

  float acc[kGroupCap][C::kVec];
#pragma unroll
  for (int g = 0; g < kGroupCap; ++g) {
#pragma unroll
    for (int e = 0; e < C::kVec; ++e) acc[g][e] = 0.f;
  }

  const int warp = tid / 32, lane = tid % 32;
  const int qk_t = tid % C::kTile, qk_split = tid / C::kTile;
  const int pv_c = tid % C::kChunks, pv_group = tid / C::kChunks;

  for (int tile = 0; tile < num_tiles; ++tile) {
    if (tile + 1 < num_tiles) load_tile(tile + 1, (tile + 1) % C::kStages);
    cp_async_commit();  // possibly empty: keeps "all but the newest group" meaning "this tile"
    cp_async_wait<1>();
    __syncthreads();

    const T* k_tile = kv_s + (tile % C::kStages) * 2 * C::kTile * C::kRow;
    const T* v_tile = k_tile + C::kTile * C::kRow;
    const int valid = min(C::kTile, end - (start + tile * C::kTile));

    // Scores: partial dot products of one K row slice with every head's q.
    {
      float part_s[kGroupCap];
#pragma unroll
      for (int g = 0; g < kGroupCap; ++g) part_s[g] = 0.f;
      const T* krow = k_tile + qk_t * C::kRow + qk_split * C::kSliceChunks * C::kVec;
      const float* qcol = q_s + qk_split * C::kSliceChunks * C::kVec;
#pragma unroll
      for (int c = 0; c < C::kSliceChunks; ++c) {
        float kf[C::kVec];
        to_float(*reinterpret_cast<const uint4*>(krow + c * C::kVec), kf, T());
#pragma unroll
        for (int g = 0; g < kGroupCap; ++g) {
          if (g < G) {
#pragma unroll
            for (int e = 0; e < C::kVec; ++e) part_s[g] = fmaf(qcol[g * D + c * C::kVec + e], kf[e], part_s[g]);
          }
        }
      }
#pragma unroll
      for (int g = 0; g < kGroupCap; ++g) {
        if (g < G) s_part[(qk_split * kGroupCap + g) * C::kTile + qk_t] = part_s[g];
      }
    }
    __syncthreads();

    // Online softmax, one warp per head.
    for (int g = warp; g < G; g += C::kWarps) {
      constexpr int kPerLane = C::kTile / 32;
      float s[kPerLane];
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int t = lane + 32 * j;
        float v = 0.f;
#pragma unroll
        for (int sp = 0; sp < C::kSplits; ++sp) v += s_part[(sp * kGroupCap + g) * C::kTile + t];
        s[j] = t < valid ? v : -INFINITY;
        tile_max = fmaxf(tile_max, s[j]);
      }
      tile_max = warp_max(tile_max);  // finite: every tile has at least one valid token
      const float m_old = m_s[g];
      const float m_new = fmaxf(m_old, tile_max);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const float pr = exp2f(s[j] - m_new);  // exp2(-inf) = 0 for masked tokens
        p_s[g * C::kTile + lane + 32 * j] = pr;
        sum += pr;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_new);  // 0 on the first tile (m_old = -inf)
        l_s[g] = l_s[g] * alpha + sum;
        m_s[g] = m_new;
        a_s[g] = alpha;
      }
    }
    __syncthreads();

    // P.V into per-thread accumulators (rescaled to the new running max first).
#pragma unroll
    for (int g = 0; g < kGroupCap; ++g) {
      if (g < G) {
        const float alpha = a_s[g];
#pragma unroll
        for (int e = 0; e < C::kVec; ++e) acc[g][e] *= alpha;
      }
    }
    for (int t = pv_group; t < valid; t += C::kGroups) {
      float vf[C::kVec];
      to_float(*reinterpret_cast<const uint4*>(v_tile + t * C::kRow + pv_c * C::kVec), vf, T());
#pragma unroll
      for (int g = 0; g < kGroupCap; ++g) {
        if (g < G) {
          const float pr = p_s[g * C::kTile + t];
#pragma unroll
          for (int e = 0; e < C::kVec; ++e) acc[g][e] = fmaf(pr, vf[e], acc[g][e]);
        }
      }
    }
    __syncthreads();  // the next iteration's cp.async overwrites this stage
  }

  // Sum the token groups' accumulators (the K/V buffers are free now) and write out.
  cp_async_wait<0>();
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem + C::kKVOff);  // [kGroups][kGroupCap][D]
#pragma unroll
  for (int g = 0; g < kGroupCap; ++g) {
    if (g < G) {
      float* dst = red + (pv_group * kGroupCap + g) * D + pv_c * C::kVec;
#pragma unroll
      for (int e = 0; e < C::kVec; e += 4) {
        *reinterpret_cast<float4*>(dst + e) = make_float4(acc[g][e], acc[g][e + 1], acc[g][e + 2], acc[g][e + 3]);
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < G * D; i += C::kThreads) {
    const int g = i / D, d = i - (i / D) * D;
    float o = 0.f;
#pragma unroll 8
    for (int r = 0; r < C::kGroups; ++r) o += red[(r * kGroupCap + g) * D + d];
    if (num_parts == 1) {
      out[seq * p.o_stride_token + (head0 + g) * p.o_stride_head + d] = from_float<T>(o / l_s[g]);
    } else {
      const int64_t idx = (static_cast<int64_t>(seq) * p.num_heads + head0 + g) * num_parts + part;
      p.partial_out[idx * D + d] = o;
      if (d == 0) {
        p.partial_max[idx] = m_s[g];
        p.partial_sum[idx] = l_s[g];
      }
    }
  }
}

// Grid of the decode kernel: x = (KV head, head chunk), y = sequence, z = partition. The KV head
// varies fastest so that CTAs running side by side read the heads of the same tokens, which sit
// next to each other in the cache ([block, slot, kv_head, head_dim]): whole DRAM rows, not 256-byte
// pieces of many. y is limited to 65535 sequences per launch (checked by the launcher).
inline dim3 decode_grid(const DecodeParams& p, int group_cap) {
  const int chunks = ceil_div(p.num_heads / p.num_kv_heads, group_cap);
  return dim3{static_cast<unsigned>(p.num_kv_heads * chunks), static_cast<unsigned>(p.num_seqs),
              static_cast<unsigned>(p.num_partitions)};
}

// Grid of the split-KV reduction: x = query head, y = sequence.
inline dim3 reduce_grid(const DecodeParams& p) {
  return dim3{static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.num_seqs), 1};
}

// Split-KV combine: out = sum_p acc_p * 2^(m_p - M) / sum_p l_p * 2^(m_p - M), empty partitions
// (l_p = 0) skipped, so their never-written partial outputs are never read. The partitions' stats
// are reduced by all threads (one partition per thread and pass): under CUDA graphs the partition
// count is sized for the longest possible context, so a serial pass would cost every short step.
constexpr int kReduceThreads = 128;

// The block-wide max (Max) or sum of one value per thread; every thread gets the result.
template <bool Max>
__device__ __forceinline__ float block_reduce(float x, float* scratch) {
  constexpr int kWarps = kReduceThreads / 32;
  x = Max ? warp_max(x) : warp_sum(x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = Max ? fmaxf(r, scratch[w]) : r + scratch[w];
  __syncthreads();  // scratch is reused by the next reduction
  return r;
}

template <typename T>
__global__ void __launch_bounds__(kReduceThreads)
    split_kv_reduce_kernel(const DecodeParams p) {
  __shared__ float w_s[kMaxPartitions];
  __shared__ float scratch[kReduceThreads / 32];
  const int head = blockIdx.x, seq = blockIdx.y;
  const int P = p.num_partitions, D = p.head_dim;
  const int64_t base = (static_cast<int64_t>(seq) * p.num_heads + head) * P;
  float m = -INFINITY;
  for (int i = threadIdx.x; i < P; i += kReduceThreads) {
    if (p.partial_sum[base + i] > 0.f) m = fmaxf(m, p.partial_max[base + i]);
  }
  const float M = block_reduce<true>(m, scratch);
  float l_acc = 0.f;
  for (int i = threadIdx.x; i < P; i += kReduceThreads) {
    const float l = p.partial_sum[base + i];
    const float w = l > 0.f ? exp2f(p.partial_max[base + i] - M) : 0.f;  // l > 0 implies M finite
    w_s[i] = w;
    l_acc += l * w;
  }
  const float L = block_reduce<false>(l_acc, scratch);  // its barriers also publish w_s
  const float inv = L > 0.f ? 1.f / L : 0.f;          // L = 0: empty context, output zeros
  T* out = static_cast<T*>(p.out);
  for (int d = threadIdx.x; d < D; d += kReduceThreads) {
    float o = 0.f;
    for (int i = 0; i < P; ++i) {
      const float w = w_s[i];
      if (w != 0.f) o = fmaf(w, p.partial_out[(base + i) * D + d], o);
    }
    out[seq * p.o_stride_token + head * p.o_stride_head + d] = from_float<T>(o * inv);
  }
}

#ifndef NANOVLLM_KERNEL_EMULATION  // the emulator launches the kernels itself

// Opting in to more than 48 KiB of dynamic shared memory is per function and per device, so the
// "already done" flags must be per kernel instantiation: templated on the kernel's parameters, not
// on its type (every paged_decode_kernel<T, D, G> has the same type, void (*)(DecodeParams)).
template <typename T, int D, int kGroupCap, typename Kernel>
int ensure_smem(Kernel kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  constexpr int kMaxDevices = 64;
  static int configured[kMaxDevices] = {};  // benign race: setting the attribute twice is harmless
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kMaxDevices && configured[dev]) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && dev >= 0 && dev < kMaxDevices) configured[dev] = 1;
  return err;
}

template <typename T, int D, int kGroupCap>
int launch_decode_typed(const DecodeParams& p, cudaStream_t stream) {
  using C = DecodeConfig<T, D, kGroupCap>;
  int err = ensure_smem<T, D, kGroupCap>(paged_decode_kernel<T, D, kGroupCap>, C::kSmemBytes);
  if (err != cudaSuccess) return err;
  paged_decode_kernel<T, D, kGroupCap><<<decode_grid(p, kGroupCap), C::kThreads, C::kSmemBytes, stream>>>(p);
  err = static_cast<int>(cudaGetLastError());
  if (err != cudaSuccess) return err;  // don't queue the reduction over a workspace nobody wrote
  if (p.num_partitions > 1) {
    split_kv_reduce_kernel<T><<<reduce_grid(p), kReduceThreads, 0, stream>>>(p);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int D>
int launch_decode_group(const DecodeParams& p, cudaStream_t stream) {
  switch (group_cap(p.num_heads / p.num_kv_heads)) {
    case 1: return launch_decode_typed<T, D, 1>(p, stream);
    case 2: return launch_decode_typed<T, D, 2>(p, stream);
    case 4: return launch_decode_typed<T, D, 4>(p, stream);
    default: return launch_decode_typed<T, D, 8>(p, stream);
  }
}

template <typename T>
int launch_decode_dtype(const DecodeParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 16: return launch_decode_group<T, 16>(p, stream);
    case 32: return launch_decode_group<T, 32>(p, stream);
    case 64: return launch_decode_group<T, 64>(p, stream);
    case 128: return launch_decode_group<T, 128>(p, stream);
    case 256: return launch_decode_group<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

// One translation unit per dtype (paged_decode_{f32,f16,bf16}.cu) so the build compiles them in
// parallel.
int launch_paged_decode_f32(const DecodeParams& p, cudaStream_t stream);
int launch_paged_decode_f16(const DecodeParams& p, cudaStream_t stream);
int launch_paged_decode_bf16(const DecodeParams& p, cudaStream_t stream);

#endif  // NANOVLLM_KERNEL_EMULATION

}  // namespace nanovllm
