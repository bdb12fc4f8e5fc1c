"""Beam search over the engine's core: beams are core sequences, so surviving beams fork
(sharing every block, copying only on write) and dropped beams free theirs at once; memory
follows the live beams.

Each step, every live beam's top 2 * beam_width next tokens become candidates; per prompt the
best beam_width candidates by cumulative log-probability survive. A candidate ending in EOS is
complete (unless ignore_eos); the others continue. Completed beams are ranked by
cum_logprob / len(tokens) ** length_penalty (EOS not counted), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from nanovllm.outputs import BeamSearchOutput, BeamSearchSequence, Logprob
from nanovllm.sampling_params import BeamSearchParams
from nanovllm.staging import to_host


@dataclass
class _Beam:
    sid: int
    tokens: list[int]  # prompt + generated
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float
    finish_reason: str | None = None
    # (token, logprob) of its next-token candidates, once sampled; kept until its group decides.
    cands: list[tuple[int, float]] | None = None


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


def run_beam_search(engine, prompts: list, params: BeamSearchParams) -> list[BeamSearchOutput]:  # noqa: ANN001
    """`engine` is an idle LLMEngine (beam search owns the core while it runs)."""
    if engine.has_unfinished_requests():
        raise ValueError("beam search needs an idle engine; finish or abort the running requests first")
    core, runner = engine.core, engine.runner
    eos = None if params.ignore_eos else engine.tokenizer.eos_token_id
    groups: list[_Group] = []
    owner: dict[int, _Group] = {}
    try:
        for prompt in prompts:
            _, ids = engine.tokenize_prompt(prompt)
            sid = engine._seq_ids.acquire()
            try:
                # EOS is handled here (a beam ending in EOS is complete), so the core ignores it.
                core.add(sid, ids, max_tokens=params.max_tokens, ignore_eos=True)
            except ValueError:
                engine._seq_ids.release(sid)
                raise
            group = _Group(len(ids))
            group.live[sid] = _Beam(sid, list(ids), [], 0.0)
            groups.append(group)
            owner[sid] = group
        while any(g.live or g.parked for g in groups):
            _step(engine, core, runner, params, eos, owner)
    except BaseException:
        for sid in list(owner):
            core.abort(sid)
            engine._seq_ids.release(sid)
        if core.in_flight:  # interrupted mid-step: let the core release what it holds
            core.postprocess(np.zeros(core.plan.num_samples, dtype=np.int32))
        raise
    outputs = []
    for g in groups:
        ranked = sorted(g.done, key=lambda b: beam_score(b, eos, params.length_penalty), reverse=True)
        seqs = [
            BeamSearchSequence(b.tokens, b.logprobs, b.cum_logprob,
                               engine.tokenizer.decode(b.tokens, skip_special_tokens=True), b.finish_reason,
                               eos if b.finish_reason == "stop" else None)
            for b in ranked[: params.beam_width]
        ]
        outputs.append(BeamSearchOutput(seqs))
    return outputs


def _step(engine, core, runner, params: BeamSearchParams, eos: int | None,  # noqa: ANN001
          owner: dict[int, _Group]) -> None:
    plan = core.schedule()
    sids = plan.sampled_seq_ids.tolist()
    v, hidden = runner.forward(plan)
    if not sids:  # only prefill chunks this step
        core.postprocess(np.empty(0, dtype=np.int32))
        return
    logits = runner.logits(hidden, v.sample_indices)
    if params.temperature > 0:
        logits = logits / params.temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    k = min(2 * params.beam_width, logprobs.shape[1])
    top_lp, top_ids = (a.tolist() for a in to_host(*logprobs.topk(k, dim=-1)))

    for row, sid in enumerate(sids):
        owner[sid].live[sid].cands = list(zip(top_ids[row], top_lp[row]))
    sampled_groups = {id(owner[sid]): owner[sid] for sid in sids}
    # Beams advance in lockstep: a group decides only once all its live beams have candidates.
    # Sampled beams of a group still waiting on others leave the core with their candidates.
    ready = {gid for gid, g in sampled_groups.items() if all(b.cands is not None for b in g.live.values())}
    parked_sids: list[int] = []
    for sid in sids:
        group = owner[sid]
        if id(group) not in ready:
            core.abort(sid)
            group.parked.append(group.live.pop(sid))
            del owner[sid]
            parked_sids.append(sid)

    # Per parent beam: the tokens its surviving continuations take.
    keep: dict[int, list[tuple[int, float]]] = {sid: [] for sid in sids if sid in owner}
    readd: list[tuple[_Group, _Beam]] = []
    for gid in ready:
        group = sampled_groups[gid]
        parents = list(group.live.values()) + group.parked
        cands = [(b.cum_logprob + lp, i, tok, lp) for i, b in enumerate(parents) for tok, lp in b.cands]
        cands.sort(key=lambda c: c[0], reverse=True)
        for cum, i, tok, lp in cands[: params.beam_width]:
            parent = parents[i]
            child = _Beam(-1, parent.tokens + [tok], parent.logprobs + [{tok: Logprob(lp)}], cum)
            if eos is not None and tok == eos:
                child.finish_reason = "stop"
                group.done.append(child)
            elif parent.sid in keep and i < len(group.live):
                keep[parent.sid].append((tok, lp))
            else:  # a parked parent: its continuation re-enters the core after postprocess
                readd.append((group, child))
        group.parked = []

    first_tokens = np.zeros(len(sids), dtype=np.int32)
    forks = []
    dropped = []
    new_beams: list[_Beam] = []
    for row, sid in enumerate(sids):
        if sid not in keep:
            continue  # parked
        group = owner[sid]
        parent = group.live[sid]
        choices = keep[sid]
        if not choices:  # dropped: its blocks are freed by postprocess
            core.abort(sid)
            del group.live[sid]
            del owner[sid]
            dropped.append(sid)
            continue
        for i, (tok, lp) in enumerate(choices):
            child_sid = sid if i == 0 else engine._seq_ids.acquire()
            if i == 0:
                first_tokens[row] = tok
            else:
                forks.append((sid, child_sid, tok))
            new_beams.append(_Beam(child_sid, parent.tokens + [tok], parent.logprobs + [{tok: Logprob(lp)}],
                                   parent.cum_logprob + lp))
            owner[child_sid] = group
    for b in new_beams:
        owner[b.sid].live[b.sid] = b
    finished = core.postprocess(first_tokens, forks=forks)
    # Ids are recycled only now: the core held the dropped sequences until postprocess.
    for sid in dropped + parked_sids:
        engine._seq_ids.release(sid)
    for sid, reason, _ in finished:
        group = owner.pop(sid)
        beam = group.live.pop(sid)
        beam.finish_reason = reason
        group.done.append(beam)
        engine._seq_ids.release(sid)
    max_len = min(engine.max_model_len, core.num_total_blocks * engine.config.block_size)
    for group, beam in readd:
        generated = len(beam.tokens) - group.prompt_len
        if generated >= params.max_tokens or len(beam.tokens) >= max_len:
            beam.finish_reason = "length"
            group.done.append(beam)
            continue
        beam.sid = engine._seq_ids.acquire()
        try:
            core.add(beam.sid, beam.tokens, max_tokens=params.max_tokens - generated, ignore_eos=True)
        except BaseException:
            engine._seq_ids.release(beam.sid)
            raise
        group.live[beam.sid] = beam
        owner[beam.sid] = group
