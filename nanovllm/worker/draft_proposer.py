"""Speculative decoding's draft model (`speculative_config={"method": "draft_model", ...}`), on rank 0.

A smaller model with the target's vocabulary, with its own KV cache laid out on the target's block
tables: the same block ids, so prefix caching, copy-on-write and preemption need nothing of their
own. Each step it runs twice:

* `forward`: the step's plan, exactly as the target runs it (prompt chunks, decodes, the verified
  rows with their drafts), so its cache holds the KV of every position the target computed, with
  the same tokens (positions of rejected drafts are rewritten by a later step, as the target's are);
* `propose`: after the step's tokens are known, k decode passes per sampled row from its newest
  token, greedy: each row's drafts for its next step. The passes write their KV into the slots the
  core allocated past the row's tokens (its lookahead) and the next step's `forward` rewrites them;
  a row without such slots (a beam, a sequence at max_model_len) gets fewer drafts or none.

A greedy request's drafts are the draft's argmax (point masses). A sampled request's are drawn
from the draft's distribution q under the request's temperature, top-k, top-p and min-p (not its
penalties or grammar, which depend on the tokens before each position), with the request's
generator, and
q goes to the verifier (`TokenSampler.draft_probs`), which accepts a draft d with probability
min(1, p(d) / q(d)) and otherwise draws from max(p - q, 0): Leviathan et al.'s rule, exact for any
q, and where the draft agrees with the model (q close to p) nearly every draft passes.
"""

from __future__ import annotations

import numpy as np
import torch

from nanovllm._C import StepPlan
from nanovllm.attention.metadata import AttentionMetadata, HostSeqLens
from nanovllm.config import ResolvedConfig
from nanovllm.cpu import gemm as cpu_gemm
from nanovllm.cpu import huge_pages
from nanovllm.layers.attention import attention_layers, bind_kv_cache
from nanovllm.models.loader import load_model_from_config
from nanovllm.sample import GREEDY_EPS, SamplingBatch, SamplingState
from nanovllm.sample.sampler import exponential_race, filtered_probs
from nanovllm.staging import to_device, to_host
from nanovllm.worker.inference import inference
from nanovllm.worker.step import RunnerOutput

# A sampled row's drafts and the draft's distribution at each: tokens [d], probabilities [d, vocab].
DraftProbs = dict[int, tuple[np.ndarray, torch.Tensor]]


class DraftProposer:
    def __init__(self, config: ResolvedConfig, device: torch.device, dtype: torch.dtype, attn_backend: str) -> None:
        assert config.draft_model_config is not None and config.speculative is not None
        self.model_config = mc = config.draft_model_config
        self.model = load_model_from_config(mc, dtype, device, attn_backend)
        self.model.eval()
        if device.type == "cpu":
            cpu_gemm.prepack_model(self.model)
        self.device = device
        self.dtype = dtype
        self.k = config.speculative.num_speculative_tokens
        self.block_size = config.block_size
        self.kv_cache: torch.Tensor | None = None

    @property
    def bytes_per_block(self) -> int:
        mc = self.model_config
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads * mc.head_dim * element

    def allocate(self, num_blocks: int) -> None:
        mc = self.model_config
        self.kv_cache = huge_pages.zeros((2, mc.num_hidden_layers, num_blocks, self.block_size, mc.num_key_value_heads,
                                          mc.head_dim), self.dtype, self.device)
        bind_kv_cache(self.model, self.kv_cache)

    def release(self) -> None:
        self.kv_cache = None
        for layer in attention_layers(self.model):
            layer.k_cache = torch.empty(0)
            layer.v_cache = torch.empty(0)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        assert self.kv_cache is not None
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @inference
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The step's plan through the draft: its KV cache follows the target's."""
        self.model(input_ids, positions, meta)

    @inference
    def propose(self, plan: StepPlan, out: RunnerOutput, state: SamplingState) -> tuple[np.ndarray, np.ndarray,
                                                                                         DraftProbs]:
        """Each sampled row's drafts for its next step (`RunnerOutput.drafts`, `draft_offsets`), and
        for rows that sample, the distribution each was drawn from."""
        rows = len(out.seq_ids)
        offsets = out.offsets()
        emitted = np.diff(offsets).astype(np.int64)
        plan_row = np.searchsorted(plan.cu_seqlens_q, plan.sample_indices, side="right") - 1
        tables = plan.block_tables[plan_row]
        # The newest token's position: the row's context less its drafts, plus the accepted ones.
        pos = plan.context_lens[plan_row].astype(np.int64) - 1 - plan.num_drafts + emitted
        room = (tables >= 0).sum(axis=1).astype(np.int64) * self.block_size - pos
        steps = np.clip(room, 0, self.k)
        tokens = out.tokens[offsets[1:] - 1].astype(np.int64)
        drafts = np.zeros((rows, self.k), dtype=np.int32)
        temperature = state.rows.temperature[out.seq_ids] if state.users.sampled else np.zeros(rows, np.float32)
        # Seeded sampled rows never draft (engine/scheduler.py turns their speculation off): a draft
        # would take draws from their generator, so their tokens would depend on the batch.
        steps[state.rows.seeded[out.seq_ids] & (temperature > GREEDY_EPS)] = 0
        probs: dict[int, list[torch.Tensor]] = {}
        for j in range(int(steps.max(initial=0))):
            active = np.flatnonzero(steps > j)
            logits = self._decode(tokens[active], pos[active] + j, tables[active])
            next_tokens = logits.argmax(dim=-1)
            sampled = np.flatnonzero(temperature[active] > GREEDY_EPS)
            if len(sampled):
                sids = out.seq_ids[active[sampled]]
                r = state.rows
                q = filtered_probs(logits[to_device(sampled, logits.device)], SamplingBatch(
                    r.temperature[sids], r.top_k[sids], r.top_p[sids], r.min_p[sids]))
                gens = {i: state.generators[int(sid)] for i, sid in enumerate(sids) if int(sid) in state.generators}
                next_tokens = next_tokens.index_copy(0, to_device(sampled, logits.device), exponential_race(q, gens))
                for i, sid in enumerate(sids.tolist()):
                    probs.setdefault(sid, []).append(q[i])
            host = to_host(next_tokens)[0].astype(np.int32)
            drafts[active, j] = host
            tokens[active] = host
        draft_offsets = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(steps, out=draft_offsets[1:])
        row_of = {int(sid): r for r, sid in enumerate(out.seq_ids)}
        draft_probs = {sid: (drafts[row_of[sid], :len(qs)].copy(), torch.stack(qs)) for sid, qs in probs.items()}
        return drafts[np.arange(self.k)[None, :] < steps[:, None]], draft_offsets, draft_probs

    def _decode(self, tokens: np.ndarray, positions: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """One decode pass over rows: their next-token logits, fp32 (KV written at `positions`)."""
        dev = self.device
        bs = self.block_size
        slots = tables[np.arange(len(positions)), positions // bs].astype(np.int64) * bs + positions % bs
        context = (positions + 1).astype(np.int32)
        cu_q = np.arange(len(positions) + 1, dtype=np.int32)
        cu_k = np.concatenate([[0], np.cumsum(context)]).astype(np.int32)
        meta = AttentionMetadata(
            slot_mapping=to_device(slots, dev, np.int32), cu_seqlens_q=to_device(cu_q, dev),
            cu_seqlens_k=to_device(cu_k, dev), context_lens=to_device(context, dev),
            block_tables=to_device(np.ascontiguousarray(tables, dtype=np.int32), dev), max_seqlen_q=1,
            max_seqlen_k=int(context.max()), num_prefill_tokens=0, num_decode_tokens=len(positions),
            block_size=bs, host=HostSeqLens(cu_seqlens_q=cu_q, context_lens=context))
        hidden = self.model(to_device(tokens, dev, np.int32), to_device(positions, dev, np.int32), meta)
        logits = self.model.compute_logits(hidden)
        assert logits is not None
        return logits
