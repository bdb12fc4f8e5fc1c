"""Sampling parameters, with vLLM's names and meanings."""

from __future__ import annotations

import json
import logging
import math
import numbers
import re
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from typing import Any

from nanovllm.quote import quote

logger = logging.getLogger(__name__)

# A seed seeds a torch.Generator, whose manual_seed takes any 64-bit value, signed or unsigned.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# vLLM's temperature bounds: above MAX an error; a positive one below MIN becomes MIN.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 2.0
# vLLM's bounds on a request's bad_words once tokenized (VLLM_MAX_NUM_BAD_WORDS and
# VLLM_MAX_BAD_WORDS_TOTAL_TOKENS): sequences, and their tokens in all.
MAX_BAD_WORDS, MAX_BAD_WORDS_TOKENS = 128, 1024


# The kinds of StructuredOutputsParams, in the order its fields are declared.
KINDS = ("json", "regex", "choice", "grammar", "json_object")
FLOAT32_MAX = 3.4028234663852886e38  # biases are added to fp32 logits


class RequestOutputKind(Enum):
    """vLLM's: what each streamed RequestOutput carries (the offline LLM returns the final one)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names): a JSON schema (dict or JSON string), a regular
    expression, one of a list of strings, an xgrammar EBNF grammar, or any JSON object. Exactly
    one kind; whether the schema, regex or grammar is valid is found out when it is compiled
    (before the request is admitted)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's options, where they ask for what xgrammar does here: JSON without free whitespace
    # (True, or None), an object's properties only those its schema names (xgrammar's strict mode:
    # either value, as in vLLM's xgrammar backend); no whitespace pattern, no structural tags.
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported; give json, regex, choice, grammar "
                             "or json_object")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported: JSON is generated without free "
                             "whitespace")
        if self.disable_any_whitespace is False:
            raise ValueError("structured_outputs.disable_any_whitespace=False is not supported: JSON is generated "
                             "without free whitespace (leave it unset or true)")
        if not isinstance(self.disable_additional_properties, bool):
            raise ValueError("structured_outputs.disable_additional_properties must be a bool, got "
                             f"{quote(self.disable_additional_properties)}")
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of " + ", ".join(KINDS)
                             + (f"; got {', '.join(given)}" if given else ""))
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (a dict or a JSON string), got "
                             f"{quote(value)}")
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {quote(value)}")
        if kind == "choice" and not (isinstance(value, (list, tuple)) and value
                                     and all(isinstance(c, str) and _encodable(c) for c in value)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {quote(value)}")
        if kind == "json_object" and value is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {quote(value)}")
        if kind == "choice":
            object.__setattr__(self, "choice", list(value))

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @cached_property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: (kind, its text). A dict schema keeps its key order,
        which is the order the properties are generated in. Computed once, by whoever compiles the
        spec (a large schema's json.dumps is not free; it never runs on the engine thread)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            try:
                return kind, json.dumps(value, ensure_ascii=False)
            except RecursionError:
                raise ValueError("structured_outputs.json nests too deeply") from None
            except (TypeError, ValueError) as e:  # a dict built in Python may hold what JSON cannot
                raise ValueError(f"structured_outputs.json is not JSON: {e}") from None
        if kind == "choice":
            return kind, json.dumps(value, ensure_ascii=False)
        return kind, "" if kind == "json_object" else value


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # Words never generated (vLLM's): each is tokenized as written and after a space, and a token
    # that would complete one of those sequences in the output is masked (update_from_tokenizer).
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # -1: every token of the vocabulary (as vLLM)
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None  # keep k of the prompt's tokens (-1: max_model_len - 1)
    truncation_side: str | None = None  # which k: "left" (the default) keeps the last, "right" the first
    detokenize: bool = True  # False: outputs carry token ids only (text "", logprobs without their strings)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's)
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's, accepted for its users' code: special tokens are decoded as the tokenizer joins them
    # (True only); the offline LLM returns each request's final output (any kind); extra_args are
    # kept for the caller, no sampling step reads them.
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = field(default_factory=lambda: RequestOutputKind.CUMULATIVE)
    extra_args: dict[str, Any] | None = None
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.seed == -1 and not isinstance(self.seed, bool):  # OpenAI's and vLLM's "no seed"
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's: True is 1 (one more than the chosen token), False 0
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))
        if not isinstance(self.stop_token_ids, (list, tuple, type(None))):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {quote(self.stop_token_ids)}")
        if not isinstance(self.stop, (str, list, tuple, type(None))):
            raise ValueError(f"stop must be a string or a list of strings, got {quote(self.stop)}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop = list(self.stop_strings)  # vLLM's: always a list (a lone string its one entry)
        if not isinstance(self.bad_words, (list, tuple, type(None))):
            raise ValueError(f"bad_words must be a list of strings, got {quote(self.bad_words)}")
        self.bad_words = list(self.bad_words or [])  # vLLM's: None is []
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a map of token id -> bias, got {quote(self.logit_bias)}")
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        self._validate()
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # vLLM's: lower ones overflow its softmax
            logger.warning("temperature %s is below %s, which may give nan or inf; it is raised to %s",
                           self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        self.bad_words = list(dict.fromkeys(self.bad_words))  # vLLM's: each word once

    def _validate(self) -> None:
        def fail(name: str, requirement: str) -> None:
            raise ValueError(f"{name} must be {requirement}, got {quote(getattr(self, name))}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_number(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            fail("n", "an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_number(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                fail(name, "in [-2, 2]")
        if not is_number(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            fail("repetition_penalty", "a number > 0")
        if not is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            fail("temperature", f"in [0, {MAX_TEMPERATURE:g}]")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]")
        if not is_int(self.top_k) or not -1 <= self.top_k < 2**31:
            fail("top_k", "-1 (off), 0 (off) or a positive integer below 2**31")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            fail("seed", "None or an integer in [-2**63, 2**64 - 1]")
        if not all(isinstance(s, str) and s and _encodable(s) for s in self.stop_strings):
            fail("stop", "a non-empty string or a list of non-empty strings (valid Unicode)")
        if not all(isinstance(w, str) and w and _encodable(w) for w in self.bad_words or ()):
            fail("bad_words", "None or a list of non-empty strings (valid Unicode)")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of non-negative token ids")
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, (list, tuple)) or not allowed
                                    or not all(is_int(t) and t >= 0 for t in allowed)):
            fail("allowed_token_ids", "None or a non-empty list of non-negative token ids")
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "a bool")
        if not self.detokenize and self.stop_strings:
            raise ValueError("stop strings need detokenize=True (they are matched in the text)")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "None (until max_model_len) or an integer >= 1")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens):
            fail("min_tokens", "an integer in [0, max_tokens]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            # The most a request may ask for is the engine's max_logprobs (checked at admission).
            if value is not None and (not is_int(value) or value < -1):
                fail(name, "None, -1 (the whole vocabulary) or an integer >= 0")
        keep = self.truncate_prompt_tokens
        if keep is not None and (not is_int(keep) or keep == 0 or keep < -1):
            fail("truncate_prompt_tokens", "None, -1 (to max_model_len - 1) or an integer >= 1")
        if self.logit_bias is not None:
            # Any bias, as vLLM's SamplingParams (-inf bans a token; the server clamps to OpenAI's
            # [-100, 100] as vLLM's does); NaN or +inf would leave no distribution to sample.
            for token, bias in self.logit_bias.items():
                if token < 0 or not isinstance(bias, (int, float)) or isinstance(bias, bool) or not (
                        bias == -math.inf or abs(bias) <= FLOAT32_MAX):
                    fail("logit_bias", "a map of token id -> bias (a float32: at most 3.4e38 in magnitude, or -inf)")
        if self.truncation_side not in (None, "left", "right"):
            fail("truncation_side", "None, 'left' (keep the prompt's last tokens) or 'right' (its first)")
        if self.spaces_between_special_tokens is not True:
            fail("spaces_between_special_tokens", "True (special tokens are decoded as the tokenizer joins them)")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "a RequestOutputKind")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            fail("extra_args", "None or a dict")
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            fail("structured_outputs", "None or a StructuredOutputsParams")

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """bad_words as token id sequences (vLLM's rule): each word with its leading spaces removed,
        as written and after a space, the spaced form kept only where its first token differs and
        its length is the same (a word-start token of its own). ValueError when a word has no tokens
        or there are too many."""
        if not self.bad_words:
            return
        sequences: list[list[int]] = []
        for word in self.bad_words:
            for spaced in (False, True):
                ids = list(tokenizer.encode((" " if spaced else "") + word.lstrip(), add_special_tokens=False))
                if not ids:
                    if not spaced:
                        raise ValueError(f"bad_words entry {quote(word)} encodes to no tokens")
                    continue
                if not spaced or (ids[0] != sequences[-1][0] and len(ids) == len(sequences[-1])):
                    sequences.append(ids)
        if len(sequences) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words make {len(sequences)} token sequences (each word as written and after a "
                             f"space), more than {MAX_BAD_WORDS}")
        total = sum(map(len, sequences))
        if total > MAX_BAD_WORDS_TOKENS:
            raise ValueError(f"bad_words encode to {total} tokens in all, more than {MAX_BAD_WORDS_TOKENS}")
        self._bad_words_token_ids = sequences

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` (dataclasses.replace), its bad words' token ids kept."""
        copy = replace(self, **changes)
        if "bad_words" not in changes:
            copy._bad_words_token_ids = self._bad_words_token_ids
        return copy

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """The token sequences bad_words forbid, once update_from_tokenizer has run."""
        return self._bad_words_token_ids

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings, read when a request is added (as vLLM reads `stop`: an assignment
        after construction counts)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # e.g. a lone surrogate from a JSON "\\ud800"
        return False
    return True


# A token id written in JSON: plain ASCII decimal digits (int() would also take "1_0", " 10", "+10"
# or other scripts' digits), at most 10 of them (no vocabulary is larger).
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def _token_key(key: object) -> int:
    """logit_bias keys may arrive as strings (JSON objects have string keys)."""
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return int(key)  # (numpy integers too)
    if isinstance(key, str) and _TOKEN_ID.fullmatch(key):
        return int(key)
    raise ValueError(f"logit_bias keys must be token ids (plain decimal integers), got {quote(key)}")


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # vLLM's field: its beam search scores raw logprobs whatever it is, as this one
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # vLLM's field; its offline beam search does not read it either
    skip_special_tokens: bool = True  # in the beams' text

    def __post_init__(self) -> None:
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")


def truncated_prompt(token_ids: list[int], keep: int | None, max_model_len: int,
                     side: str | None = None) -> list[int]:
    """vLLM's truncate_prompt_tokens: `keep` of the prompt's tokens, its last ones (side "left", the
    default for generation) or its first ("right"). -1 keeps max_model_len - 1, leaving a token of
    room to generate; None keeps all. A `keep` past max_model_len is a ValueError, as in vLLM."""
    if keep is None:
        return token_ids
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens={keep} cannot be greater than max_model_len={max_model_len}; "
                         "request a smaller truncation size")
    if side not in (None, "left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
    if keep == -1:
        keep = max(0, max_model_len - 1)
    if keep >= len(token_ids):
        return token_ids
    return token_ids[:keep] if side == "right" else token_ids[len(token_ids) - keep:]
