"""The engine's Python-side record of each request and of each of its completions (one core
sequence per completion), and how a RequestOutput is built from them.

A completion holds only what has not been handed out yet: the token ids, text and logprob rows
collected since its last output (a streamed request), or all of them once it finished (any
other). While it runs, its tokens and text live in the Cython detokenizer and its logprobs in the
step's LogprobBlocks; the engine collects them when an output is due, so a step costs no Python
work for a sequence that produces no visible output.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from nanovllm._core import TokenTable
from nanovllm.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput
from nanovllm.sample import LogprobBlock, build_entries
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:  # (the grammar module imports xgrammar: only structured output needs it)
    from nanovllm.sample.grammar import HeldGrammar


@dataclass
class Completion:
    index: int
    seq_id: int
    token_ids: list[int] = field(default_factory=list)  # collected, not yet handed out
    text: str = ""  # likewise
    num_collected: int = 0  # tokens collected from the detokenizer so far
    lp_refs: list[tuple[LogprobBlock, int]] | None = None  # logprob rows not yet handed out
    lp_context: list[tuple[LogprobBlock, int]] = field(default_factory=list)  # the last 4 rows handed out
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_finish: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self, table: TokenTable, delta: bool, detokenize: bool = True) -> CompletionOutput:
        """What it holds, as an output; with `delta` (streaming) it then holds nothing. Without
        `detokenize` (SamplingParams.detokenize) no text: "" and logprobs without their strings."""
        logprobs = None if self.lp_refs is None else build_entries(self.lp_refs, table, self.lp_context)
        if logprobs is not None and not detokenize:
            logprobs = without_strings(logprobs)
        out = CompletionOutput(self.index, self.text if detokenize else "", self.token_ids, self.cumulative_logprob,
                               logprobs, self.finish_reason, self.stop_reason)
        if delta:
            self.token_ids, self.text = [], ""
            if self.lp_refs is not None:
                self.lp_refs.clear()  # in place: the engine appends to this very list
            self.sent_finish = self.finished
        return out

    def has_news(self) -> bool:
        return bool(self.token_ids) or bool(self.text) or (self.finished and not self.sent_finish)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    stream: bool
    completions: list[Completion] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    # Set once the first sample has fanned out into n completions (n > 1).
    fanned_out: bool = True
    grammar: HeldGrammar | None = None  # its structured output's grammar, held until it finishes
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache held, once first scheduled

    def release_grammar(self) -> None:
        if self.grammar is not None:
            self.grammar.release()
            self.grammar = None

    @property
    def finished(self) -> bool:
        return self.fanned_out and all(c.finished for c in self.completions)

    @property
    def prompt_logprobs_pending(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def output(self, table: TokenTable) -> RequestOutput:
        """A streamed request gets what is new since its last output; others get everything."""
        detokenize = self.params.detokenize
        completions = [c.output(table, self.stream, detokenize) for c in self.completions
                       if not self.stream or c.has_news()]
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None and not detokenize:
            prompt_logprobs = [None if e is None else without_strings([e])[0] for e in prompt_logprobs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, self.finished,
                             self.metrics, prompt_logprobs, self.num_cached_tokens)


def without_strings(entries: list[dict[int, Logprob]]) -> list[dict[int, Logprob]]:
    """Logprob dicts with decoded_token None (vLLM's without detokenization); the entries are shared,
    so copies."""
    return [{t: replace(lp, decoded_token=None) for t, lp in e.items()} for e in entries]
