"""LLMEngine: requests in, outputs out, one `step()` at a time.

    plan = core.schedule()                          # C++: who runs, blocks, flat arrays
    hidden = runner.forward(plan)                   # tensors, CoW copies, forward
    out = runner.sample(hidden, ...)                # sampling package: penalties, bias, min_tokens,
                                                    # the sampler, logprobs; n rows for a prompt
                                                    # that fans out into n > 1 samples
    finished = core.postprocess(out.tokens, forks)  # C++: append, fork samples, stop, free
    events = detokenizer.process(seqs, tokens)      # Cython: text, stop strings; only streamed
                                                    # sequences and stops come back to Python

Per-sequence bookkeeping is vectorized over numpy columns indexed by sequence id; Python touches a
sequence only when it produces visible output (a streamed delta, a finish) or asked for logprobs.
See docs/design.md, "The step".
"""

from __future__ import annotations

import math
import time
from collections import deque
from itertools import repeat
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xgrammar as xgr
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanovllm import _C
from nanovllm.config import EngineConfig
from nanovllm.detokenizer import build_token_table
from nanovllm._core import Detokenizer
from nanovllm.engine.request_state import Completion, Request
from nanovllm.distributed.driver import make_model_runner
from nanovllm.executor.model_runner import SampleOutput
from nanovllm.model_config import load_model_config
from nanovllm.outputs import RequestMetrics, RequestOutput
from nanovllm.quote import quote
from nanovllm.sample import SequenceIds, build_entries, gather_logprobs
from nanovllm.sample.grammar import GrammarCompiler
from nanovllm.sample.rows import RowColumns
from nanovllm.sample.state import GrammarEnds
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.sample.grammar import HeldGrammar

PromptType = str | list[int] | dict[str, Any]

# Engine-side columns per sequence id (the sampling package keeps its own).
SEQUENCE_COLUMNS = {
    "fan_out": (np.int64, 1),  # rows its next sample takes: n for a prompt about to fan out
    "first_token_time": (np.float64, math.nan),
    "cum_logprob": (np.float64, 0.0),
    "lp_refs": (object, None),  # its Completion's lp_refs list, for the rows that asked for logprobs
}


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
        try:
            self._build(config)
        except BaseException:
            # A tensor-parallel runner's workers run from its construction on: stop them now (a
            # failed startup check, say), not whenever the half-built engine is collected.
            runner = getattr(self, "runner", None)
            if runner is not None:
                runner.shutdown()
            raise

    def _build(self, config: EngineConfig) -> None:
        self.config = config
        model_config = load_model_config(config.model)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(config.model)
        self.device = config.resolve_device()
        torch.manual_seed(config.seed)
        self.max_model_len, budget = config.resolve_lengths(model_config.max_position_embeddings)
        self.vocab_size = model_config.vocab_size
        eos = set(model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(t for t in eos if 0 <= t < self.vocab_size)
        # The loader checks every weight file before the model takes any memory.
        self.runner = make_model_runner(config, self.device, max_model_len=self.max_model_len,
                                        eos_token_ids=self.eos_token_ids)
        num_blocks = self.runner.num_kv_blocks(config, budget)
        self._check_pool_holds_one_sequence(num_blocks)
        self.runner.allocate_kv_cache(num_blocks)
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
        self.sampling = self.runner.sampling
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._seq_ids = SequenceIds()
        self._seqs = RowColumns(SEQUENCE_COLUMNS)
        self._requests: dict[str, Request] = {}
        self._by_seq: dict[int, tuple[Request, Completion]] = {}
        self._prompt_logprobs_pending: dict[str, Request] = {}
        self._request_counter = 0
        self._num_fanning = 0  # queued prompts whose first sample fans out into n > 1

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
                    arrival_time: float | None = None, stream: bool = False,
                    grammar: HeldGrammar | None = None) -> None:
        """Queues a request. A streamed request's outputs carry only what is new since the last.

        A request with `params.structured_outputs` comes with its grammar compiled (the engine
        never compiles: `grammar=engine.grammars.compile(params.structured_outputs)`, or the
        server's compile pool); the request holds it until it finishes, and it is released here
        if the request is refused."""
        try:
            self._admit(request_id, prompt, params, arrival_time, stream, grammar)
        except BaseException:
            if grammar is not None:
                grammar.release()
            raise

    def _admit(self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None,
               stream: bool, grammar: HeldGrammar | None) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        self._check_prompt(token_ids)
        self._check_params(params)
        if params.structured_outputs is not None and grammar is None:
            raise ValueError("structured_outputs needs its grammar compiled before admission (the engine never "
                             "compiles): pass grammar=engine.grammars.compile(params.structured_outputs)")
        if grammar is not None and params.structured_outputs is None:
            raise ValueError("a grammar was given for a request without structured_outputs")
        metrics = RequestMetrics(time.time() if arrival_time is None else arrival_time)
        req = Request(request_id, text, token_ids, params, metrics, stream,
                      prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                      fanned_out=params.n == 1)
        if grammar is not None and self.grammars.utf8 is not None:
            self.sampling.grammars.use_utf8(self.grammars.utf8)
        sid = self._seq_ids.acquire()
        # The Python side first, then the core: whatever fails, nothing is left behind.
        try:
            comp = self._add_completion(req, sid, grammar=None if grammar is None else grammar.compiled)
        except BaseException:
            self._seq_ids.release(sid)
            raise
        try:
            self.core.add(sid, token_ids, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                          ignore_eos=params.ignore_eos, stop_token_ids=params.stop_token_ids,
                          use_prefix_cache=params.prompt_logprobs is None, num_samples=params.n)
        except BaseException:
            self._release(comp)
            raise
        req.grammar = grammar
        self._seqs.fan_out[sid] = params.n
        self._num_fanning += params.n > 1
        self._requests[request_id] = req
        if req.prompt_logprobs_pending:
            self._prompt_logprobs_pending[request_id] = req

    def _check_prompt(self, token_ids: list[int]) -> None:
        """Prompt ids index device rows (penalties) before the core sees them: check them first."""
        for i, t in enumerate(token_ids):
            if isinstance(t, int) and not 0 <= t < self.vocab_size:  # other types: the core names them
                raise ValueError(f"prompt_token_ids[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})")

    def _check_params(self, params: SamplingParams) -> None:
        max_num_seqs = self.config.max_num_seqs
        if params.n > max_num_seqs:
            # A prompt's samples fan out together (they share its KV blocks) and each is a sequence.
            raise ValueError(f"n = {params.n} samples of one prompt can never run at once: this engine runs at "
                             f"most max_num_seqs = {max_num_seqs} sequences, and each sample is one; lower n")
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = [t for t in tokens if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} holds token id {quote(bad[0])}, outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    def _add_completion(self, req: Request, sid: int, parent: int | None = None,
                        grammar: xgr.CompiledGrammar | None = None) -> Completion:
        """Registers sequence `sid` as the request's next completion: a new prompt (constrained by
        `grammar`, if any), or (with `parent`) one of its n samples, which continues from the
        parent's sampling state."""
        params = req.params
        comp = Completion(len(req.completions), sid)
        if params.logprobs is not None:
            comp.lp_refs, comp.cumulative_logprob = [], 0.0
        self.detokenizer.add(sid, skip_special_tokens=params.skip_special_tokens, stop=params.stop_strings,
                             include_stop_str_in_output=params.include_stop_str_in_output,
                             min_tokens=params.min_tokens, deltas=req.stream)
        try:
            if parent is None:
                self._seqs.reset(sid)
                self.sampling.add(sid, params, req.prompt_token_ids, grammar)
            else:
                self._seqs.copy_row(parent, sid)
                self.sampling.fork(parent, sid, index=comp.index)
        except BaseException:
            self.detokenizer.remove(sid)
            self.sampling.remove(sid)  # whatever part of the row was taken
            raise
        self._seqs.lp_refs[sid] = comp.lp_refs
        req.completions.append(comp)
        self._by_seq[sid] = (req, comp)
        return comp

    def abort_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self._prompt_logprobs_pending.pop(request_id, None)
        for comp in req.completions:
            if not comp.finished:
                comp.finish_reason = "abort"
                self.core.abort(comp.seq_id)
                self._release(comp)
        req.release_grammar()

    def _release(self, comp: Completion) -> None:
        sid = comp.seq_id
        self._num_fanning -= bool(self._seqs.fan_out[sid] > 1)
        self._by_seq.pop(sid, None)
        self.detokenizer.remove(sid)
        self.sampling.remove(sid)
        self._seqs.reset(sid)
        self._seq_ids.release(sid)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # The step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run, sample, postprocess, detokenize. Returns an output for every streamed
        request that gained something and for every other request that finished."""
        plan = self.core.schedule()
        sids = plan.sampled_seq_ids.copy()
        repeats = self._seqs.fan_out[sids] if self._num_fanning else None
        fanning = repeats is not None and bool((repeats > 1).any())
        try:
            v, hidden = self.runner.forward(plan)
            if self._prompt_logprobs_pending:
                self._collect_prompt_logprobs(plan, hidden)
            rows = np.repeat(sids, repeats) if fanning else sids
            out = self.runner.sample(hidden, v.sample_indices, rows, repeats if fanning else None)
        except BaseException:
            # The batch's KV state is unknown now: drop its requests, keep the engine consistent.
            doomed = {self._by_seq[sid][0].request_id for sid in plan.seq_ids.tolist() if sid in self._by_seq}
            for request_id in doomed:
                self.abort_request(request_id)
            self.core.postprocess(np.zeros(plan.num_samples, dtype=np.int32))
            raise
        forks: list[tuple[int, int, int]] = []
        first_tokens = out.tokens
        if fanning:
            first_rows = np.cumsum(repeats) - repeats
            first_tokens = out.tokens[first_rows]
            forks = self._fan_out(sids, repeats, first_rows, rows, out.tokens)
        finished = self.core.postprocess(first_tokens, forks=forks)
        grammar_ends = self.sampling.record(rows, out.token_tensor, out.tokens)
        self._record(rows, out)
        return self._finish_step(rows, out.tokens, finished, grammar_ends)

    def _fan_out(self, sids: np.ndarray, repeats: np.ndarray, first_rows: np.ndarray, rows: np.ndarray,
                 tokens: np.ndarray) -> list[tuple[int, int, int]]:
        """A prompt's first sample fans out into its n completions: rows after the first of each
        such prompt become new sequences (in `rows`, in place), forked from the prompt's."""
        forks = []
        for i in np.flatnonzero(repeats > 1).tolist():
            parent = int(sids[i])
            req = self._by_seq[parent][0]
            req.fanned_out = True
            self._seqs.fan_out[parent] = 1  # before the children copy the parent's row
            self._num_fanning -= 1
            for r in range(first_rows[i] + 1, first_rows[i] + repeats[i]):
                child = self._seq_ids.acquire()
                self._add_completion(req, child, parent=parent)
                forks.append((parent, child, int(tokens[r])))
                rows[r] = child
        return forks

    def _record(self, rows: np.ndarray, out: SampleOutput) -> None:
        """First-token times and logprobs of the tokens just sampled."""
        first = self._seqs.first_token_time
        new = rows[np.isnan(first[rows])]
        if len(new):
            first[new] = time.time()
        block = out.logprobs
        if block is None:
            return
        lp_sids = rows[out.logprob_rows]
        self._seqs.cum_logprob[lp_sids] += block.chosen_logprob
        # Each row's (block, row) onto its completion's list; map() keeps the loop in C.
        deque(map(list.append, self._seqs.lp_refs[lp_sids], zip(repeat(block), range(len(lp_sids)))), maxlen=0)

    def _finish_step(self, rows: np.ndarray, tokens: np.ndarray, finished: list[tuple[int, str, int | None]],
                     grammar_ends: GrammarEnds) -> list[RequestOutput]:
        """Text deltas and stop strings (one Cython call; only streamed sequences and stop-string
        matches come back), then the finishes: a stop string, like a grammar that terminated,
        aborts the sequence in the core at once (its blocks are freed); the core's own finishes
        (EOS, stop ids, length) are recorded unless a stop string or a grammar's end in the same
        token wins, as in vLLM. A sequence whose grammar rejected its token is aborted."""
        core_done = {sid: (reason, stop) for sid, reason, stop in finished}
        by_seq = self._by_seq
        streamed: dict[str, Request] = {}
        done_reqs: list[Request] = []
        for sid, delta, stop_str in self.detokenizer.process(rows, tokens):
            req, comp = by_seq[sid]
            comp.text += delta
            if req.stream:
                streamed[req.request_id] = req
            if stop_str is not None:
                if core_done.pop(sid, None) is None:
                    self.core.abort(sid)
                self._finish(req, comp, "stop", stop_str, done_reqs)
        for sids, reason in ((grammar_ends.terminated, "stop"), (grammar_ends.rejected, "abort")):
            for sid in sids:
                if sid not in by_seq:  # a stop string ended it first
                    continue
                if core_done.pop(sid, None) is None:
                    self.core.abort(sid)
                req, comp = by_seq[sid]
                if req.stream:
                    streamed[req.request_id] = req
                self._finish(req, comp, reason, None, done_reqs)
        eos = self.eos_token_ids
        for sid, (reason, stop) in core_done.items():
            req, comp = by_seq[sid]
            if req.stream:
                streamed[req.request_id] = req
            if stop in eos and not req.params.ignore_eos:
                stop = None  # as vLLM: stop_reason names a stop token id or string, never EOS
            self._finish(req, comp, reason, stop, done_reqs)
        outputs = []
        for req in streamed.values():
            if not req.finished:
                for comp in req.completions:
                    if not comp.finished:
                        self._collect(req, comp)
                outputs.append(req.output(self.token_table))
        now = time.time()
        for req in done_reqs:
            req.metrics.finished_time = now
            req.release_grammar()
            outputs.append(req.output(self.token_table))
            self._requests.pop(req.request_id, None)
            self._prompt_logprobs_pending.pop(req.request_id, None)
        return outputs

    def _collect(self, req: Request, comp: Completion) -> None:
        """Moves what the sequence produced since the last collection into its completion."""
        sid = comp.seq_id
        new = self.detokenizer.token_ids(sid, comp.num_collected)
        comp.token_ids += new
        comp.num_collected += len(new)
        if comp.lp_refs is not None:
            comp.cumulative_logprob = float(self._seqs.cum_logprob[sid])
        if req.metrics.first_token_time is None and not math.isnan(self._seqs.first_token_time[sid]):
            req.metrics.first_token_time = float(self._seqs.first_token_time[sid])

    def _finish(self, req: Request, comp: Completion, reason: str, stop: int | str | None,
                done_reqs: list[Request]) -> None:
        comp.finish_reason, comp.stop_reason = reason, stop
        comp.text += self.detokenizer.flush(comp.seq_id)
        self._collect(req, comp)
        self._release(comp)
        if req.finished:
            done_reqs.append(req)

    def _collect_prompt_logprobs(self, plan: _C.StepPlan, hidden: torch.Tensor) -> None:
        """Logprobs of each prompt token given the ones before it, as its chunk is computed."""
        seq_ids = plan.seq_ids
        cu_q = plan.cu_seqlens_q
        positions = plan.positions
        flat: list[int] = []
        owners: list[tuple[Request, int]] = []
        for req in self._prompt_logprobs_pending.values():
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
        # A step may hold thousands of prompt tokens: full-vocab logits for all of them at once would
        # far exceed what the memory profile reserved (logits for max_num_seqs rows), so go in
        # slices of that many rows.
        chunk = self.config.max_num_seqs
        for lo in range(0, len(flat), chunk):
            part = owners[lo:lo + chunk]
            idx = torch.as_tensor(flat[lo:lo + chunk], device=hidden.device)
            targets = torch.as_tensor([req.prompt_token_ids[t] for req, t in part], device=hidden.device)
            wanted = np.array([req.params.prompt_logprobs for req, _ in part], dtype=np.int64)
            block = gather_logprobs(self.runner.logits(hidden, idx), targets, wanted)
            entries = build_entries([(block, i) for i in range(len(part))], self.token_table)
            for (req, _), entry in zip(part, entries):
                req.prompt_logprobs.append(entry)
        for rid in [rid for rid, req in self._prompt_logprobs_pending.items() if not req.prompt_logprobs_pending]:
            del self._prompt_logprobs_pending[rid]

    def shutdown(self) -> None:
        """Release what outlives a dropped engine otherwise until exit: tensor-parallel workers."""
        self.runner.shutdown()

    def abandon_step(self, reason: str) -> None:
        """The step running on another thread is hung: the runner fails it if it can (the engine
        cannot run again). Thread-safe; called by a watchdog."""
        self.runner.abandon(reason)

    def stats(self) -> dict[str, int]:
        s = dict(self.core.stats())
        s["num_requests"] = len(self._requests)
        s["block_size"] = self.config.block_size
        s["max_model_len"] = self.max_model_len
        return s
