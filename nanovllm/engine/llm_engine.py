"""LLMEngine: requests in, outputs out, one `step()` at a time.

    so = scheduler.schedule()                 # C++ core: who runs, blocks, the flat arrays; plus
                                              # the sampling-state changes since the last step
    out = executor.execute(so)                # the model runner: forward, sample -> RunnerOutput
    finished = scheduler.postprocess(out)     # C++ core: append, fork n samples, stop, free
    outputs = self._outputs(out, finished)    # completions of forks, logprobs, text (Cython),
                                              # stop strings, RequestOutputs

Per-sequence bookkeeping is vectorized over numpy columns indexed by sequence id; Python touches a
sequence only when it produces visible output (a streamed delta, a finish) or asked for logprobs.
See docs/design.md, "The step".
"""

from __future__ import annotations

import atexit
import gc
import logging
import math
import threading
import time
from collections import deque
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Required, TypedDict

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanovllm._core import Detokenizer
from nanovllm.config import EngineConfig
from nanovllm.engine.request_state import Completion, Request
from nanovllm.engine.scheduler import Finished, Scheduler
from nanovllm.executor import make_executor
from nanovllm.model_config import end_tokens, sampling_defaults
from nanovllm.models.loader import check_model_config
from nanovllm.outputs import RequestMetrics, RequestOutput
from nanovllm.quote import quote
from nanovllm.row_columns import RowColumns
from nanovllm.sample import build_entries, correct_partial
from nanovllm.sampling_params import SamplingParams, truncated_prompt
from nanovllm.token_table import build_token_table
from nanovllm.worker.step import RunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from nanovllm.sample.grammar import GrammarCompiler, HeldGrammar

logger = logging.getLogger(__name__)


class TextPrompt(TypedDict, total=False):
    """vLLM's: a text prompt (the tokenizer encodes it)."""

    prompt: Required[str]


class TokensPrompt(TypedDict, total=False):
    """vLLM's: a prompt of token ids (`prompt`, when given, is only reported back)."""

    prompt_token_ids: Required[list[int]]
    prompt: str


PromptType = str | list[int] | TextPrompt | TokensPrompt | dict[str, Any]

# Engine-side columns per sequence id (the runner's sampling state keeps its own).
SEQUENCE_COLUMNS = {
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


def _freeze_startup_heap() -> None:
    """Moves what exists after startup (torch's, transformers' and the model's ~400k objects) out of
    the cyclic GC's reach. Every full collection traverses all tracked objects: 0.2-0.5 s each on
    the dev machine, triggered every few steps once outputs allocate many objects (logprobs:
    ~1,800 per step at 256 sequences), which cost more per step than building the outputs.
    vLLM freezes its startup heap likewise. Unfrozen at exit, so that extension modules see
    their objects freed at interpreter shutdown."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


# The files a tokenizer is read from: tokenizers' JSON, a sentencepiece model, or BPE vocab + merges.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(directory: str) -> PreTrainedTokenizerBase:
    """The directory's tokenizer. Without tokenizer files transformers may build one from config.json
    alone, with no tokens, and every prompt would then be "empty": refused here, naming the files."""
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer in {path}: none of {', '.join(TOKENIZER_FILES)} is there (copy the "
                         "checkpoint's tokenizer files, or pass a tokenizer directory with tokenizer= / --tokenizer)")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    # Special tokens alone (added from defaults) do not make a tokenizer: "a" must encode.
    if tokenizer.vocab_size == 0 or not tokenizer.encode("a", add_special_tokens=False):
        raise ValueError(f"the tokenizer in {path} has no tokens (its files are empty or unreadable)")
    return tokenizer


def checked_sampling_defaults(options: EngineConfig) -> dict[str, Any]:
    """generation_config's default sampling parameters (model_config.sampling_defaults), logged
    where they change vLLM's neutral ones, as vLLM does. An invalid one is a warning here and an
    error only where it is used (a request that leaves the field out), as in vLLM."""
    defaults = sampling_defaults(options.model, options.generation_config, options.override_generation_config)
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        logger.warning("the generation config's default sampling parameters %s are not valid (%s): requests that "
                       "leave the field out will fail", defaults, e)
    if defaults and options.generation_config != "vllm":
        logger.warning("default sampling parameters from %s: %s (generation_config='vllm' for vLLM's neutral ones)",
                       "the model's generation_config.json" if options.generation_config == "auto"
                       else options.generation_config, defaults)
    return defaults


# vLLM's prompt fields this engine does not implement, refused rather than dropped.
_MULTIMODAL = "nanovllm runs text-only models"
_REFUSED_PROMPT_KEYS = {
    "multi_modal_data": _MULTIMODAL, "mm_processor_kwargs": _MULTIMODAL, "multi_modal_uuids": _MULTIMODAL,
    "prompt_embeds": "prompts are text or token ids",
    "cache_salt": "the prefix cache is shared by every request (no per-tenant isolation)",
}


class LLMEngine:
    def __init__(self, options: EngineConfig) -> None:
        try:
            self._build(options)
        except BaseException:
            # A tensor-parallel executor's workers run from its construction on: stop them now (a
            # failed startup check, say), not whenever the half-built engine is collected.
            executor = getattr(self, "executor", None)
            if executor is not None:
                executor.shutdown()
            raise

    def _build(self, options: EngineConfig) -> None:
        self.config = config = options.resolve()
        check_model_config(config.model_config, options.quantization)
        self.tokenizer = load_tokenizer(options.tokenizer or config.model)
        torch.manual_seed(options.seed)
        model_config = config.model_config
        self.max_model_len = config.max_model_len
        self.vocab_size = model_config.vocab_size
        # A generation-config directory's end tokens replace the model's generation_config.json's, and
        # its max_new_tokens (else the override's) limits every request's output (vLLM's).
        source = options.generation_config
        source_dir = source not in ("auto", "vllm")
        eos = set(end_tokens(model_config.raw, Path(source)) if source_dir else model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(t for t in eos if 0 <= t < self.vocab_size)
        # The model's own end token (the tokenizer's, else the config's first): a stop on it has no
        # stop_reason; the generation config's other end tokens are stop tokens to vLLM, named in it.
        config_eos = model_config.eos_token_ids
        self.primary_eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else \
            (config_eos[0] if config_eos else None)
        self.sampling_defaults = checked_sampling_defaults(options)
        cap = self.sampling_defaults.get("max_tokens") if source_dir else \
            (options.override_generation_config or {}).get("max_new_tokens")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"the generation config's max_new_tokens, a limit on every request's output here, must be "
                             f"an integer >= 1, got {cap!r}")
        self.max_tokens_cap: int | None = cap
        # The loader checks every weight file before the model takes any memory.
        self.executor = make_executor(config, self.eos_token_ids)
        self.scheduler = Scheduler(config, self.executor.initialize_kv_cache(), self.eos_token_ids)
        self.token_table = build_token_table(self.tokenizer, vocab_size=self.vocab_size)
        self.detokenizer = Detokenizer(self.token_table)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()  # the server's text workers compile concurrently
        self._seqs = RowColumns(SEQUENCE_COLUMNS)
        self._requests: dict[str, Request] = {}
        self._by_seq: dict[int, tuple[Request, Completion]] = {}
        self._request_counter = 0
        _freeze_startup_heap()

    @property
    def device(self) -> torch.device:
        return self.executor.device

    def make_device_current(self) -> None:
        """For a thread that drives the engine (the server's engine thread): its CUDA device."""
        self.executor.make_device_current()

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler, built at first use: xgrammar is imported only when a
        request asks for structured output (an engine without it runs everything else)."""
        with self._grammars_lock:
            if self._grammars is None:
                try:
                    from nanovllm.sample.grammar import GrammarCompiler
                except ImportError as e:
                    raise ValueError(f"structured output needs the xgrammar package ({e})") from None
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammars

    # Requests -----------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(valid_text(prompt))
        if isinstance(prompt, dict):
            asked = [k for k in _REFUSED_PROMPT_KEYS if prompt.get(k)]
            if asked:
                raise ValueError(f"a prompt's {asked[0]!r} is not supported: {_REFUSED_PROMPT_KEYS[asked[0]]}")
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
        token_ids = truncated_prompt(token_ids, params.truncate_prompt_tokens, self.max_model_len,
                                     params.truncation_side)
        # The request's own copy, checked again, as vLLM's processor takes one: what the caller
        # assigns afterwards (stop, ...) changes neither this request nor its later n > 1 samples.
        params = params.clone(**{name: self.vocab_size for name in ("logprobs", "prompt_logprobs")
                                 if getattr(params, name) == -1})  # vLLM's -1: the whole vocabulary
        if params.bad_words and params.bad_words_token_ids is None:
            # Tokenized here, unless the caller did it (the server, in its text workers).
            params.update_from_tokenizer(self.tokenizer)
        self.check_prompt(token_ids)
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
        # Prompt logprobs need every prompt position computed: no prefix-cache reads. The grammar's
        # compiler hands its vocabulary's UTF-8 tables along, built where it compiles.
        sid = self.scheduler.add(token_ids, params, grammar=None if grammar is None else grammar.compiled,
                                 grammar_utf8=None if grammar is None else self.grammars.utf8,
                                 num_samples=params.n, use_prefix_cache=params.prompt_logprobs is None)
        try:
            self._add_completion(req, sid)
        except BaseException:
            self.scheduler.abort(sid)  # whatever fails, nothing is left behind
            raise
        req.grammar = grammar
        self._requests[request_id] = req

    def check_prompt(self, token_ids: list[int]) -> None:
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
        most = self.config.options.max_logprobs
        most = self.vocab_size if most == -1 else most
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > most:
                # vLLM's check and limit (max_logprobs, 20 by default).
                raise ValueError(f"{name} = {value} is more than this engine's max_logprobs = {most} (raise it with "
                                 "max_logprobs / --max-logprobs)")
        bad_words = [t for ids in params.bad_words_token_ids or () for t in ids]
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {}),
                             ("allowed_token_ids", params.allowed_token_ids or ()), ("bad_words", bad_words)):
            bad = [t for t in tokens if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} holds token id {quote(bad[0])}, outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    def _add_completion(self, req: Request, sid: int, parent: int | None = None) -> Completion:
        """Registers sequence `sid` as the request's next completion: its prompt, or (with `parent`)
        one of its n samples, which continues from the parent's columns."""
        params = req.params
        comp = Completion(len(req.completions), sid)
        if params.logprobs is not None:
            comp.lp_refs, comp.cumulative_logprob = [], 0.0
        self.detokenizer.add(sid, skip_special_tokens=params.skip_special_tokens, stop=params.stop_strings,
                             include_stop_str_in_output=params.include_stop_str_in_output,
                             min_tokens=params.min_tokens, deltas=req.stream,
                             prompt_token_ids=req.prompt_token_ids)
        if parent is None:
            self._seqs.reset(sid)
        else:
            self._seqs.copy_row(parent, sid)
        self._seqs.lp_refs[sid] = comp.lp_refs
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
                self.scheduler.abort(comp.seq_id)
                self._release(comp)
        req.release_grammar()

    def _release(self, comp: Completion) -> None:
        """The engine's side of a sequence that ended (the scheduler's side is done already)."""
        sid = comp.seq_id
        self._by_seq.pop(sid, None)
        self.detokenizer.remove(sid)
        self._seqs.reset(sid)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # The step ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, postprocess, then the outputs: one for every streamed request that
        gained something and for every other request that finished."""
        so = self.scheduler.schedule()
        for sid, hits in self.scheduler.take_first_hits():  # vLLM's num_cached_tokens, once a request
            if sid in self._by_seq:
                self._by_seq[sid][0].num_cached_tokens = hits
        try:
            out = self.executor.execute(so)
        except BaseException:
            self._drop_batch(so)
            raise
        finished = self.scheduler.postprocess(out)
        return self._outputs(out, finished)

    def _drop_batch(self, so: SchedulerOutput) -> None:
        """The step raised, so the batch's KV state is unknown: its requests are dropped and the
        engine stays consistent (the error goes on to the caller)."""
        doomed = {self._by_seq[sid][0].request_id for sid in so.plan.seq_ids.tolist() if sid in self._by_seq}
        for request_id in doomed:
            self.abort_request(request_id)
        self.scheduler.fail_step()

    def _outputs(self, out: RunnerOutput, finished: list[Finished]) -> list[RequestOutput]:
        # Speculative decoding: row r gained tokens[offsets[r]:offsets[r + 1]] (None: one each).
        sids, tokens, offsets = out.seq_ids, out.tokens, out.token_offsets
        if out.forks:
            # A prompt's first sample fanned out: its other samples join as completions.
            for parent, child, _ in out.forks:
                req = self._by_seq[parent][0]
                req.fanned_out = True
                self._add_completion(req, child, parent=parent)
            sids = np.concatenate([sids, np.array([f[1] for f in out.forks], dtype=sids.dtype)])
            tokens = np.concatenate([tokens, np.array([f[2] for f in out.forks], dtype=tokens.dtype)])
            if offsets is not None:
                offsets = np.concatenate([offsets, offsets[-1] + np.arange(1, len(out.forks) + 1, dtype=offsets.dtype)])
        self._record(sids, out)
        if out.prompt_logprobs is not None:
            rows = out.prompt_logprobs
            table = self.token_table
            for sid, entry, (block, row) in zip(rows.seq_ids.tolist(), build_entries(rows.refs, table), rows.refs):
                req = self._by_seq[sid][0]
                at = len(req.prompt_logprobs)
                if block.partial(row):  # as vLLM's, from the prompt tokens before it (the first has no entry)
                    correct_partial(entry, req.prompt_token_ids[max(1, at - 4):at], table)
                req.prompt_logprobs.append(entry)
        return self._finish_step(sids, tokens, offsets, finished, out)

    def _record(self, sids: np.ndarray, out: RunnerOutput) -> None:
        """First-token times and logprobs of the tokens just sampled."""
        first = self._seqs.first_token_time
        new = sids[np.isnan(first[sids])]
        if len(new):
            first[new] = time.time()
        block = out.logprobs
        if block is None:
            return
        lp_sids = out.logprob_seq_ids
        if out.token_offsets is None:
            self._seqs.cum_logprob[lp_sids] += block.chosen_logprob
        else:  # a sequence's several tokens: its rows repeat
            np.add.at(self._seqs.cum_logprob, lp_sids, block.chosen_logprob)
        # Each row's (block, row) onto its completion's list; map() keeps the loop in C.
        deque(map(list.append, self._seqs.lp_refs[lp_sids], zip(repeat(block), range(len(lp_sids)))), maxlen=0)

    def _finish_step(self, sids: np.ndarray, tokens: np.ndarray, offsets: np.ndarray | None,
                     finished: list[Finished], out: RunnerOutput) -> list[RequestOutput]:
        """Text deltas and stop strings (one Cython call; only streamed sequences and stop-string
        matches come back), then the finishes: a stop string, like a grammar that terminated,
        ends the sequence in the scheduler at once (its blocks are freed); the core's own finishes
        (EOS, stop ids, length) are recorded unless a stop string or a grammar's end in the same
        token wins, as in vLLM. A sequence whose grammar rejected its token is aborted."""
        core_done = {sid: (reason, stop) for sid, reason, stop in finished}
        by_seq = self._by_seq
        streamed: dict[str, Request] = {}
        done_reqs: list[Request] = []
        # The text of a token that ended its sequence (EOS, a stop token id) is left out, as vLLM
        # does, unless the request includes stops in its output.
        silent = [sid for sid, reason, stop in finished
                  if reason == "stop" and stop is not None and not by_seq[sid][0].params.include_stop_str_in_output]
        for sid, delta, stop_str in self.detokenizer.process(sids, tokens, offsets, silent or None):
            req, comp = by_seq[sid]
            comp.text += delta
            if req.stream:
                streamed[req.request_id] = req
            if stop_str is not None:
                if core_done.pop(sid, None) is None:
                    self.scheduler.abort(sid)
                self._finish(req, comp, "stop", stop_str, done_reqs)
        ends = out.grammar_ends
        for grammar_sids, reason in ((ends.terminated, "stop"), (ends.rejected, "abort")):
            for sid in grammar_sids:
                if sid not in by_seq:  # a stop string ended it first
                    continue
                if core_done.pop(sid, None) is None:
                    self.scheduler.abort(sid)
                req, comp = by_seq[sid]
                if req.stream:
                    streamed[req.request_id] = req
                self._finish(req, comp, reason, None, done_reqs)
        for sid, (reason, stop) in core_done.items():
            req, comp = by_seq[sid]
            if req.stream:
                streamed[req.request_id] = req
            if stop == self.primary_eos and not req.params.ignore_eos:
                stop = None  # as vLLM: stop_reason names a stop token id or string, never the model's EOS
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
        held = self.detokenizer.stop_reason(comp.seq_id)
        if held is not None and reason != "abort":
            # A stop string that text held back until the end completed (a ByteFallback run that
            # only the end closed): it ended the output, as vLLM reports it.
            comp.finish_reason, comp.stop_reason = "stop", held
        self._collect(req, comp)
        if comp.lp_refs is not None and len(comp.lp_refs) > len(comp.token_ids):
            # Several tokens in its last step (speculative decoding), and it stopped before the last:
            # the logprobs of the tokens it dropped go too.
            dropped = comp.lp_refs[len(comp.token_ids):]
            del comp.lp_refs[len(comp.token_ids):]
            comp.cumulative_logprob = float(comp.cumulative_logprob - sum(b.chosen_logprob[i] for b, i in dropped))
        self._release(comp)
        if req.finished:
            done_reqs.append(req)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's name), e.g. after changing what a prefix
        means to the model; only while no request runs. Returns whether it did."""
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """Release what outlives a dropped engine otherwise until exit: tensor-parallel workers."""
        self.executor.shutdown()

    def abandon_step(self, reason: str) -> None:
        """The step running on another thread is hung: the runner fails it if it can (the engine
        cannot run again). Thread-safe; called by a watchdog."""
        self.executor.abandon(reason)

    def stats(self) -> dict[str, int]:
        s = self.scheduler.stats()
        s["num_requests"] = len(self._requests)
        s["block_size"] = self.config.block_size
        s["max_model_len"] = self.max_model_len
        return s
