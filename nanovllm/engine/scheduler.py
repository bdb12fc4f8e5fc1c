"""The engine's scheduler: the C++ core plus what it leaves to Python.

The core (`_C.Scheduler`, csrc/scheduler.cpp) does continuous batching, chunked prefill, prefix
caching, preemption, the blocks and the flat arrays of each step. Around it this class keeps the
sequence ids (small recycled integers that index every per-sequence column) and the sampling-state
changes the model runner must apply before the next step: sequences admitted, forked from outside
(beam search) and finished. `schedule()` hands both over as one SchedulerOutput; `postprocess(out)`
gives the core a step's tokens and forks and returns the sequences it finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nanovllm import _C
from nanovllm.config import ResolvedConfig
from nanovllm.sample.sampler import GREEDY_EPS
from nanovllm.sampling_params import SamplingParams
from nanovllm.worker.step import Admission, RunnerOutput, SchedulerOutput

Finished = tuple[int, str, int | None]  # (sequence id, "stop" | "length", the stop token or None)


class SequenceIds:
    """Small, recycled integer ids for the core's sequences (they index per-sequence columns)."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0

    def acquire(self) -> int:
        if self._free:
            return self._free.pop()
        self._next += 1
        return self._next - 1

    def release(self, sid: int) -> None:
        self._free.append(sid)


class Scheduler:
    def __init__(self, config: ResolvedConfig, num_blocks: int, eos_token_ids: Sequence[int]) -> None:
        spec = config.speculative
        spec_args = {} if spec is None else dict(
            spec_method="ngram" if spec.method == "ngram" else "external",
            num_speculative_tokens=spec.num_speculative_tokens,
            prompt_lookup_min=max(1, spec.prompt_lookup_min), prompt_lookup_max=max(1, spec.prompt_lookup_max),
            disable_by_batch_size=config.spec_disable_batch, adaptive_speculation=spec.adaptive)
        self.core = _C.Scheduler(
            num_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            enable_prefix_caching=config.options.enable_prefix_caching, eos_token_ids=list(eos_token_ids),
            vocab_size=config.model_config.vocab_size, **spec_args)
        self._spec_disable_batch = config.spec_disable_batch
        self._draft_model = spec is not None and spec.method != "ngram"
        self.max_model_len = config.max_model_len
        self._ids = SequenceIds()
        self._reserved: dict[int, tuple[int, ...]] = {}  # a prompt's ids for its n - 1 other samples
        self._admitted: dict[int, Admission] = {}  # by id, in admission order
        self._forked: list[tuple[int, int, int]] = []
        self._finished: list[int] = []
        self._release_after_step: list[int] = []  # left while their step was in flight

    # Sequences ---------------------------------------------------------------------------------

    def add(self, token_ids: list[int], params: SamplingParams, *, grammar: Any = None, grammar_utf8: Any = None,
            num_samples: int = 1,
            max_tokens: int | None = None, ignore_eos: bool | None = None, use_prefix_cache: bool = True,
            candidates: int = 0) -> int:
        """Queues a prompt; returns its sequence id. `num_samples` > 1 reserves the ids its other
        samples take when its first token fans out (the runner forks them), and the core keeps that
        many running slots for it until then. `max_tokens` and `ignore_eos` default to the params';
        `grammar_utf8`, `candidates`: see Admission. A sequence that reports
        candidates (beam search) never speculates: it chooses its tokens outside the sampler."""
        sid = self._ids.acquire()
        try:
            if max_tokens is None:  # the params', or (None) as many as max_model_len leaves room for
                max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
            self.core.add(sid, token_ids, max_tokens=max_tokens,
                          min_tokens=params.min_tokens, ignore_eos=params.ignore_eos if ignore_eos is None else ignore_eos,
                          stop_token_ids=params.stop_token_ids, use_prefix_cache=use_prefix_cache,
                          num_samples=num_samples)
            if candidates or (self._draft_model and params.seed is not None and params.temperature > GREEDY_EPS):
                # A drafted token is drawn from the request's generator, and how many drafts a
                # step takes depends on the batch (its size, the token budget left): a seeded
                # sampled request would repeat only beside the same requests. Without drafts it
                # samples as decoding without speculation does, whatever runs beside it.
                self.core.disable_spec(sid)
        except BaseException:
            self._ids.release(sid)
            raise
        children = tuple(self._ids.acquire() for _ in range(num_samples - 1))
        if children:
            self._reserved[sid] = children
        self._admitted[sid] = Admission(sid, params, token_ids, grammar, grammar_utf8, children, candidates)
        return sid

    def children(self, sid: int) -> tuple[int, ...]:
        """The ids reserved for a prompt's other samples, until its first token fans out."""
        return self._reserved.get(sid, ())

    def new_id(self) -> int:
        """An id for a sequence forked from outside the runner (beam search: postprocess(forks=))."""
        return self._ids.acquire()

    def abort(self, sid: int) -> None:
        """The sequence leaves now (aborted, or ended by a stop string or its grammar): its blocks are
        freed (at postprocess if its step is in flight), its sampling state goes with the next plan,
        and its id (and those reserved for its samples) is free again."""
        self.core.abort(sid)
        self._leave(sid)

    def _leave(self, sid: int) -> None:
        # The runner drops its state with the next plan, unless it never had it (admitted or
        # forked since the last plan).
        if self._admitted.pop(sid, None) is None:
            forked = [f for f in self._forked if f[1] != sid]
            if len(forked) < len(self._forked):
                self._forked = forked
            else:
                self._finished.append(sid)
        ids = [sid, *self._reserved.pop(sid, ())]
        if self.core.in_flight:
            self._release_after_step += ids
        else:
            for i in ids:
                self._ids.release(i)

    # The step ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = self.core.schedule()
        so = SchedulerOutput(plan, self._finished, list(self._admitted.values()), self._forked)
        if self._spec_disable_batch:
            so.propose_drafts = self.core.num_running + self.core.num_waiting < self._spec_disable_batch
        self._finished, self._admitted, self._forked = [], {}, []
        return so

    def postprocess(self, out: RunnerOutput, forks: Sequence[tuple[int, int, int]] = ()) -> list[Finished]:
        """Gives the core each row's token (and the runner's forks, plus `forks` decided outside
        the runner: their children's sampling state is forked with the next plan); returns the
        sequences the core finished (EOS, a stop id, max_tokens, max_model_len), whose ids are
        free again once the caller has recorded them."""
        if not (out.forks or forks or out.token_offsets is not None or out.drafts is not None):
            return self._after_step(self.core.postprocess(out.tokens))
        for parent, child, _ in out.forks:
            self._reserved.pop(parent, None)
        self._forked += [(parent, child, i + 1) for i, (parent, child, _) in enumerate(forks)]
        all_forks = [*out.forks, *forks]
        if out.token_offsets is None and out.drafts is None:
            return self._after_step(self.core.postprocess(out.tokens, forks=all_forks))
        offsets = out.offsets()
        finished, kept = self.core.postprocess_spec(out.tokens, offsets, forks=all_forks, drafts=out.drafts,
                                                    draft_offsets=out.draft_offsets)
        out.keep(kept)
        return self._after_step(finished)

    def fail_step(self) -> None:
        """The step in flight failed after schedule(): the core takes no tokens (its sequences were
        aborted by the caller) and is ready to schedule again."""
        if self.core.in_flight:
            self._after_step(self.core.postprocess(np.zeros(self.core.plan.num_samples, dtype=np.int32)))

    def _after_step(self, finished: list[Finished]) -> list[Finished]:
        for sid, _, _ in finished:
            self._leave(sid)
        if self._release_after_step:
            for sid in self._release_after_step:
                self._ids.release(sid)
            self._release_after_step = []
        return finished

    # State -------------------------------------------------------------------------------------

    @property
    def plan(self) -> _C.StepPlan:
        """The most recent plan (valid until the next schedule())."""
        return self.core.plan

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    @property
    def num_total_blocks(self) -> int:
        return self.core.num_total_blocks

    def take_first_hits(self) -> list[tuple[int, int]]:
        """(sequence id, prompt tokens the prefix cache held) of each sequence first scheduled since
        the last call (vLLM's num_cached_tokens)."""
        return self.core.take_first_hits()

    def stats(self) -> dict[str, int]:
        return dict(self.core.stats())
