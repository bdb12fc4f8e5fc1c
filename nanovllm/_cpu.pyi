"""Type stubs for the CPU kernels (`csrc/cpu_*.cpp`, built as `nanovllm._cpu`).

Every kernel takes raw addresses (`tensor.data_ptr()`, `array.ctypes.data`) of host memory laid
out as its wrapper in nanovllm/cpu/ (or attention/cpu_backend.py) checks, sizes and strides in
elements (bytes where the name says so), a dtype code (0 fp32, 1 bf16) and the threads to use.
Sizes, strides, codes and null addresses are checked here and raise ValueError; the extent of
the memory behind an address cannot be, which is why only the wrappers call these."""

def paged_attention_cpu(query: int, k_cache: int, v_cache: int, block_tables: int, context_lens: int,
                        cu_seqlens_q: int, out: int, num_tokens: int, block_table_stride: int, num_seqs: int,
                        num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                        scale: float, dtype: int, num_threads: int = 1) -> None:
    """Attention of every query row (decode rows first, then prefill chunks over their cached
    prefix) over the paged cache into `out` [num_tokens, num_heads, head_dim]."""

def write_kv_cache_cpu(key: int, value: int, k_cache: int, v_cache: int, slot_mapping: int, num_tokens: int,
                       row_bytes: int, key_stride: int, value_stride: int, num_slots: int) -> None:
    """Scatter `num_tokens` K/V rows into their cache slots (-1 skips a row)."""

def qkv_attention_cpu(qkv: int, q_norm: int, k_norm: int, positions: int, inv_freq: int, scratch: int,
                      slot_mapping: int, k_cache: int, v_cache: int, block_tables: int, context_lens: int,
                      cu_seqlens_q: int, out: int, num_tokens: int, qkv_stride: int, slot_tokens: int,
                      block_table_stride: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      block_size: int, num_blocks: int, eps: float, scale: float, dtype: int,
                      num_threads: int = 1) -> None:
    """One layer's attention from its qkv rows [num_tokens, (num_heads + 2 num_kv_heads) head_dim]:
    q/k RMSNorm over each head (unless q_norm is 0), rotary, the K/V write of the first `slot_tokens`
    rows and paged attention into `out` [num_tokens, num_heads, head_dim]; `scratch` holds
    [num_tokens, num_heads + num_kv_heads, head_dim] (the rotated q, then k)."""

def rms_norm_cpu(x: int, residual: int, weight: int, out: int, residual_out: int, rows: int, hidden: int,
                 heads: int, x_stride: int, eps: float, dtype: int, num_threads: int = 1) -> None:
    """RMSNorm of [rows, heads, hidden] (heads > 1: q/k norm over head views), with the residual
    added first and written to `residual_out` when `residual` is not 0."""

def silu_and_mul_cpu(x: int, out: int, rows: int, inner: int, x_stride: int, dtype: int,
                     num_threads: int = 1) -> None:
    """out [rows, inner] = silu(x[:, :inner]) * x[:, inner:]."""

def rotary_cpu(q: int, k: int, positions: int, inv_freq: int, tokens: int, q_heads: int, k_heads: int,
               head_dim: int, q_stride: int, k_stride: int, dtype: int, num_threads: int = 1) -> None:
    """Rotary embedding in place on q [tokens, q_heads, head_dim] and k rows (neox layout)."""

def sample_cpu(logits: int, rows: int, vocab: int, stride: int, temperature: int, top_k: int, top_p: int,
               min_p: int, uniform: int, out: int, num_threads: int = 1) -> None:
    """One token per row of fp32 logits (temperature -> top-k -> top-p -> min-p -> the row's
    uniform draw, inverse CDF) into `out` (int64)."""

def argmax_cpu(logits: int, rows: int, vocab: int, stride: int, out: int, num_threads: int = 1) -> None:
    """The first maximum of each row into `out` (int64)."""

def logprobs_cpu(logits: int, rows: int, vocab: int, stride: int, chosen: int, k: int, chosen_logprob: int,
                 chosen_rank: int, top_ids: int, top_logprobs: int, num_threads: int = 1) -> None:
    """Each row's log_softmax at its chosen token (float64) and that token's rank (1 = most
    likely), and the k most likely ids and logprobs, most likely first."""

def apply_penalties_cpu(logits: int, vocab: int, stride: int, rows: int, logit_rows: int, seen: int, slots: int,
                        repetition: int, frequency: int, presence: int, num_threads: int = 1) -> None:
    """Repetition, frequency and presence penalties in place on logits[logit_rows[i]], from the
    dense [2, vocab] row seen[slots[i]] (prompt presence, output counts)."""

def has_avx2_fma() -> bool:
    """Whether this CPU runs the AVX2 + FMA kernels (gemm_cpu, the attention score tiles)."""

def gemm_packed_elements(n: int, k: int) -> int:
    """Elements of gemm_pack_cpu's copy of an [n, k] weight."""

def has_avx512f() -> bool:
    """Whether this CPU runs the AVX-512 fp32 pair tiles (gemm_cpu with pairs)."""

def has_avx512_bf16() -> bool:
    """Whether this CPU runs the AVX512-BF16 pair tiles (bf16 linear layers and MoE experts)."""

def has_amx_bf16() -> bool:
    """Whether this process runs gemm_bf16_cpu on AMX tiles (a CPU with AMX-BF16, the tiles granted
    by the OS)."""

def gemm_pack_cpu(w: int, dtype: int, n: int, k: int, w_stride: int, packed: int, pairs: bool = False) -> None:
    """Pack an [n, k] weight (rows `w_stride` apart) into gemm_packed_elements(n, k) elements of
    its dtype at `packed`: for the AVX2 tiles, or with `pairs` for the AVX-512 pair tiles (panels 2j
    and 2j + 1 interleaved; bf16 also in k pairs, k even)."""

def gemm_cpu(x: int, packed: int, bias: int, y: int, m: int, n: int, k: int, x_stride: int, y_stride: int,
             packed_dtype: int, num_threads: int = 1, pairs: bool = False) -> None:
    """y [m, n] = x [m, k] W^T (+ bias, when not 0) in fp32, W packed by gemm_pack_cpu with the same
    `pairs`: the AVX2 tiles, or with pairs (fp32 W, AVX-512F) the AVX-512 pair tiles."""

def gemm_bf16_cpu(x: int, packed: int, bias: int, y: int, m: int, n: int, k: int, x_stride: int, y_stride: int,
                  num_threads: int = 1, amx: bool = True) -> None:
    """y [m, n] fp32 = x [m, k] bf16 W^T (+ fp32 bias, when not 0), W bf16 packed by gemm_pack_cpu
    with pairs (k even; AVX512-BF16); on AMX tiles where has_amx_bf16() and k is a multiple of 32,
    unless `amx` is false."""

def gemm_logits_cpu(x: int, x_dtype: int, packed: int, packed_dtype: int, pairs: bool, y: int, m: int, n: int,
                    k: int, x_stride: int, y_stride: int, num_threads: int = 1) -> None:
    """An LM head's fp32 logits y [m, n] from rows x [m, k] (fp32 0 / bf16 1) on gemm_pack_cpu's copy of
    its weight (pairs: fp32 for gemm_cpu's tiles, bf16 for gemm_bf16_cpu's), each rounded to bf16 where
    x is bf16: cpu/gemm.py's linear on the rows, then .float()."""

def gemm_greedy_cpu(x: int, x_dtype: int, packed: int, packed_dtype: int, pairs: bool, ids: int, m: int, n: int,
                    k: int, x_stride: int, num_threads: int = 1) -> None:
    """The argmax of each row of gemm_logits_cpu's logits into ids [m] (int64: the first largest, NaNs
    passed over, 0 for a row of NaNs), without writing the logits on AMX tiles (bf16 rows)."""

def quant_isa_supported(isa: int) -> bool:
    """Whether this CPU runs quant_gemm_cpu with `isa` (0 auto, 1 portable C++, 2 AVX2, 3 AVX-512, 4 AVX-512
    with bf16 activations on AMX tiles)."""

def quant_isa_best() -> int:
    """The isa quant_gemm_cpu takes by default here."""

def quant_has_bf16() -> bool:
    """Whether quant_gemm_cpu takes bf16 activations (`x_bf16`: AVX512-BF16)."""


def quant_has_vnni512() -> bool:
    """Whether quant_gemm_cpu takes one to four bf16 rows against int4 as 16-bit integers (AVX512-VNNI)."""

def quant_gemm_packed_bytes(n: int, k: int, bits: int) -> int:
    """Bytes of quant_gemm_cpu's packed int4 / int8 [n, k] weight (csrc/cpu_gemm_quant.h's layout)."""

def quant_gemm_cpu(x: int, packed: int, scales: int, zeros: int, bias: int, y: int, m: int, n: int, k: int,
                   x_stride: int, y_stride: int, group_size: int, bits: int, zero_offset: float, isa: int = 0,
                   num_threads: int = 1, x_bf16: int = 0, y_bf16: bool = False) -> None:
    """y [m, n] = x [m, k] dequant(W)^T (+ bias, when not 0) on a packed int4 / int8 weight with
    per-group scales and zero points (0: none); bf16 activations at `x_bf16` instead of fp32 at `x`;
    y fp32, or bf16 (rounded from the fp32 sums) with `y_bf16`."""
def moe_route_cpu(logits: int, rows: int, experts: int, logits_stride: int, top_k: int, renormalize: bool,
                  topk_ids: int, topk_weights: int, expert_offsets: int, sorted: int, num_threads: int = 1) -> None:
    """Softmax over fp32 router logits [rows, experts], each row's top_k (ids int32 and fp32 weights
    [rows, top_k], by falling weight; renormalized to sum to 1 if asked), and the assignments
    (row * top_k + j) grouped by expert: expert e's are sorted[expert_offsets[e]:expert_offsets[e + 1]]."""

def moe_combine_cpu(y: int, y_stride: int, sorted: int, topk_weights: int, rows: int, top_k: int, hidden: int,
                    out: int, out_stride: int, dtype: int, num_threads: int = 1) -> None:
    """out [rows, hidden] = each row's top_k expert outputs (rows of y, one per assignment in
    moe_route_cpu's sorted order) weighted and summed; `sorted` must be a permutation."""

def moe_experts_cpu(x: int, x_stride: int, logits: int, logits_stride: int, w13: int, w13_elements: int, w2: int,
                    w2_elements: int, weight_dtype: int, pairs: bool, rows: int, hidden: int, inter: int,
                    experts: int, top_k: int, renormalize: bool, out: int, out_stride: int, dtype: int,
                    num_threads: int = 1) -> None:
    """A mixture-of-experts layer in one call: routing as moe_route_cpu, every chosen expert's
    silu(x W_gate^T) * (x W_up^T) W_down^T on weights packed by gemm_pack_cpu, with `pairs` or
    without (gate/up rows interleaved, moe_gate_up_rows(inter) of them per expert; a bf16 down
    weight's depth padded to moe_gate_up_rows(inter) / 2 with pairs), the weighted sum into out
    [rows, hidden]."""

def moe_quant_experts_cpu(x: int, x_stride: int, logits: int, logits_stride: int, rows: int, hidden: int, inter: int,
                          experts: int, top_k: int, renormalize: bool, out: int, out_stride: int, dtype: int,
                          bf16_rows: bool, w13_packed: int, w13_packed_bytes: int, w13_scales: int,
                          w13_scales_elements: int, w13_zeros: int, w13_zeros_elements: int, w13_group_size: int,
                          w13_bits: int, w13_zero_offset: float, w2_packed: int, w2_packed_bytes: int,
                          w2_scales: int, w2_scales_elements: int, w2_zeros: int, w2_zeros_elements: int,
                          w2_group_size: int, w2_bits: int, w2_zero_offset: float, num_threads: int = 1) -> None:
    """moe_experts_cpu on int8 / int4 experts packed for quant_gemm_cpu, expert after expert (w13
    [moe_gate_up_rows(inter), hidden] with gate/up rows interleaved, w2 [hidden, inter]); `bf16_rows`:
    bf16 activations on the AVX512-BF16 dot products."""

def moe_gate_up_rows(inter: int) -> int:
    """Rows of an expert's packed gate/up weight: 8 gate and 8 up rows per 16-row panel, inter
    padded to a multiple of 8."""

class DecoderLinear:
    """One projection's weight for DecoderStack (nanovllm/models/cpu_stack.py makes them)."""
    n: int
    k: int
    @staticmethod
    def dense(packed: int, packed_dtype: int, n: int, k: int, pairs: bool, bias: int) -> DecoderLinear:
        """gemm_cpu's weight (gemm_pack_cpu's copy), fp32 bias or 0."""
    @staticmethod
    def dense_bf16(packed: int, n: int, k: int, bias: int) -> DecoderLinear:
        """gemm_bf16_cpu's weight (a pair-packed bf16 copy), fp32 bias or 0."""
    @staticmethod
    def quant(packed: int, scales: int, zeros: int, bias: int, n: int, k: int, group_size: int, bits: int,
              zero_offset: float, bf16_min_rows: int, bf16_max_rows: int) -> DecoderLinear:
        """quant_gemm_cpu's weight; bf16 activations go to it as bf16 at bf16_min_rows to bf16_max_rows
        rows (min 0: never; max 0: no limit), as cpu_kernel.bf16_row_range says."""

class DecoderMoe:
    """A mixture-of-experts MLP for DecoderLayer: the router and the experts, as the Python layer
    calls moe_experts_cpu / moe_quant_experts_cpu."""
    @staticmethod
    def dense(router: DecoderLinear, w13: int, w13_elements: int, w2: int, w2_elements: int, weight_dtype: int,
              pairs: bool, hidden: int, inter: int, experts: int, top_k: int, renormalize: bool,
              dtype: int) -> DecoderMoe:
        """Experts packed by gemm_pack_cpu, as moe_experts_cpu takes them."""
    @staticmethod
    def quant(router: DecoderLinear, hidden: int, inter: int, experts: int, top_k: int, renormalize: bool,
              dtype: int, bf16_min_per_expert: float, w13_packed: int, w13_packed_bytes: int, w13_scales: int,
              w13_scales_elements: int, w13_zeros: int, w13_zeros_elements: int, w13_group_size: int,
              w13_bits: int, w13_zero_offset: float, w2_packed: int, w2_packed_bytes: int, w2_scales: int,
              w2_scales_elements: int, w2_zeros: int, w2_zeros_elements: int, w2_group_size: int, w2_bits: int,
              w2_zero_offset: float) -> DecoderMoe:
        """int8 / int4 experts as moe_quant_experts_cpu takes them; bf16 rows where a forward's
        assignments per chosen expert reach bf16_min_per_expert (0: never)."""

class DecoderLayer:
    """One layer's weights and KV cache for DecoderStack: its MLP gate_up and down, or moe."""
    def __init__(self, qkv: DecoderLinear, o: DecoderLinear, gate_up: DecoderLinear | None,
                 down: DecoderLinear | None, input_norm: int, post_norm: int, q_norm: int, k_norm: int,
                 inv_freq: int, k_cache: int, v_cache: int, moe: DecoderMoe | None = None) -> None: ...

class DecoderStack:
    """A decoder's layers in one call per forward (csrc/cpu_decoder.h); the pointers it was
    built from must outlive it."""
    def __init__(self, dtype: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float,
                 scale: float, block_size: int, num_blocks: int, layers: list[DecoderLayer],
                 final_norm: int, embedding: int, vocab: int) -> None:
        """`embedding`: the token embedding [vocab, hidden] in the model dtype, for forward's ids."""
    def adopt_buffers(self, other: DecoderStack) -> None:
        """Take the buffers `other` grew (a stack built again for a new KV cache); `other` keeps none."""
    @property
    def buffer_bytes(self) -> int:
        """Bytes of the buffers it keeps now."""
    def forward(self, input_ids: int, out: int, positions: int, slot_mapping: int, slot_tokens: int,
                block_tables: int, block_table_stride: int, context_lens: int, cu_seqlens_q: int, num_seqs: int,
                num_tokens: int, num_threads: int = 1) -> None:
        """input_ids [num_tokens] int32, looked up in the stack's embedding (IndexError for an id
        outside it) -> out [num_tokens, hidden] (the final norm's output), writing this step's K/V;
        the attention metadata as qkv_attention_cpu takes it."""
