"""A hypothesis state machine over the core: add (often sharing prefixes), fork (between steps
and within postprocess), abort, schedule and postprocess in random interleavings, checking the
core's invariants after every operation against a Python model of each sequence and of the KV
cache contents. With speculative decoding (n-gram drafts, or drafts handed in as a draft model
does), postprocess accepts a random prefix of each row's drafts: rejected positions must never
read as computed, and n-gram drafts must be what the reference proposer finds."""

import math

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanovllm import _C

EOS = 1
VOCAB = 12
PREFIXES = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 3], [5, 5, 5, 5, 2, 2], []]


class CoreMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(min_value=6, max_value=40),
        budget=st.integers(min_value=1, max_value=24),
        max_num_seqs=st.integers(min_value=1, max_value=6),
        prefix_caching=st.booleans(),
        spec=st.sampled_from(["none", "ngram", "external"]),
        k=st.integers(1, 4),
        lookup=st.sampled_from([(1, 1), (1, 3), (2, 4)]),
    )
    def setup(self, block_size: int, num_blocks: int, budget: int, max_num_seqs: int, prefix_caching: bool,
              spec: str, k: int, lookup: tuple[int, int]) -> None:
        self.bs = block_size
        self.spec, self.k, self.lookup = spec, k, lookup
        self.handed: dict[int, list[int]] = {}  # external drafts handed in for each sequence's next step
        self.num_blocks = num_blocks
        self.max_model_len = 24
        self.core = _C.Scheduler(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            enable_prefix_caching=prefix_caching,
            eos_token_ids=[EOS],
            vocab_size=VOCAB,
            spec_method=spec,
            num_speculative_tokens=k if spec != "none" else 0,
            prompt_lookup_min=lookup[0],
            prompt_lookup_max=lookup[1],
        )
        self.tokens: dict[int, list[int]] = {}  # the model of every live sequence
        self.next_id = 0
        self.plan: _C.StepPlan | None = None
        self.in_batch: set[int] = set()
        # Simulated KV cache: per slot, a fingerprint of the full prefix whose last token it holds.
        self.kv: list[int | None] = [None] * (num_blocks * block_size)

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=10),
          max_tokens=st.integers(1, 8), ignore_eos=st.booleans())
    def add(self, prefix: list[int], tail: list[int], max_tokens: int, ignore_eos: bool) -> None:
        prompt = (prefix + tail)[: self.max_model_len]
        sid = self.next_id
        self.next_id += 1
        if len(prompt) > self.num_blocks * self.bs:
            try:
                self.core.add(sid, prompt, max_tokens=max_tokens)
            except ValueError:
                return
            raise AssertionError("a prompt larger than the pool was accepted")
        self.core.add(sid, prompt, max_tokens=max_tokens, ignore_eos=ignore_eos)
        self.tokens[sid] = list(prompt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        candidates = sorted(set(self.tokens) - self.in_batch)
        if not candidates:
            return
        parent = data.draw(st.sampled_from(candidates))
        child = self.next_id
        self.next_id += 1
        self.core.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.core.abort(sid)
        if sid not in self.in_batch:
            del self.tokens[sid]
        else:
            self.aborted_in_flight.add(sid)

    @precondition(lambda self: self.plan is None)
    @rule()
    def schedule(self) -> None:
        plan = self.core.schedule()
        self.plan = plan
        self.aborted_in_flight: set[int] = set()
        n, s = plan.num_tokens, plan.num_seqs
        seq_ids = plan.seq_ids.tolist()
        assert len(set(seq_ids)) == s
        self.in_batch = set(seq_ids)
        cu_q, cu_k, ctx = plan.cu_seqlens_q, plan.cu_seqlens_k, plan.context_lens
        assert cu_q[0] == 0 and cu_q[-1] == n and (np.diff(cu_q) >= 1).all()
        assert cu_k[0] == 0 and (np.diff(cu_k) == ctx).all()
        q_lens = np.diff(cu_q)
        assert plan.max_seqlen_q == (q_lens.max() if s else 0)
        assert plan.max_seqlen_k == (ctx.max() if s else 0)
        assert plan.num_decode_tokens + plan.num_prefill_tokens == n
        assert (q_lens[: plan.num_decode_seqs] == 1).all() and (q_lens[plan.num_decode_seqs :] > 1).all()
        slots = plan.slot_mapping.tolist()
        assert len(set(slots)) == n, "a slot appears twice in one plan"
        # Copy-on-write copies happen before the forward.
        for src, dst in plan.block_copies.tolist():
            b = self.bs
            self.kv[dst * b : (dst + 1) * b] = self.kv[src * b : (src + 1) * b]
        sampled = []
        self.drafts: dict[int, list[int]] = {}
        for row, sid in enumerate(seq_ids):
            toks = self.tokens[sid]
            table = self.core.block_table(sid)
            assert plan.block_tables[row].tolist() == table + [-1] * (plan.max_blocks_per_seq - len(table))
            # A draft model's rows hold lookahead slots past their tokens.
            assert len(table) == math.ceil(ctx[row] / self.bs) or \
                (self.spec == "external" and len(table) <= math.ceil((ctx[row] + self.k) / self.bs))
            start = int(ctx[row] - (cu_q[row + 1] - cu_q[row]))  # the row's first position
            drafts = [int(t) for t in plan.input_ids[cu_q[row] + len(toks) - start : cu_q[row + 1]]] \
                if ctx[row] > len(toks) else []
            full = toks + drafts
            for i in range(cu_q[row], cu_q[row + 1]):
                pos = int(plan.positions[i])
                assert pos == ctx[row] - (cu_q[row + 1] - i)
                assert plan.input_ids[i] == full[pos]
                assert slots[i] // self.bs == table[pos // self.bs], "slot outside the sequence's own block"
                assert slots[i] % self.bs == pos % self.bs
                self.kv[slots[i]] = hash(tuple(full[: pos + 1]))
            if ctx[row] - len(drafts) == len(toks):
                sampled.append(sid)
                self.drafts[sid] = drafts
                if drafts:
                    assert cu_q[row + 1] - cu_q[row] == 1 + len(drafts), "drafts only on decode rows"
                    assert len(drafts) <= self.k
                    reference = ngram_proposal(toks, *self.lookup, len(drafts)) if self.spec == "ngram" \
                        else self.handed[sid]
                    assert drafts == reference[: len(drafts)], "not the proposer's drafts"
            else:
                assert not drafts
        assert plan.sampled_seq_ids.tolist() == sampled
        assert plan.num_drafts.tolist() == [len(self.drafts[sid]) for sid in sampled]
        assert plan.num_draft_tokens == sum(plan.num_drafts.tolist())
        assert plan.sample_indices.tolist() == [int(cu_q[seq_ids.index(sid) + 1]) - 1 for sid in sampled]
        assert plan.num_copies <= s

    @precondition(lambda self: self.plan is not None)
    @rule(data=st.data())
    def postprocess(self, data: st.DataObject) -> None:
        plan = self.plan
        sampled = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=plan.num_samples, max_size=plan.num_samples))
        if self.spec != "none":
            return self.postprocess_spec(data, sampled)
        # Parallel samples / beams: some sampled parents fork children that take other tokens.
        forkable = [sid for sid in plan.sampled_seq_ids.tolist() if sid not in self.aborted_in_flight]
        forks = []
        for parent in data.draw(st.lists(st.sampled_from(forkable), max_size=3)) if forkable else []:
            forks.append((parent, self.next_id, data.draw(st.integers(0, VOCAB - 1))))
            self.next_id += 1
        parent_tokens = {sid: list(self.tokens[sid]) for sid in forkable}
        finished = self.core.postprocess(np.array(sampled, dtype=np.int32), forks=forks)
        for sid, tok in zip(plan.sampled_seq_ids.tolist(), sampled):
            if sid in self.tokens and sid not in self.aborted_in_flight:
                self.tokens[sid].append(tok)
        self.end_step(forks, parent_tokens, finished)

    def postprocess_spec(self, data: st.DataObject, last: list[int]) -> None:
        """Each row takes a random prefix of its drafts, then one more token (`last`); a draft model's
        next drafts are handed in; parents without drafts may fork."""
        plan = self.plan
        sids = plan.sampled_seq_ids.tolist()
        rows = []
        for sid, tok in zip(sids, last):
            drafts = self.drafts[sid]
            rows.append(drafts[: data.draw(st.integers(0, len(drafts)))] + [tok])
        offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int32)
        forkable = [sid for sid in sids if sid not in self.aborted_in_flight and not self.drafts[sid]]
        forks = []
        for parent in data.draw(st.lists(st.sampled_from(forkable), max_size=2)) if forkable else []:
            forks.append((parent, self.next_id, data.draw(st.integers(0, VOCAB - 1))))
            self.next_id += 1
        handed = {sid: data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=self.k)) for sid in sids} \
            if self.spec == "external" else {}
        parent_tokens = {sid: list(self.tokens[sid]) for sid in forkable}
        extra = {}
        if handed:
            extra = {"drafts": np.array([t for sid in sids for t in handed[sid]], dtype=np.int32),
                     "draft_offsets": np.cumsum([0] + [len(handed[sid]) for sid in sids]).astype(np.int32)}
        tokens = np.array([t for r in rows for t in r], dtype=np.int32)
        finished, kept = self.core.postprocess_spec(tokens, offsets, forks=forks, **extra)
        done = {sid for sid, _, _ in finished}
        for r, sid in enumerate(sids):
            if sid in self.aborted_in_flight:
                continue
            assert 1 <= kept[r] <= len(rows[r])
            assert kept[r] == len(rows[r]) or sid in done, "a row stopped early without finishing"
            self.tokens[sid] += rows[r][: kept[r]]
        self.end_step(forks, parent_tokens, finished)
        # A sequence left out of this step (budget, preemption) keeps the drafts handed in for it
        # before: its tokens have not changed, so they are still proposals for its next decode.
        kept_over = {sid: d for sid, d in self.handed.items() if sid not in handed and sid in self.tokens}
        self.handed = kept_over | {sid: d for sid, d in handed.items() if sid in self.tokens}

    def end_step(self, forks: list[tuple[int, int, int]], parent_tokens: dict[int, list[int]],
                 finished: list[tuple[int, str, int | None]]) -> None:
        """The model after a postprocess: forked children, sequences aborted in flight and finished
        ones leave; no step in flight."""
        for parent, child, tok in forks:
            self.tokens[child] = parent_tokens[parent] + [tok]
        for sid in self.aborted_in_flight:
            del self.tokens[sid]
        for sid, reason, stop in finished:
            assert reason in ("stop", "length")
            assert (stop is not None) == (reason == "stop")
            del self.tokens[sid]
        self.plan = None
        self.in_batch = set()
        self.aborted_in_flight = set()

    @invariant()
    def sequences_match_model(self) -> None:
        for sid, toks in self.tokens.items():
            assert self.core.token_ids(sid) == toks
            if self.plan is None:
                table = self.core.block_table(sid)
                computed = self.core.num_computed_tokens(sid)
                assert len(table) == math.ceil(computed / self.bs)
                # Every computed position's slot holds that very prefix's K/V.
                for pos in range(computed):
                    slot = table[pos // self.bs] * self.bs + pos % self.bs
                    assert self.kv[slot] == hash(tuple(toks[: pos + 1])), f"seq {sid} pos {pos} reads wrong KV"

    @invariant()
    def block_accounting(self) -> None:
        stats = self.core.stats()
        refs = [self.core.ref_count(b) for b in range(self.num_blocks)]
        table_entries = sum(len(self.core.block_table(sid)) for sid in self.tokens)
        assert sum(refs) == table_entries
        assert stats["num_free_blocks"] + stats["num_used_blocks"] == stats["num_total_blocks"] == self.num_blocks
        free = self.core.free_queue()
        assert sorted(free) == [b for b, r in enumerate(refs) if r == 0]
        assert stats["prefix_cache_hits"] <= stats["prefix_cache_queries"]
        assert stats["num_running"] + stats["num_waiting"] == len(self.tokens)
        if not self.tokens:
            assert stats["num_free_blocks"] == self.num_blocks
            assert not self.core.has_unfinished()


def ngram_proposal(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """What follows an earlier occurrence of the longest suffix of lo..hi tokens: the latest when k
    tokens follow it, else the first."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e + 1 - n : e + 1] == suffix]
        if ends:
            end = ends[-1] if len(tokens) - 1 - ends[-1] >= k else ends[0]
            return tokens[end + 1 : end + 1 + k]
    return []


CoreMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCoreStateMachine = CoreMachine.TestCase
