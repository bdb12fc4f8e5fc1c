"""Structured-output specs compiled into xgrammar grammars, once per distinct spec, and the cache
that holds them.

JSON is generated in one layout (json.dumps' ", " and ": " separators, no other whitespace): with
free whitespace a model can emit whitespace until max_tokens, which small models readily do. A
JSON schema is checked first (sample/json_schema.py): a keyword the grammar would not enforce, or
a schema nothing satisfies, is a ValueError naming it; so is a grammar or regex that matches
nothing (no first token allowed).

Compiling against the vocabulary costs milliseconds to minutes (it precomputes which tokens each
grammar state allows), so it happens before a request is admitted, never on the engine thread:
offline in the caller's thread (`GrammarCompiler.compile`), in the server in worker processes
under a time limit (sample/grammar_pool.py), whose results come back through `insert`. Either
way the request is handed a `HeldGrammar` and holds it until it finishes.

The cache is an LRU bounded by the grammars' bytes, and the bound counts the grammars that
requests hold: only grammars no request holds are evicted. A grammar that cannot fit beside the
held ones is refused (GrammarCacheFull: retry later), one larger than the whole cache too
(GrammarTooLarge).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from nanovllm.quote import shorten
from nanovllm.sample.json_schema import InvalidSchema, SchemaError, prepare_schema
from nanovllm.sample.utf8 import Utf8Tokens
from nanovllm.sampling_params import StructuredOutputsParams

DEFAULT_CACHE_BYTES = 256 << 20

# xgrammar's errors start with "[hh:mm:ss] /path/to/file.cc:123: ", which says nothing to a client.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")

_WHAT = {"json": "JSON schema", "regex": "regular expression", "choice": "list of choices",
         "grammar": "EBNF grammar", "json_object": "JSON object"}



def _size(nbytes: int) -> str:
    if nbytes < 1 << 10:
        return f"{nbytes} bytes"
    return f"{nbytes / (1 << 10):.1f} KiB" if nbytes < 1 << 20 else f"{nbytes / (1 << 20):.1f} MiB"


class GrammarTooLarge(ValueError):
    """The compiled grammar alone is larger than the grammar cache."""


class GrammarCacheFull(RuntimeError):
    """Grammars held by requests in flight leave no room for this one; retry when some finish."""


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of `choices`. xgrammar's EBNF string literals take
    JSON's escapes, so each choice is written as a JSON string."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_spec(compiler: xgr.GrammarCompiler, kind: str, text: str) -> xgr.CompiledGrammar:
    """The grammar of the spec whose key is (kind, text); ValueError naming the kind when the spec
    is not valid, asks for what the grammar cannot enforce, or matches nothing."""
    try:
        if kind == "json":
            grammar = compiler.compile_json_schema(prepare_schema(text), any_whitespace=False)
        elif kind == "json_object":
            grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        elif kind == "regex":
            grammar = compiler.compile_regex(text)
        elif kind == "choice":
            grammar = compiler.compile_grammar(choice_grammar(json.loads(text)))
        else:
            grammar = compiler.compile_grammar(text)
    except InvalidSchema as e:
        raise ValueError(f"structured_outputs.json is not a valid JSON schema: {e}") from None
    except SchemaError as e:
        raise ValueError(f"structured_outputs.json: {e}") from None
    except (RuntimeError, ValueError) as e:  # xgrammar reports a bad spec as RuntimeError
        reason = shorten(_LOG_PREFIX.sub("", str(e)).strip(), 300)
        raise ValueError(f"structured_outputs.{kind} is not a valid {_WHAT[kind]}: {reason}") from None
    if _matches_nothing(grammar):
        raise ValueError(f"structured_outputs.{kind} matches nothing: no output can satisfy it")
    return grammar


def _matches_nothing(grammar: xgr.CompiledGrammar) -> bool:
    """No token (not even a stop token) may start the output."""
    mask = xgr.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(grammar).fill_next_token_bitmask(mask)
    return not bool(mask.any())


@dataclass(eq=False)
class _Entry:
    key: tuple[str, str]
    compiled: xgr.CompiledGrammar
    nbytes: int
    holds: int = 0


class HeldGrammar:
    """A compiled grammar a request holds: the cache does not evict it until every hold is
    released. `release` is idempotent."""

    def __init__(self, cache: GrammarCompiler, entry: _Entry) -> None:
        self._cache = cache
        self._entry: _Entry | None = entry
        self.compiled = entry.compiled
        self.nbytes = entry.nbytes

    def share(self) -> HeldGrammar:
        """Another hold on the same grammar (for another request)."""
        assert self._entry is not None, "share() after release()"
        return self._cache._hold(self._entry)

    def release(self) -> None:
        self._cache._release(self)


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
        self._info: xgr.TokenizerInfo | None = None  # built on first use: it scans the vocabulary
        self.utf8: Utf8Tokens | None = None  # the vocabulary's UTF-8 tables, built with it
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    @property
    def tokenizer_info(self) -> xgr.TokenizerInfo:
        with self._lock:
            if self._info is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self.utf8 = Utf8Tokens.of(info, self._vocab_size)  # here, not on the engine thread
                self._info = info
            return self._info

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        info = self.tokenizer_info
        with self._lock:
            if self._compiler is None:
                # Our own cache, bounded: xgrammar's would be a second copy of every grammar.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> HeldGrammar:
        """The grammar of `spec`, compiled in this thread unless cached, held for one request."""
        held = self.lookup(spec.key)
        if held is not None:
            return held
        return self.insert(spec.key, compile_spec(self._xgr_compiler(), *spec.key))

    def lookup(self, key: tuple[str, str]) -> HeldGrammar | None:
        """The cached grammar of `key`, held; None when it is not cached."""
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                return None
            self._cache.move_to_end(key)
            entry.holds += 1
        return HeldGrammar(self, entry)

    def check_fits(self, nbytes: int) -> None:
        """GrammarTooLarge when a grammar of `nbytes` could never be cached."""
        if nbytes > self.cache_bytes:
            raise GrammarTooLarge(f"the compiled grammar takes {_size(nbytes)}, more than the whole grammar cache "
                                  f"({_size(self.cache_bytes)}); simplify the spec")

    def insert(self, key: tuple[str, str], compiled: xgr.CompiledGrammar) -> HeldGrammar:
        """Caches a grammar compiled for `key` (here or elsewhere) and holds it. Evicts grammars no
        request holds, least recently used first, to make room."""
        nbytes = compiled.memory_size_bytes
        self.check_fits(nbytes)
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:  # (else another thread cached it meanwhile: use that one)
                self._make_room(nbytes)
                entry = self._cache[key] = _Entry(key, compiled, nbytes)
                self._cached_bytes += nbytes
            self._cache.move_to_end(key)
            entry.holds += 1
        return HeldGrammar(self, entry)

    def _make_room(self, nbytes: int) -> None:
        if self._cached_bytes + nbytes <= self.cache_bytes:
            return
        for entry in [e for e in self._cache.values() if not e.holds]:  # least recently used first
            del self._cache[entry.key]
            self._cached_bytes -= entry.nbytes
            if self._cached_bytes + nbytes <= self.cache_bytes:
                return
        raise GrammarCacheFull(
            f"the grammars held by requests in flight take {_size(self._cached_bytes)} of the "
            f"{_size(self.cache_bytes)} grammar cache, leaving no room for this one ({_size(nbytes)}); retry when "
            "some finish")

    def _hold(self, entry: _Entry) -> HeldGrammar:
        with self._lock:
            entry.holds += 1
        return HeldGrammar(self, entry)

    def _release(self, held: HeldGrammar) -> None:
        with self._lock:  # (two threads may release one hold: a cancelled request's)
            entry, held._entry = held._entry, None
            if entry is not None:
                entry.holds -= 1

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._cache.values() if e.holds)
