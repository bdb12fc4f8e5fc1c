"""Type stubs for the C++ scheduling core (`csrc/`, built as `nanovllm._C`; the CPU math kernels are
`nanovllm._cpu`, _cpu.pyi).

Every method validates its arguments and raises ValueError (bad value), KeyError (unknown
sequence id) or IndexError (block id out of range) with a message naming the problem.
"""

from typing import Sequence as Seq

import numpy as np
import numpy.typing as npt

def xxh64(data: bytes, seed: int = 0) -> int:
    """XXH64 of `data`, bit-exact with `xxhash.xxh64(data, seed).intdigest()`."""

def hash_block_tokens(parent_hash: int | None, token_ids: Seq[int]) -> int:
    """One link of the prefix-cache chain: XXH64(parent as 8 LE bytes || tokens as int64 LE).

    `parent_hash=None` for block 0 (no prefix bytes)."""

def hash_prompt_blocks(token_ids: Seq[int], block_size: int) -> list[int]:
    """The chained hashes of every full block of `token_ids`."""

def verification_rows(num_drafts: np.ndarray, sample_indices: np.ndarray,
                      input_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A verification step's logits rows: (positions int64, drafts int64; -1 for each sample's last row)."""

def accept_greedy(tokens: np.ndarray, drafts: np.ndarray,
                  num_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy verification: (emitted tokens int32, offsets int32 [samples + 1], each token's logits row int64)."""

class BlockPool:
    """Physical KV blocks: ref counts, LRU free queue, hash -> block map."""

    def __init__(self, num_blocks: int, block_size: int) -> None: ...
    num_blocks: int
    block_size: int
    num_free_blocks: int       # ref count 0 (includes cached free blocks)
    num_used_blocks: int       # ref count > 0
    num_cached_blocks: int     # blocks holding a hash (used or free)
    def allocate(self) -> int: ...           # head of the free queue; evicts its hash
    def touch(self, block_id: int) -> None: ...   # ref + 1, leaves the free queue if free
    def free(self, block_id: int) -> None: ...    # ref - 1; cached -> tail, uncached -> head
    def register(self, block_id: int, block_hash: int, token_ids: Seq[int]) -> bool: ...
    def lookup(self, block_hash: int, token_ids: Seq[int]) -> int: ...  # block id or -1
    def ref_count(self, block_id: int) -> int: ...
    def block_hash(self, block_id: int) -> int | None: ...
    def free_queue(self) -> list[int]: ...   # head (next evicted) first

class StepPlan:
    """The flat arrays for one forward pass; views into one persistent int32 buffer.

    Valid until the next `schedule()`; the arrays are numpy views, not copies."""

    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int   # decodes (query length 1) come first in the batch
    num_decode_seqs: int
    num_samples: int
    num_draft_tokens: int  # speculative decoding: drafts in this plan
    num_copies: int
    max_seqlen_q: int
    max_seqlen_k: int
    max_blocks_per_seq: int  # block_tables row stride
    input_ids: npt.NDArray[np.int32]       # [num_tokens]
    positions: npt.NDArray[np.int32]       # [num_tokens]
    slot_mapping: npt.NDArray[np.int32]    # [num_tokens]
    cu_seqlens_q: npt.NDArray[np.int32]    # [num_seqs + 1]
    cu_seqlens_k: npt.NDArray[np.int32]    # [num_seqs + 1]
    context_lens: npt.NDArray[np.int32]    # [num_seqs]
    sample_indices: npt.NDArray[np.int32]  # [num_samples]
    block_copies: npt.NDArray[np.int32]    # [num_copies, 2] (src, dst)
    block_tables: npt.NDArray[np.int32]    # [num_seqs, max_blocks_per_seq], -1 padded
    seq_ids: npt.NDArray[np.int64]         # [num_seqs] batch order
    sampled_seq_ids: npt.NDArray[np.int64] # [num_samples]
    num_drafts: npt.NDArray[np.int32]  # [num_samples], host only: drafts verified before each sample index
    # The whole persistent buffer and where each array lives in it, so a runner can move a plan
    # to the device with one copy of buffer[:used_size] and take views there.
    buffer: npt.NDArray[np.int32]
    used_size: int
    offsets: dict[str, int]
    def copy_used(self, counts: int, dst: int, dst_size: int, mirror: PlanMirror) -> None:
        """The tensor-parallel step message in one call (distributed/step_message.py): the seven
        counts (num_tokens, num_seqs, num_samples, num_copies, num_decode_tokens, max_seqlen_q,
        max_seqlen_k) as int32 at address `counts`, and the used part of every section into the
        int32 buffer of `dst_size` ints (at least len(buffer)) at address `dst` (this layout), whose
        block-table rows `mirror` describes:
        only entries new to it are written. Raw addresses: the caller keeps both buffers alive
        and big enough."""

class PlanMirror:
    """What each block-table row of a copy of a StepPlan holds (a ring slot that starts all -1,
    as a plan does), so that `StepPlan.copy_used` writes only the entries new to it."""

    def __init__(self, max_seqs: int) -> None: ...
    rows: int

class StepRingWriter:
    """Rank 0's end of the tensor-parallel step ring (nanovllm/distributed/shm_ring.py has the
    layout): one call per message. Each `try_publish_*` returns False, writing nothing, while a
    worker still holds the slot the message needs."""

    def __init__(self, control: int, num_workers: int, slots: int, num_slots: int, slot_ints: int, max_seqs: int,
                 owner: object) -> None: ...
    def try_publish_step(self, plan: StepPlan) -> bool: ...
    def try_publish_rows(self, rows: npt.NDArray[np.int32]) -> bool: ...
    def try_publish_stop(self) -> bool: ...
    next: int

class StepRingReader:
    """A worker's end of the tensor-parallel step ring."""

    def __init__(self, control: int, num_workers: int, worker_index: int, slots: int, num_slots: int,
                 slot_ints: int, owner: object) -> None: ...
    def ready(self) -> bool: ...
    def poll(self) -> tuple[int, ...] | None:
        """None until the next message is published; then (slot, kind, the seven counts, rows):
        the header's fields at their indices, the slot in place of the message number. Raises
        RuntimeError if the slot holds another message number."""
    def ack(self) -> None: ...

class Scheduler:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        eos_token_ids: Seq[int] = (),
        vocab_size: int = 0,   # 0: token ids only checked >= 0
        spec_method: str = "none",  # speculative decoding: "none", "ngram" (drafted here), "external" (handed in)
        num_speculative_tokens: int = 0,
        prompt_lookup_min: int = 1,
        prompt_lookup_max: int = 1,
        disable_by_batch_size: int = 0,  # no drafts in a step with this many running; 0: never
        adaptive_speculation: bool = True,
    ) -> None: ...
    def add(
        self,
        seq_id: int,
        prompt_token_ids: Seq[int] | npt.NDArray[np.integer],
        max_tokens: int = 16,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        stop_token_ids: Seq[int] = (),
        use_prefix_cache: bool = True,  # False: compute every prompt token (prompt logprobs)
        num_samples: int = 1,  # n: running slots reserved until its first sample fans out
    ) -> None: ...
    def abort(self, seq_id: int) -> None: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def schedule(self) -> StepPlan: ...
    def postprocess(
        self,
        sampled_token_ids: npt.NDArray[np.integer] | Seq[int],
        forks: Seq[tuple[int, int, int]] = (),
    ) -> list[tuple[int, str, int | None]]:
        """Appends one token per sample of the step in flight.

        `forks`: (parent_id, child_id, token) for parents sampled in this step; each child shares
        the parent's blocks (copy-on-write) and takes `token` (parallel sampling, beam search).
        Returns (seq_id, "stop" | "length", stop token id or None) for each sequence that
        finished, forked children included."""
    def postprocess_spec(
        self,
        sampled_token_ids: npt.NDArray[np.integer] | Seq[int],
        token_offsets: npt.NDArray[np.integer] | Seq[int],
        forks: Seq[tuple[int, int, int]] = (),
        drafts: npt.NDArray[np.integer] | Seq[int] | None = None,
        draft_offsets: npt.NDArray[np.integer] | Seq[int] | None = None,
    ) -> tuple[list[tuple[int, str, int | None]], npt.NDArray[np.int32]]:
        """Several tokens per sample (speculative decoding): row r gained
        sampled_token_ids[token_offsets[r]:token_offsets[r + 1]], its accepted drafts then one more.
        Each is checked for a stop in order and the rest dropped; rejected draft positions are rolled
        back (their blocks freed). `drafts`/`draft_offsets` (spec_method "external"): each row's
        proposals for its next step. Returns (finished as postprocess(), kept: the tokens each row took)."""
    def disable_spec(self, seq_id: int) -> None: ...  # never drafts (beam search); before it first runs
    def has_unfinished(self) -> bool: ...
    def take_first_hits(self) -> list[tuple[int, int]]:
        """[(seq_id, prompt tokens the prefix cache held)] of the sequences first scheduled since the last call."""
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only while no block is in use. Returns whether it did."""
    in_flight: bool  # a scheduled step awaits postprocess()
    plan: StepPlan   # the most recent plan
    num_waiting: int
    num_running: int
    num_preemptions: int
    def token_ids(self, seq_id: int) -> list[int]: ...
    def num_computed_tokens(self, seq_id: int) -> int: ...
    def block_table(self, seq_id: int) -> list[int]: ...
    def status(self, seq_id: int) -> str: ...  # "waiting" | "running"
    def stats(self) -> dict[str, int]:
        """num_preemptions, prefix_cache_queries, prefix_cache_hits (tokens), num_free_blocks,
        num_used_blocks, num_cached_blocks, num_total_blocks, num_waiting, num_running."""
    def ref_count(self, block_id: int) -> int: ...
    def free_queue(self) -> list[int]: ...   # the pool's free queue, head (next evicted) first
    num_free_blocks: int
    num_total_blocks: int
