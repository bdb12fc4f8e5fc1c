"""LLMEngine: requests in, outputs out, one `step()` at a time.

    plan = core.schedule()                          # C++: who runs, blocks, flat arrays
    hidden = runner.forward(plan)                   # tensors, CoW copies, forward
    tokens = sample(process(logits(hidden)))        # penalties, bias, min_tokens; n samples per
                                                    # row when a prompt fans out into n > 1
    finished = core.postprocess(tokens, forks)      # C++: append, fork samples, stop, free
    deltas = detokenizer.process(seqs, tokens)      # Cython: text increments, stop strings
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanovllm import _C
from nanovllm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from nanovllm.detokenizer import build_token_table
from nanovllm._core import Detokenizer
from nanovllm.engine.request_state import Completion, Request
from nanovllm.engine.sampling_table import SamplingTable, SequenceIds
from nanovllm.executor.model_runner import ModelRunner
from nanovllm.layers.logits_processors import PenaltyRows, apply_logit_bias, apply_penalties, mask_tokens
from nanovllm.layers.logprobs import TokenLogprobs, gather_logprobs
from nanovllm.model_config import load_model_config
from nanovllm.models.loader import find_weight_files, validate_weight_files
from nanovllm.outputs import Logprob, RequestMetrics, RequestOutput
from nanovllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


def valid_text(text: str) -> str:
    """The tokenizer takes UTF-8: a lone surrogate (e.g. from a JSON "\\ud800") would fail inside it
    with a TypeError that does not say what is wrong."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the prompt is not valid Unicode: it holds the lone surrogate {text[e.start:e.end]!r} "
                         f"at position {e.start}") from None
    return text


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Every file is checked before any memory is reserved.
        model_config = load_model_config(config.model)
        validate_weight_files(find_weight_files(config.model))
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(config.model)
        self.device = config.resolve_device()
        torch.manual_seed(config.seed)
        self.max_model_len, budget = config.resolve_lengths(model_config.max_position_embeddings)
        self.runner = ModelRunner(config.model, config.dtype, self.device, config.block_size, max_num_seqs=config.max_num_seqs,
                                  max_model_len=self.max_model_len, enforce_eager=config.enforce_eager)
        num_blocks = self._num_kv_blocks(budget)
        self._check_pool_holds_one_sequence(num_blocks)
        self.runner.allocate_kv_cache(num_blocks)
        self.vocab_size = model_config.vocab_size
        eos = set(model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(t for t in eos if 0 <= t < self.vocab_size)
        self.core = _C.Scheduler(
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
        )
        self.token_table = build_token_table(self.tokenizer, vocab_size=self.vocab_size)
        self.detokenizer = Detokenizer(self.token_table)
        self.sampling = SamplingTable(self.device)
        self._seq_ids = SequenceIds()
        self._requests: dict[str, Request] = {}
        self._by_seq: dict[int, tuple[Request, Completion]] = {}
        self._fanout: dict[int, Request] = {}  # parent sequence -> request awaiting n samples
        self._request_counter = 0

    def _num_kv_blocks(self, budget: int) -> int:
        c = self.config
        if c.num_kvcache_blocks is not None:
            return c.num_kvcache_blocks
        per_block = self.runner.kv_spec.bytes_per_block
        if self.device.type == "cuda" and c.kv_cache_memory_bytes is None:
            blocks = self.runner.profile_num_blocks(c.gpu_memory_utilization, budget)
        else:
            blocks = (c.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES) // per_block
        if blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache (one block needs {per_block} bytes); "
                "raise gpu_memory_utilization or kv_cache_memory_bytes"
            )
        return int(blocks)

    def _check_pool_holds_one_sequence(self, num_blocks: int) -> None:
        """A pool smaller than max_model_len would cut every long enough request at the pool's size
        (reported as finish_reason "length"): refuse it at startup, as vLLM does."""
        block_size = self.config.block_size
        need = -(-self.max_model_len // block_size)
        if num_blocks < need:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {block_size} tokens = {num_blocks * block_size} tokens, "
                f"but one sequence of max_model_len={self.max_model_len} tokens needs {need} blocks; lower "
                f"max_model_len to at most {num_blocks * block_size}, or give the KV cache more room "
                "(num_kvcache_blocks, kv_cache_memory_bytes or gpu_memory_utilization)")

    # Requests -----------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(valid_text(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt_token_ids' or a string 'prompt'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def next_request_id(self) -> str:
        self._request_counter += 1
        return str(self._request_counter - 1)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, stream: bool = False) -> None:
        """Queues a request. A streamed request's outputs carry only what is new since the last."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self._check_params(params)
        metrics = RequestMetrics(time.time() if arrival_time is None else arrival_time)
        req = Request(request_id, text, token_ids, params, metrics, stream,
                      prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                      fanned_out=params.n == 1)
        sid = self._seq_ids.acquire()
        # The Python side first, then the core: whatever fails, nothing is left behind.
        try:
            comp = self._add_completion(req, sid)
        except BaseException:
            self._seq_ids.release(sid)
            raise
        try:
            self.core.add(sid, token_ids, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                          ignore_eos=params.ignore_eos, stop_token_ids=params.stop_token_ids,
                          use_prefix_cache=params.prompt_logprobs is None)
        except BaseException:
            self._release(comp)
            raise
        if params.n > 1:
            self._fanout[sid] = req
        self._requests[request_id] = req

    def _check_params(self, params: SamplingParams) -> None:
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = [t for t in tokens if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} holds token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})")

    def _add_completion(self, req: Request, sid: int, generator: torch.Generator | None = None) -> Completion:
        params = req.params
        comp = Completion(len(req.completions), sid)
        if params.logprobs is not None:
            comp.logprobs, comp.cumulative_logprob = [], 0.0
        self.sampling.set(sid, params, generator)
        self.detokenizer.add(sid, skip_special_tokens=params.skip_special_tokens, stop=params.stop_strings,
                             include_stop_str_in_output=params.include_stop_str_in_output,
                             min_tokens=params.min_tokens)
        req.completions.append(comp)
        self._by_seq[sid] = (req, comp)
        return comp

    def abort_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for comp in req.completions:
            if not comp.finished:
                comp.finish_reason = "abort"
                self.core.abort(comp.seq_id)
                self._release(comp)

    def _release(self, comp: Completion) -> None:
        self._by_seq.pop(comp.seq_id, None)
        self._fanout.pop(comp.seq_id, None)
        self.detokenizer.remove(comp.seq_id)
        self.sampling.clear(comp.seq_id)
        self._seq_ids.release(comp.seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # The step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one forward pass. Returns an output for every streamed request that gained
        something and for every other request that finished."""
        plan = self.core.schedule()
        sids = plan.sampled_seq_ids.copy()
        try:
            v, hidden = self.runner.forward(plan)
            if any(r.prompt_logprobs_pending for r in self._requests.values()):
                self._collect_prompt_logprobs(plan, hidden)
            counts = np.ones(len(sids), dtype=np.int64)
            for i, sid in enumerate(sids.tolist()) if self._fanout else ():
                req = self._fanout.get(sid)
                if req is not None:
                    counts[i] = req.params.n
            rows = np.repeat(sids, counts)
            tokens_t = torch.empty(0, dtype=torch.int64)
            raw = None
            if len(sids):
                raw = self.runner.logits(hidden[v.sample_indices])
                if len(rows) != len(sids):
                    raw = raw[torch.from_numpy(np.repeat(np.arange(len(sids)), counts)).to(raw.device)]
                tokens_t = self.runner.sample(self._process_logits(raw, rows), self.sampling.batch(rows))
        except BaseException:
            # The batch's KV state is unknown now: drop its requests, keep the engine consistent.
            doomed = {self._by_seq[sid][0].request_id for sid in plan.seq_ids.tolist() if sid in self._by_seq}
            for request_id in doomed:
                self.abort_request(request_id)
            self.core.postprocess(np.zeros(plan.num_samples, dtype=np.int32))
            raise
        tokens = tokens_t.to(torch.int32).cpu().numpy()
        first_rows = np.cumsum(counts) - counts
        forks = []
        row_sids = rows.copy()
        for i in np.flatnonzero(counts > 1).tolist():
            parent = int(sids[i])
            req = self._fanout.pop(parent)
            req.fanned_out = True
            for r in range(first_rows[i] + 1, first_rows[i] + counts[i]):
                child = self._seq_ids.acquire()
                forks.append((parent, child, int(tokens[r])))
                self._add_completion(req, child, self.sampling.generators.get(parent))
                row_sids[r] = child
        finished = self.core.postprocess(tokens[first_rows], forks=forks)
        live = np.fromiter((sid in self._by_seq for sid in row_sids.tolist()), dtype=bool, count=len(row_sids))
        if not live.all():  # aborted while the step ran
            keep = torch.from_numpy(np.flatnonzero(live)).to(tokens_t.device)
            row_sids, tokens, raw, tokens_t = row_sids[live], tokens[live], raw[keep], tokens_t[keep]
        if len(row_sids):
            self._record_tokens(row_sids, tokens, raw, tokens_t)
        return self._finish_step(row_sids, tokens, finished)

    def _process_logits(self, raw: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        todo = np.flatnonzero(self.sampling.needs_processing[rows]).tolist()
        if not todo:
            return raw
        logits = raw.clone()
        pen = PenaltyRows([], [], [], [], [], [])
        bias_rows, biases, mask_rows, masks = [], [], [], []
        for row in todo:
            req, comp = self._by_seq[int(rows[row])]
            p = req.params
            if p.has_penalties:
                pen.rows.append(row)
                pen.prompt_tokens.append(req.prompt_token_ids)
                pen.output_tokens.append(comp.token_ids)
                pen.presence.append(p.presence_penalty)
                pen.frequency.append(p.frequency_penalty)
                pen.repetition.append(p.repetition_penalty)
            if p.logit_bias:
                bias_rows.append(row)
                biases.append(p.logit_bias)
            if len(comp.token_ids) < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                mask_rows.append(row)
                masks.append(sorted(stops))
        apply_penalties(logits, pen)
        apply_logit_bias(logits, bias_rows, biases)
        mask_tokens(logits, mask_rows, masks)
        return logits

    def _record_tokens(self, row_sids: np.ndarray, tokens: np.ndarray, raw: torch.Tensor,
                       tokens_t: torch.Tensor) -> None:
        now = time.time()
        want = self.sampling.logprobs[row_sids]
        lp_rows = np.flatnonzero(want >= 0)
        lp = None
        if len(lp_rows):
            idx = torch.from_numpy(lp_rows).to(raw.device)
            lp = gather_logprobs(raw[idx], tokens_t[idx], int(want[lp_rows].max()))
        lp_pos = {int(r): i for i, r in enumerate(lp_rows.tolist())}
        for r, (sid, tok) in enumerate(zip(row_sids.tolist(), tokens.tolist())):
            req, comp = self._by_seq[sid]
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            comp.token_ids.append(tok)
            if lp is not None and r in lp_pos:
                i = lp_pos[r]
                comp.logprobs.append(self._logprob_entry(lp, i, tok, req.params.logprobs or 0))
                comp.cumulative_logprob += lp.chosen_logprob[i]

    def _finish_step(self, row_sids: np.ndarray, tokens: np.ndarray,
                     finished: list[tuple[int, str, int | None]]) -> list[RequestOutput]:
        """Text deltas and stop strings for every sequence sampled this step (one Cython call),
        then the finishes: a stop string aborts the sequence in the core at once (its blocks are
        freed); the core's own finishes (EOS, stop ids, length) are recorded unless a stop string
        in the same token wins, as in vLLM."""
        core_done = {sid: (reason, stop) for sid, reason, stop in finished}
        by_seq = self._by_seq
        streamed: dict[str, Request] = {}
        done_reqs: list[Request] = []
        for sid, delta, stop_str in self.detokenizer.process(row_sids, tokens):
            req, comp = by_seq[sid]
            if delta:
                comp.text += delta
            if req.stream:
                streamed[req.request_id] = req
            done = core_done.get(sid) if core_done else None
            if stop_str is not None:
                comp.finish_reason, comp.stop_reason = "stop", stop_str
                if done is None:
                    self.core.abort(sid)
            elif done is not None:
                comp.finish_reason, comp.stop_reason = done
            else:
                continue
            comp.text += self.detokenizer.flush(sid)
            self._release(comp)
            if req.finished:
                done_reqs.append(req)
        now = time.time()
        outputs = [req.output() for req in streamed.values() if not req.finished]
        for req in done_reqs:
            req.metrics.finished_time = now
            outputs.append(req.output())
            self._requests.pop(req.request_id, None)
        return outputs

    def _collect_prompt_logprobs(self, plan: _C.StepPlan, hidden: torch.Tensor) -> None:
        """Logprobs of each prompt token given the ones before it, as its chunk is computed."""
        seq_ids = plan.seq_ids
        cu_q = plan.cu_seqlens_q
        positions = plan.positions
        flat: list[int] = []
        owners: list[tuple[Request, int]] = []
        for req in self._requests.values():
            if not req.prompt_logprobs_pending:
                continue
            match = np.flatnonzero(seq_ids == req.completions[0].seq_id)
            if not len(match):
                continue
            row = int(match[0])
            for i in range(int(cu_q[row]), int(cu_q[row + 1])):
                target = int(positions[i]) + 1
                # Positions already collected (a recompute after preemption) are skipped.
                if len(req.prompt_logprobs) <= target < len(req.prompt_token_ids):
                    flat.append(i)
                    owners.append((req, target))
        if not flat:
            return
        # A step may hold thousands of prompt tokens: full-vocab logits for all of them at once would
        # far exceed what the memory profile reserved (logits for max_num_seqs rows), so go in
        # slices of that many rows.
        chunk = self.config.max_num_seqs
        for lo in range(0, len(flat), chunk):
            part = owners[lo:lo + chunk]
            idx = torch.as_tensor(flat[lo:lo + chunk], device=hidden.device)
            targets = torch.as_tensor([req.prompt_token_ids[t] for req, t in part], device=hidden.device)
            k = max(req.params.prompt_logprobs or 0 for req, _ in part)
            lp = gather_logprobs(self.runner.logits(hidden[idx]), targets, k)
            for i, (req, target) in enumerate(part):
                tok = req.prompt_token_ids[target]
                req.prompt_logprobs.append(self._logprob_entry(lp, i, tok, req.params.prompt_logprobs or 0))

    def _logprob_entry(self, lp: TokenLogprobs, i: int, token: int, k: int) -> dict[int, Logprob]:
        """Row i's top-k alternatives plus the chosen token itself, as vLLM reports them."""
        entry = {tid: Logprob(val, rank + 1, self.token_table.decode_token(tid))
                 for rank, (tid, val) in enumerate(zip(lp.top_ids[i][:k], lp.top_logprobs[i][:k]))}
        entry[token] = Logprob(lp.chosen_logprob[i], lp.chosen_rank[i], self.token_table.decode_token(token))
        return entry

    def stats(self) -> dict[str, int]:
        s = dict(self.core.stats())
        s["num_requests"] = len(self._requests)
        s["block_size"] = self.config.block_size
        s["max_model_len"] = self.max_model_len
        return s
