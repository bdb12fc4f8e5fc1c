"""Beam search through the engine's public pieces: beams are scheduler sequences, so surviving
beams fork (sharing every block, copying only on write) and dropped beams free theirs at once;
memory follows the live beams.

Each step, every live beam's top 2 * beam_width next tokens (by the model's raw logprobs: vLLM's
LLM.beam_search reports and scores those whatever its temperature) become candidates, as there:
every candidate ending in EOS is complete (unless ignore_eos), whatever its rank; of the others,
per prompt the best beam_width by cumulative log-probability continue. Completed and live beams are ranked by cum_logprob /
len(tokens) ** length_penalty (EOS not counted). The step is the engine's (schedule, execute,
postprocess) with the choice of tokens and forks made here instead of by the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import numpy as np

from nanovllm.outputs import BeamSearchOutput, BeamSearchSequence, Logprob
from nanovllm.sampling_params import BeamSearchParams, SamplingParams
from nanovllm.worker.step import RunnerOutput

if TYPE_CHECKING:
    from nanovllm.engine.llm_engine import LLMEngine, PromptType


@dataclass
class _Beam:
    sid: int
    tokens: list[int]  # prompt + generated
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    finish_reason: str | None = None
    # (token, logprob) of its next-token candidates, best first, once sampled; kept until its group
    # decides.
    cands: list[tuple[int, float]] | None = None

    def step_logprobs(self) -> dict[int, Logprob]:
        """Its candidates as the step's logprobs entry of every continuation (vLLM's: the step's
        whole dict, ranks from 1)."""
        assert self.cands is not None
        return {tok: Logprob(lp, rank=r + 1) for r, (tok, lp) in enumerate(self.cands)}


@dataclass
class _Group:
    prompt_len: int
    live: dict[int, _Beam] = field(default_factory=dict)  # by sequence id
    done: list[_Beam] = field(default_factory=list)
    # Beams sampled before the rest of their group (token budget, max_num_seqs, preemption): out of
    # the core, candidates kept, until every live beam of the group has been sampled too.
    parked: list[_Beam] = field(default_factory=list)


def beam_score(beam: _Beam, eos: int | None, length_penalty: float) -> float:
    length = len(beam.tokens) - (1 if eos is not None and beam.tokens[-1] == eos else 0)
    return beam.cum_logprob / (max(length, 1) ** length_penalty)


def run_beam_search(engine: LLMEngine, prompts: list[PromptType], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """`engine` is an idle LLMEngine (beam search owns its scheduler while it runs)."""
    if engine.has_unfinished_requests():
        raise ValueError("beam search needs an idle engine; finish or abort the running requests first")
    search = _BeamSearch(engine, params)
    try:
        for prompt in prompts:
            _, ids = engine.tokenize_prompt(prompt)
            engine.check_prompt(ids)
            group = _Group(len(ids))
            search.add(group, _Beam(-1, list(ids), [], 0.0), params.max_tokens)
            search.groups.append(group)
        while any(g.live or g.parked for g in search.groups):
            search.step()
    except BaseException:
        search.abort_all()
        raise
    eos = search.eos
    outputs = []
    for g in search.groups:
        ranked = sorted(g.done, key=lambda b: beam_score(b, eos, params.length_penalty), reverse=True)
        seqs = [
            BeamSearchSequence(b.tokens, b.logprobs, b.cum_logprob,
                               engine.tokenizer.decode(b.tokens, skip_special_tokens=params.skip_special_tokens), b.finish_reason,
                               eos if b.finish_reason == "stop" else None)
            for b in ranked[: params.beam_width]
        ]
        outputs.append(BeamSearchOutput(seqs))
    return outputs


class _BeamSearch:
    def __init__(self, engine: LLMEngine, params: BeamSearchParams) -> None:
        self.engine, self.params = engine, params
        self.scheduler, self.executor = engine.scheduler, engine.executor
        self.eos = None if params.ignore_eos else engine.tokenizer.eos_token_id
        self.candidates = min(2 * params.beam_width, engine.vocab_size)
        # Greedy rows that report their candidates; EOS is handled here (a beam ending in EOS is
        # complete), so the core ignores it.
        self.seq_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True)
        self.groups: list[_Group] = []
        self.owner: dict[int, _Group] = {}

    def add(self, group: _Group, beam: _Beam, max_tokens: int) -> None:
        beam.sid = self.scheduler.add(beam.tokens, self.seq_params, max_tokens=max_tokens,
                                      candidates=self.candidates)
        group.live[beam.sid] = beam
        self.owner[beam.sid] = group

    def abort_all(self) -> None:
        for sid in list(self.owner):
            self.scheduler.abort(sid)
        self.scheduler.fail_step()  # interrupted mid-step: let the core release what it holds

    def step(self) -> None:
        params, owner, scheduler = self.params, self.owner, self.scheduler
        so = scheduler.schedule()
        scheduler.take_first_hits()  # beams are no request's: their prefix hits go unreported
        out = self.executor.execute(so)
        sids = out.seq_ids.tolist()
        if not sids:  # only prefill chunks this step
            scheduler.postprocess(out)
            return
        block = out.logprobs
        assert block is not None and out.logprob_seq_ids.tolist() == sids
        top_ids, top_lps = block.top_ids.tolist(), block.top_logprobs.tolist()
        for row, sid in enumerate(sids):
            owner[sid].live[sid].cands = sorted(zip(top_ids[row], top_lps[row]), key=lambda c: -c[1])
        sampled_groups = {id(owner[sid]): owner[sid] for sid in sids}
        # Beams advance in lockstep: a group decides only once all its live beams have candidates.
        # Sampled beams of a group still waiting on others leave the scheduler with their candidates.
        ready = {gid for gid, g in sampled_groups.items() if all(b.cands is not None for b in g.live.values())}
        for sid in sids:
            group = owner[sid]
            if id(group) not in ready:
                scheduler.abort(sid)
                group.parked.append(group.live.pop(sid))
                del owner[sid]

        # Per parent beam: the tokens its surviving continuations take.
        keep: dict[int, list[tuple[int, float, dict[int, Logprob]]]] = {sid: [] for sid in sids if sid in owner}
        readd: list[tuple[_Group, _Beam]] = []
        for gid in ready:
            group = sampled_groups[gid]
            parents = list(group.live.values()) + group.parked
            cands = [(b.cum_logprob + lp, i, tok, lp) for i, b in enumerate(parents) for tok, lp in b.cands]
            cands.sort(key=lambda c: c[0], reverse=True)
            entries = [b.step_logprobs() for b in parents]
            survivors = 0
            for cum, i, tok, lp in cands:
                ends = self.eos is not None and tok == self.eos
                if not ends and survivors == params.beam_width:
                    continue
                parent = parents[i]
                child = _Beam(-1, parent.tokens + [tok], parent.logprobs + [entries[i]], cum)
                if ends:  # complete, whatever its rank, and no live beam's place taken (as vLLM)
                    child.finish_reason = "stop"
                    group.done.append(child)
                    continue
                survivors += 1
                if parent.sid in keep and i < len(group.live):
                    keep[parent.sid].append((tok, lp, entries[i]))
                else:  # a parked parent: its continuation re-enters the scheduler after postprocess
                    readd.append((group, child))
            group.parked = []

        tokens = np.zeros(len(sids), dtype=np.int32)
        forks = []
        new_beams: list[_Beam] = []
        for row, sid in enumerate(sids):
            if sid not in keep:
                continue  # parked
            group = owner[sid]
            parent = group.live[sid]
            choices = keep[sid]
            if not choices:  # dropped: its blocks are freed by postprocess
                scheduler.abort(sid)
                del group.live[sid]
                del owner[sid]
                continue
            for i, (tok, lp, entry) in enumerate(choices):
                child_sid = sid if i == 0 else scheduler.new_id()
                if i == 0:
                    tokens[row] = tok
                else:
                    forks.append((sid, child_sid, tok))
                new_beams.append(_Beam(child_sid, parent.tokens + [tok], parent.logprobs + [entry],
                                       parent.cum_logprob + lp))
                owner[child_sid] = group
        for b in new_beams:
            owner[b.sid].live[b.sid] = b
        chosen = RunnerOutput(out.seq_ids, tokens)
        for sid, reason, _ in scheduler.postprocess(chosen, forks=forks):
            group = owner.pop(sid)
            beam = group.live.pop(sid)
            beam.finish_reason = reason
            group.done.append(beam)
        max_len = min(self.engine.max_model_len, scheduler.num_total_blocks * self.engine.config.block_size)
        for group, beam in readd:
            generated = len(beam.tokens) - group.prompt_len
            if generated >= params.max_tokens or len(beam.tokens) >= max_len:
                beam.finish_reason = "length"
                group.done.append(beam)
                continue
            self.add(group, beam, params.max_tokens - generated)
