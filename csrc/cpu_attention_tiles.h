// The attention kernel's tile path (eight keys' scores at a time, softmax, values summed in
// registers), written once over an instruction-set type `Isa` and included by
// csrc/cpu_attention.cpp once per instruction set, each time inside that set's namespace and
// `#pragma GCC target` region, so every function here is compiled for it. Deliberately no include
// guard.
//
// Isa provides: scores<T>(nv, q, k, kv_row, D, out, out_stride) (nv <= 2 scaled fp32 query vectors, D
// apart, against eight keys kv_row apart, one row of `out` each), scores_bf16(q, k, kv_row, D, scale,
// out) (one bf16 vector as stored, the AVX512-BF16 dot products) and weighted_rows<T>(nv, ...) (nv <= 4
// vectors' scores times a block's value rows, added to their accumulators).

// Scores, softmax and weighted values of one task: the same results as attend_task's portable loops
// up to fp32 rounding. qf holds the task's V scaled query vectors, sc is [V, stride] with stride >=
// L rounded up to 8, acc [V, D] zeros. qb, when not null, holds the same vectors unscaled in bf16
// instead (qf is then not filled), and the scores take Isa::scores_bf16.
template <typename T>
void attend_tiles(const PagedAttentionArgs& a, const int32_t* table, int64_t head_off, int heads, int per_head,
                  int base, int64_t L, int64_t stride, const float* qf, const Bf16* qb, float* sc, float* acc) {
  const int group = a.num_heads / a.num_kv_heads;
  const int D = a.head_dim;
  const int bs = a.block_size;
  const int V = heads * per_head;
  const int64_t kv_row = static_cast<int64_t>(a.num_kv_heads) * D;
  const T* k_cache = static_cast<const T*>(a.k_cache) + head_off;
  // Eight keys at a time (bs % 8 == 0: never across blocks). Past L, the last chunk reads rows of
  // its block that this sequence has not written: their scores land past L and are never used.
  const int64_t ahead = kPrefetchBlocks * bs;
  for (int64_t r = 0; r < ahead; r += 8) prefetch_rows<T>(a, table, r, 8, L, head_off, heads, a.k_cache);
  for (int64_t t0 = 0; t0 < L; t0 += 8) {
    prefetch_rows<T>(a, table, t0 + ahead, 8, L, head_off, heads, a.k_cache);
    const T* k = k_cache + (static_cast<int64_t>(table[t0 / bs]) * bs + t0 % bs) * kv_row;
    const int first = static_cast<int>(std::max<int64_t>(0, t0 - base)) * group;  // vectors that see key t0
    for (int h = 0; h < heads; ++h) {
      const T* kh = k + static_cast<int64_t>(h) * D;
      const int end = (h + 1) * per_head;
      if constexpr (std::is_same_v<T, Bf16>) {
        if (qb != nullptr) {
          for (int v = h * per_head + first; v < end; ++v) {
            Isa::scores_bf16(qb + static_cast<int64_t>(v) * D, kh, kv_row, D, a.scale, sc + v * stride + t0);
          }
          continue;
        }
      }
      for (int v = h * per_head + first; v < end; v += 2) {
        Isa::scores(std::min(2, end - v), qf + static_cast<int64_t>(v) * D, kh, kv_row, D, sc + v * stride + t0,
                    stride);
      }
    }
  }
  softmax_visible(sc, stride, V, per_head, group, base, L);
  // Values a block at a time: each head's vectors, four at a time, add up the block's rows in
  // registers (the portable loop loaded and stored every accumulator once per key). A vector's
  // scores past the keys it sees are 0 (softmax_visible), so every vector takes every key of the
  // pass. The block was asked for ahead (all of its task's heads), so walking it head by head reads
  // from cache.
  const T* v_cache = static_cast<const T*>(a.v_cache) + head_off;
  for (int64_t r = 0; r < ahead; r += 8) prefetch_rows<T>(a, table, r, 8, L, head_off, heads, a.v_cache);
  const int share = (bs + heads - 1) / heads;  // rows of the block `ahead` on that each head's turn asks for
  for (int64_t t0 = 0; t0 < L; t0 += bs) {
    const T* x = v_cache + static_cast<int64_t>(table[t0 / bs]) * bs * kv_row;
    const int n = static_cast<int>(std::min<int64_t>(bs, L - t0));
    for (int h = 0; h < heads; ++h) {
      if (h * share < bs) {
        prefetch_rows<T>(a, table, t0 + ahead + h * share, std::min(share, bs - h * share), L, head_off, heads,
                         a.v_cache);
      }
      for (int v = h * per_head; v < (h + 1) * per_head; v += 4) {
        Isa::weighted_rows(std::min(4, (h + 1) * per_head - v), sc + v * stride + t0, stride,
                           x + static_cast<int64_t>(h) * D, kv_row, n, D, acc + static_cast<int64_t>(v) * D, D);
      }
    }
  }
}
