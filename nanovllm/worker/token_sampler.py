"""The sampling side of a step on rank 0: from the model's hidden states to a RunnerOutput.

Per step: the plan's sampling-state changes are applied (`apply`: finished sequences dropped, new
ones admitted, outside forks copied), then `sample` takes the logits at the sampled positions,
masks them by the rows' grammars (in place: logprobs are of the masked distribution, as vLLM's),
runs the sampling state's processors (logit bias, penalties, min_tokens, bad words) and the sampler, and
brings the tokens back with their logprobs in one wait (nanovllm.staging). Prompt logprobs are
computed here too, for the prefill chunks of sequences that asked.

n > 1 lives here, whole: a prompt's admission names the ids of its other n - 1 samples; at its
first sample its logits row is repeated n times (one sampler pass, so a seeded prompt's n first
tokens come from its generator in order), the children's sampling rows are forked from it, and the
forks come back in RunnerOutput.forks for the scheduler (the core forks their blocks
copy-on-write) and the engine (their completions).

Speculative decoding (docs/design.md, "Speculative decoding"): a row with drafts is verified at
every position, in order: position j's logits are processed with the state its tokens before j
left (penalties, min_tokens, grammar), sampled as any row, and recorded; the row goes on to j + 1
only while its token equals its draft. For a draft that is a point mass (n-gram drafts, a greedy
request's draft-model drafts) this is Leviathan et al.'s rejection rule, and every emitted token is
the draw the same step without drafts would have taken: greedy and seeded outputs do not change.
A draft the draft model drew from its distribution q is kept with probability min(1, p / q) and
otherwise replaced by a draw from max(p - q, 0), p being the distribution the sampler draws from:
exact as well, and nearly every draft passes where the draft agrees with the model. Rows that
sample nothing and process nothing (greedy, no processors) are verified at once: argmax
everywhere, then the longest matching prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm._C import StepPlan, accept_greedy, verification_rows
from nanovllm.sample import Sampler, SamplingBatch, SamplingState, gather_logprobs
from nanovllm.sample.logprobs import LogprobBlock, logprob_columns, unpack_logprobs
from nanovllm.sample.sampler import exponential_race, filtered_probs
from nanovllm.sample.state import GrammarEnds
from nanovllm.staging import to_device, to_host
from nanovllm.worker.inference import inference
from nanovllm.worker.step import PromptLogprobRows, RunnerOutput, SchedulerOutput

LogitsFn = Callable[[torch.Tensor, torch.Tensor, "np.ndarray | None"], torch.Tensor]
GreedyFn = Callable[[torch.Tensor, torch.Tensor], "np.ndarray | None"]

_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_ROWS.flags.writeable = False


@dataclass
class _PromptLogprobs:
    wanted: int  # top-k alternatives per position
    prompt: list[int]
    done: int  # positions handed out; position 0 has none (None in the output)


class TokenSampler:
    def __init__(self, logits: LogitsFn, device: torch.device, vocab_size: int, eos_token_ids: Sequence[int],
                 max_rows: int, greedy: GreedyFn | None = None) -> None:
        """`logits(hidden, rows, host_rows)`: the fp32 logits of hidden-state rows (host_rows None:
        the step's sample indices). `max_rows`
        bounds the rows of one logits call beyond the step's samples (the memory profile
        reserved that many: max_num_seqs). `greedy(hidden, rows)`: the rows' argmax tokens without
        the logits, a host int32 array, or None where the model cannot give them so; asked first
        while no live sequence samples, wants logprobs or has a logits processor, and no prompt fans
        out."""
        self._logits = logits
        self._greedy = greedy
        self.device = device
        self.max_rows = max_rows
        self.state = SamplingState(device, vocab_size, list(eos_token_ids))
        self.sampler = Sampler()
        self._children: dict[int, tuple[int, ...]] = {}  # prompts whose first sample fans out
        self._prompt_logprobs: dict[int, _PromptLogprobs] = {}
        # A draft model's sampled drafts and the distributions they were drawn from, by sequence,
        # for the step that verifies them (worker/draft_proposer.py).
        self.draft_probs: dict[int, tuple[np.ndarray, torch.Tensor]] = {}

    def apply(self, so: SchedulerOutput) -> None:
        """The plan's sampling-state changes: forks first (a parent may end in the same step as it
        forked), then the finished sequences, then the new ones (an id may be reused at once)."""
        state = self.state
        for parent, child, index in so.forked:
            state.fork(parent, child, index)
        for sid in so.finished:
            state.remove(sid)
            self.draft_probs.pop(sid, None)
            self._children.pop(sid, None)
            self._prompt_logprobs.pop(sid, None)
        for a in so.admitted:
            state.add(a.seq_id, a.params, a.prompt_token_ids, a.grammar, logprobs=a.candidates or None,
                      grammar_utf8=a.grammar_utf8)
            if a.children:
                self._children[a.seq_id] = a.children
            if a.params.prompt_logprobs is not None:
                self._prompt_logprobs[a.seq_id] = _PromptLogprobs(a.params.prompt_logprobs, a.prompt_token_ids, 1)

    @inference
    def sample(self, plan: StepPlan, hidden: torch.Tensor, sample_indices: torch.Tensor) -> RunnerOutput:
        prompt_logprobs = self._prompt_rows(plan, hidden) if self._prompt_logprobs else None
        sids = plan.sampled_seq_ids.copy()
        if not len(sids):
            out = RunnerOutput.empty()
            out.prompt_logprobs = prompt_logprobs
            return out
        if plan.num_draft_tokens:
            out = self._verify(plan, hidden, sids)
            out.prompt_logprobs = prompt_logprobs
            return out
        state = self.state
        if self._greedy is not None and not (state.users.sampled or state.users.processed or state.users.logprobs
                                             or self._children):
            host = self._greedy(hidden, sample_indices)
            if host is not None:  # the same tokens as the sampler's argmax of the logits below, on the host
                return RunnerOutput(sids, host, None, [], None, _NO_ROWS, state.record(sids, None, host),
                                    prompt_logprobs)
        raw = self._logits(hidden, sample_indices, None)
        rows, raw, repeats = self._fan_rows(sids, raw) if self._children else (sids, raw, None)
        lp_rows, wanted = _NO_ROWS, _NO_ROWS
        if state.users.logprobs:
            wanted = state.rows.logprobs[rows]
            lp_rows = np.flatnonzero(wanted >= 0)
        state.mask_grammars(raw, rows)
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
        return RunnerOutput(sids, first, None, forks, logprobs, rows[lp_rows] if logprobs is not None else _NO_ROWS,
                            ends, prompt_logprobs)

    def _verify(self, plan: StepPlan, hidden: torch.Tensor, sids: np.ndarray) -> RunnerOutput:
        """A step with drafts: every row's tokens, its accepted drafts then one more."""
        state = self.state
        num_drafts = plan.num_drafts
        positions, draft_at = verification_rows(num_drafts, plan.sample_indices, plan.input_ids)
        raw = self._logits(hidden, to_device(positions, hidden.device), positions)
        drafts = num_drafts.astype(np.int64)
        first = np.cumsum(drafts + 1) - (drafts + 1)  # each row's first logits row
        fan = [int(s) for s in sids if int(s) in self._children] if self._children else []
        if not (state.users.sampled or state.users.processed or fan):
            host, = to_host(self.sampler(raw, None))
            tokens_out, offsets, keep = accept_greedy(host, draft_at, num_drafts)
            out = RunnerOutput(sids, tokens_out, offsets, [], grammar_ends=GrammarEnds())
        else:
            out, keep = self._verify_sampled(sids, raw, drafts, first, draft_at, fan)
        if state.users.logprobs:
            self._verified_logprobs(out, raw, keep, first)
        return out

    def _verify_sampled(self, sids: np.ndarray, raw: torch.Tensor, drafts: np.ndarray, first: np.ndarray,
                        draft_at: np.ndarray, fan: list[int]) -> tuple[RunnerOutput, np.ndarray]:
        """Verification through the sampler, position after position, for rows that sample, take
        processed logits or fan out: (the output, each emitted token's logits row)."""
        emitted = np.full(len(draft_at), -1, dtype=np.int64)
        ends = GrammarEnds()
        forks: list[tuple[int, int, int]] = []
        alive = np.arange(len(sids))
        q_of = self._draft_distributions(sids, drafts, first, draft_at)
        for j in range(int(drafts.max()) + 1):
            idx = first[alive] + j
            rows = sids[alive]
            with_q = [(i, q_of[r][j]) for i, r in enumerate(alive.tolist()) if r in q_of and j < drafts[r]]
            at = to_device(idx, raw.device)
            position = raw[at]
            if self.state.mask_grammars(position, rows):  # kept in raw too: logprobs are of the masked rows
                raw[at] = position
            host, step_ends, forks_j = self._draw(position, rows, fan if j == 0 else [], with_q, draft_at[idx])
            forks += forks_j
            emitted[idx] = host
            ends.terminated += step_ends.terminated
            ends.rejected += step_ends.rejected
            stopped = np.isin(rows, step_ends.terminated + step_ends.rejected) if step_ends.terminated or \
                step_ends.rejected else np.zeros(len(rows), dtype=bool)
            alive = alive[(host == draft_at[idx]) & ~stopped]
            if not len(alive):
                break
        keep = np.flatnonzero(emitted >= 0)
        row_of = np.repeat(np.arange(len(sids)), drafts + 1)
        offsets = np.zeros(len(sids) + 1, dtype=np.int32)
        np.cumsum(np.bincount(row_of[keep], minlength=len(sids)), out=offsets[1:])
        return RunnerOutput(sids, emitted[keep].astype(np.int32), offsets, forks, grammar_ends=ends), keep

    def _draft_distributions(self, sids: np.ndarray, drafts: np.ndarray, first: np.ndarray,
                             draft_at: np.ndarray) -> dict[int, torch.Tensor]:
        """By row: the draft model's distributions of the row's drafts, where it drew them (a
        sampled row), and only if they are the drafts the plan holds (else they are verified as
        point masses, which is exact too)."""
        q_of = {}
        for r, sid in enumerate(sids.tolist()):
            entry = self.draft_probs.pop(sid, None)
            d = int(drafts[r])
            if entry is None or d == 0 or len(entry[0]) < d:
                continue
            if np.array_equal(entry[0][:d], draft_at[first[r]:first[r] + d]):
                q_of[r] = entry[1]
        return q_of

    def _draw(self, raw: torch.Tensor, rows: np.ndarray, fan: list[int], with_q: list[tuple[int, torch.Tensor]],
              draft_tokens: np.ndarray) -> tuple[np.ndarray, GrammarEnds, list[tuple[int, int, int]]]:
        """One verification position: rows' logits (a copy, processed in place) -> their tokens,
        recorded. `fan`: rows whose prompt fans out into n samples here (position 0 only).
        `with_q`: (row, the draft model's distribution q) of rows whose draft (`draft_tokens[row]`)
        was drawn from q: accepted with probability min(1, p / q), else replaced by a draw from
        max(p - q, 0)."""
        sample_rows, raw, repeats = self._fan_rows(rows, raw) if fan else (rows, raw, None)
        processed = self.state.process(raw, sample_rows, keep_input=False)
        batch = self.state.batch(sample_rows)
        tokens = self.sampler(processed, batch)
        if with_q:
            assert batch is not None, "only sampled rows draw their drafts"
            at = np.array([i for i, _ in with_q]) if repeats is None else \
                (np.cumsum(repeats) - repeats)[[i for i, _ in with_q]]
            tokens = tokens.index_copy(0, to_device(at, tokens.device), self._rejection_sample(
                processed, batch, at, draft_tokens[[i for i, _ in with_q]], torch.stack([q for _, q in with_q])))
        host, = to_host(tokens)
        host = host.astype(np.int64)
        forks: list[tuple[int, int, int]] = []
        if repeats is not None:
            starts = np.cumsum(repeats) - repeats
            forks = self._fan_out(rows, repeats, starts, sample_rows, host)
            ends = self.state.record(sample_rows, tokens, host)
            return host[starts], ends, forks
        return host, self.state.record(sample_rows, tokens, host), forks

    def _rejection_sample(self, processed: torch.Tensor, batch: SamplingBatch, at: np.ndarray, drafts: np.ndarray,
                          q: torch.Tensor) -> torch.Tensor:
        """Rows `at` of a position: each draft kept with probability min(1, p(d) / q(d)), else a
        draw from the residual max(p - q, 0) (never d); p is the distribution the sampler draws
        from. Seeded rows draw from their own generators."""
        dev = processed.device
        idx = to_device(at, dev)
        gens = {j: batch.generators[int(r)] for j, r in enumerate(at.tolist()) if int(r) in batch.generators}
        sub = SamplingBatch(batch.temperatures[at], batch.top_k[at], batch.top_p[at], batch.min_p[at], gens)
        p = filtered_probs(processed[idx], sub)
        q = q.to(dev)
        d = to_device(drafts.astype(np.int64), dev)[:, None]
        uniform = torch.rand(len(at), device=dev, dtype=torch.float64)
        for j, gen in gens.items():
            uniform[j] = torch.rand(1, generator=gen, device=dev, dtype=torch.float64)
        accept = uniform * q.gather(1, d).squeeze(1).double() < p.gather(1, d).squeeze(1).double()
        residual = (p - q).clamp_min_(0.0)
        return torch.where(accept, d.squeeze(1), exponential_race(residual, gens))

    def _verified_logprobs(self, out: RunnerOutput, raw: torch.Tensor, keep: np.ndarray, first: np.ndarray) -> None:
        """Logprobs of every emitted token (from its position's raw logits, `keep`: their rows), and of
        fanned-out children's first tokens, for the sequences that asked."""
        assert out.token_offsets is not None
        emitted_by = np.repeat(out.seq_ids, np.diff(out.token_offsets))
        sids = np.concatenate([emitted_by, [c for _, c, _ in out.forks]]).astype(np.int64)
        logit_rows = np.concatenate([keep, [first[np.flatnonzero(out.seq_ids == p)[0]] for p, _, _ in out.forks]])
        chosen = np.concatenate([out.tokens, [t for _, _, t in out.forks]]).astype(np.int64)
        wanted = self.state.rows.logprobs[sids]
        asked = np.flatnonzero(wanted >= 0)
        if not len(asked):
            return
        lp_raw = raw[to_device(logit_rows[asked].astype(np.int64), raw.device)]
        out.logprobs = gather_logprobs(lp_raw, to_device(chosen[asked], raw.device), wanted[asked])
        out.logprob_seq_ids = sids[asked]

    def _fan_rows(self, sids: np.ndarray, raw: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, np.ndarray | None]:
        """A prompt whose first sample fans out takes 1 + its children's rows: (the rows' sequences,
        their logits, the repeats; None when no row fans out)."""
        repeats = np.array([1 + len(self._children.get(int(s), ())) for s in sids])
        if not (repeats > 1).any():
            return sids, raw, None
        # An index gather with a host-built index (repeat_interleave would read the repeats' sum back).
        return np.repeat(sids, repeats), raw.index_select(0, to_device(np.repeat(np.arange(len(sids)), repeats),
                                                                        raw.device)), repeats

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
