"""The sampling side of a step on rank 0: from the model's hidden states to a RunnerOutput.

Per step: the plan's sampling-state changes are applied (`apply`: finished sequences dropped, new
ones admitted, outside forks copied), then `sample` takes the logits at the sampled positions, runs
the sampling state's processors (penalties, logit bias, min_tokens, grammars) and the sampler, and
brings the tokens back with their logprobs in one wait (nanovllm.staging). Prompt logprobs are
computed here too, for the prefill chunks of sequences that asked.

n > 1 lives here, whole: a prompt's admission names the ids of its other n - 1 samples; at its
first sample its logits row is repeated n times (one sampler pass, so a seeded prompt's n first
tokens come from its generator in order), the children's sampling rows are forked from it, and the
forks come back in RunnerOutput.forks for the scheduler (the core forks their blocks
copy-on-write) and the engine (their completions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm._C import StepPlan
from nanovllm.sample import Sampler, SamplingState, gather_logprobs
from nanovllm.sample.logprobs import LogprobBlock, logprob_columns, unpack_logprobs
from nanovllm.staging import to_device, to_host
from nanovllm.worker.step import PromptLogprobRows, RunnerOutput, SchedulerOutput

LogitsFn = Callable[[torch.Tensor, torch.Tensor, np.ndarray], torch.Tensor]

_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_ROWS.flags.writeable = False


@dataclass
class _PromptLogprobs:
    wanted: int  # top-k alternatives per position
    prompt: list[int]
    done: int  # positions handed out; position 0 has none (None in the output)


class TokenSampler:
    def __init__(self, logits: LogitsFn, device: torch.device, vocab_size: int, eos_token_ids: Sequence[int],
                 max_rows: int) -> None:
        """`logits(hidden, rows, host_rows)`: the fp32 logits of hidden-state rows. `max_rows`
        bounds the rows of one logits call beyond the step's samples (the memory profile
        reserved that many: max_num_seqs)."""
        self._logits = logits
        self.device = device
        self.max_rows = max_rows
        self.state = SamplingState(device, vocab_size, list(eos_token_ids))
        self.sampler = Sampler()
        self._children: dict[int, tuple[int, ...]] = {}  # prompts whose first sample fans out
        self._prompt_logprobs: dict[int, _PromptLogprobs] = {}
        self._logprob_scale: dict[int, float] = {}  # 1 / Admission.logprob_temperature

    def apply(self, so: SchedulerOutput) -> None:
        """The plan's sampling-state changes: forks first (a parent may end in the same step as it
        forked), then the finished sequences, then the new ones (an id may be reused at once)."""
        state = self.state
        for parent, child, index in so.forked:
            state.fork(parent, child, index)
            if parent in self._logprob_scale:
                self._logprob_scale[child] = self._logprob_scale[parent]
        for sid in so.finished:
            state.remove(sid)
            self._children.pop(sid, None)
            self._prompt_logprobs.pop(sid, None)
            self._logprob_scale.pop(sid, None)
        for a in so.admitted:
            state.add(a.seq_id, a.params, a.prompt_token_ids, a.grammar, logprobs=a.candidates or None,
                      grammar_utf8=a.grammar_utf8)
            if a.children:
                self._children[a.seq_id] = a.children
            if a.logprob_temperature > 0:
                self._logprob_scale[a.seq_id] = 1.0 / a.logprob_temperature
            if a.params.prompt_logprobs is not None:
                self._prompt_logprobs[a.seq_id] = _PromptLogprobs(a.params.prompt_logprobs, a.prompt_token_ids, 1)

    @torch.inference_mode()
    def sample(self, plan: StepPlan, hidden: torch.Tensor, sample_indices: torch.Tensor) -> RunnerOutput:
        prompt_logprobs = self._prompt_rows(plan, hidden) if self._prompt_logprobs else None
        sids = plan.sampled_seq_ids.copy()
        if not len(sids):
            out = RunnerOutput.empty()
            out.prompt_logprobs = prompt_logprobs
            return out
        raw = self._logits(hidden, sample_indices, plan.sample_indices)
        rows, repeats = sids.astype(np.int64), None
        if self._children:
            repeats = np.array([1 + len(self._children.get(int(s), ())) for s in sids])
            if (repeats > 1).any():
                # Row i of the fan-out is sample position fan_rows[i]; an index gather with a
                # host-built index (repeat_interleave would read the repeats' sum back).
                rows = np.repeat(rows, repeats)
                raw = raw.index_select(0, to_device(np.repeat(np.arange(len(sids)), repeats), raw.device))
            else:
                repeats = None
        state = self.state
        lp_rows, wanted = _NO_ROWS, _NO_ROWS
        if state.users.logprobs:
            wanted = state.rows.logprobs[rows]
            lp_rows = np.flatnonzero(wanted >= 0)
        processed = state.process(raw, rows, keep_input=len(lp_rows) > 0)
        tokens = self.sampler(processed, state.batch(rows))
        logprobs = None
        if not len(lp_rows):
            host, = to_host(tokens)
        else:
            lp_raw, lp_tokens = raw, tokens
            if len(lp_rows) < len(rows):  # gather only when some rows did not ask
                idx = to_device(lp_rows, raw.device)
                lp_raw, lp_tokens, wanted = raw[idx], tokens[idx], wanted[lp_rows]
            if self._logprob_scale:
                scale = np.array([self._logprob_scale.get(int(s), 1.0) for s in rows[lp_rows]], dtype=np.float32)
                lp_raw = lp_raw * to_device(scale, raw.device)[:, None]
            if lp_raw.device.type == "cpu":
                logprobs = gather_logprobs(lp_raw, lp_tokens, wanted)
                host, = to_host(tokens)
            else:  # the step's one wait, for the tokens and their logprobs together
                host, columns = to_host(tokens, logprob_columns(lp_raw, lp_tokens, int(wanted.max())))
                logprobs = unpack_logprobs(columns, wanted)
        host = host.astype(np.int32)
        forks: list[tuple[int, int, int]] = []
        first = host
        if repeats is not None:
            starts = np.cumsum(repeats) - repeats
            first = host[starts]
            forks = self._fan_out(sids, repeats, starts, rows, host)
        ends = state.record(rows, tokens, host)
        return RunnerOutput(sids, np.arange(len(sids) + 1, dtype=np.int32), first, forks, logprobs,
                            rows[lp_rows], ends, prompt_logprobs)

    def _fan_out(self, sids: np.ndarray, repeats: np.ndarray, starts: np.ndarray, rows: np.ndarray,
                 tokens: np.ndarray) -> list[tuple[int, int, int]]:
        """The rows after the first of a fanning prompt become its children (in `rows`, in place),
        each forked from the prompt's sampling row before this step's tokens are recorded."""
        forks = []
        for i in np.flatnonzero(repeats > 1).tolist():
            parent = int(sids[i])
            for index, child in enumerate(self._children.pop(parent), start=1):
                r = starts[i] + index
                self.state.fork(parent, child, index=index)
                forks.append((parent, child, int(tokens[r])))
                rows[r] = child
        return forks

    def _prompt_rows(self, plan: StepPlan, hidden: torch.Tensor) -> PromptLogprobRows | None:
        """Logprobs of each prompt token given the ones before it, as its chunk is computed;
        positions handed out before (a recompute after preemption) are skipped."""
        seq_ids, cu_q, positions = plan.seq_ids, plan.cu_seqlens_q, plan.positions
        flat: list[int] = []
        owners: list[int] = []
        targets: list[int] = []
        for sid, p in self._prompt_logprobs.items():
            match = np.flatnonzero(seq_ids == sid)
            if not len(match):
                continue
            row = int(match[0])
            for i in range(int(cu_q[row]), int(cu_q[row + 1])):
                target = int(positions[i]) + 1
                if p.done <= target < len(p.prompt):
                    flat.append(i)
                    owners.append(sid)
                    targets.append(target)
                    p.done = target + 1
        if not flat:
            return None
        # A step may hold thousands of prompt tokens: full-vocab logits for all of them at once would
        # far exceed what the memory profile reserved (logits for max_num_seqs rows): slices.
        refs: list[tuple[LogprobBlock, int]] = []
        for lo in range(0, len(flat), self.max_rows):
            host = np.asarray(flat[lo:lo + self.max_rows], dtype=np.int64)
            part = list(zip(owners[lo:lo + self.max_rows], targets[lo:lo + self.max_rows]))
            wanted = np.array([self._prompt_logprobs[s].wanted for s, _ in part], dtype=np.int64)
            chosen = to_device([self._prompt_logprobs[s].prompt[t] for s, t in part], hidden.device, np.int64)
            block = gather_logprobs(self._logits(hidden, to_device(host, hidden.device), host), chosen, wanted)
            refs += [(block, i) for i in range(len(part))]
        return PromptLogprobRows(refs, np.asarray(owners, dtype=np.int64), np.asarray(targets, dtype=np.int64))
