"""Structured-output specs compiled into xgrammar grammars, once per distinct spec.

JSON is generated in one layout (json.dumps' ", " and ": " separators, no other whitespace): with
free whitespace a model can emit whitespace until max_tokens, which small models readily do.

Compiling a JSON schema or a grammar against the vocabulary costs milliseconds to seconds (it
precomputes which tokens each grammar state allows), so compiled grammars are kept in an LRU cache
bounded by their size in bytes. `compile` is thread-safe: the server compiles in its text workers,
off the engine thread, and the engine's own `compile` at admission then finds the grammar cached.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from nanovllm.sampling_params import StructuredOutputsParams

DEFAULT_CACHE_BYTES = 256 << 20

# xgrammar's errors start with "[hh:mm:ss] /path/to/file.cc:123: ", which says nothing to a client.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")

_WHAT = {"json": "JSON schema", "regex": "regular expression", "choice": "list of choices",
         "grammar": "EBNF grammar", "json_object": "JSON object"}


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of `choices`. xgrammar's EBNF string literals take
    JSON's escapes, so each choice is written as a JSON string."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_bytes: int = DEFAULT_CACHE_BYTES, max_threads: int = 1) -> None:
        """`vocab_size` is the model's (the LM head's rows): ids the tokenizer lacks, the head's
        padding, are never allowed. `stop_token_ids` end a finished grammar (EOS)."""
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._max_threads = max_threads
        self.cache_bytes = cache_bytes
        self._compiler: xgr.GrammarCompiler | None = None  # built on first use: it scans the vocabulary
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                # Our own cache, bounded: xgrammar's would be a second copy of every grammar.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; ValueError naming the kind when it is not valid."""
        key = spec.key
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._compile(spec)
        with self._lock:
            if key not in self._cache:  # another thread may have compiled it meanwhile
                self._cache[key] = grammar
                self._cached_bytes += grammar.memory_size_bytes
                while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._cached_bytes -= old.memory_size_bytes
        return grammar

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        compiler = self._xgr_compiler()
        kind, text = spec.key
        try:
            if kind in ("json", "json_object"):
                return compiler.compile_json_schema(text if kind == "json" else '{"type": "object"}',
                                                    any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice or ()))
            return compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as e:  # xgrammar reports a bad spec as RuntimeError
            reason = _LOG_PREFIX.sub("", str(e)).strip()
            raise ValueError(f"structured_outputs.{kind} is not a valid {_WHAT[kind]}: {reason}") from None

    @property
    def num_cached(self) -> int:
        return len(self._cache)
