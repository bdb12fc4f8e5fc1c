"""Type stubs for the Cython text side (`nanovllm/_core.pyx`, built as `nanovllm._core`)."""

from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

class TokenTable:
    """Bytes of every token id plus how the tokenizer's decoder joins them; built once per
    tokenizer by `nanovllm.token_table.build_token_table`."""

    def __init__(
        self,
        pieces: Sequence[bytes | None],
        *,
        byte_level: bool,
        special_ids: Sequence[int] = (),
        byte_ids: Mapping[int, int] | None = None,
        first_pieces: Sequence[bytes | None] | None = None,
        strip_char: str = " ",
        strip_left: int = 0,
        cleanup: Sequence[tuple[str, str]] = (),
        leading_spaces: Sequence[int] | None = None,
    ) -> None: ...
    def __len__(self) -> int: ...
    @property
    def kind(self) -> str: ...  # "byte_level" | "pieces"
    byte_level: bool
    metaspace_first: bool
    strip_left: int
    strip_char: str
    cleanup: tuple[tuple[str, str], ...]
    special_ids: frozenset[int]
    def piece(self, token_id: int) -> bytes | None: ...
    def is_special(self, token_id: int) -> bool: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...  # == tokenizer.decode
    def decode_token(self, token_id: int) -> str: ...  # a logprob's string, as vLLM's (see _core.pyx)
    def decode_tokens(self, ids: Sequence[int]) -> list[str]: ...
    def corrected_string(self, token_id: int, context: Sequence[int]) -> str: ...  # vLLM's, for a character's part
    def logprob_entries(self, top_ids: Any, top_logprobs: Any, chosen_ids: Any, chosen_logprob: Any,
                        chosen_rank: Any, wanted: Any, logprob: type) -> tuple[list[dict[int, Any]], frozenset[int]]:
        """Per row `{token id: logprob(value, rank, string)}` of its `wanted[r]` most likely tokens
        (int64 / float64 [rows, k] arrays, most likely first) and its chosen token (int64 / float64
        / int64 [rows]), whose object serves its top-k place too; and the rows with a string that
        ends in U+FFFD."""

class Detokenizer:
    """Incremental detokenization and stop strings for many sequences, one call per step."""

    def __init__(self, table: TokenTable) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: int) -> bool: ...
    def add(
        self,
        key: int,
        *,
        skip_special_tokens: bool = True,
        stop: str | Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,  # stop strings are looked for once more tokens than this came
        deltas: bool = True,  # False: left out of process()'s result unless a stop string ends it
    ) -> None: ...
    def remove(self, key: int) -> None: ...
    def process(
        self,
        keys: npt.NDArray[np.int64] | Sequence[int],
        tokens: npt.NDArray[np.int32] | Sequence[int],
        cu_tokens: npt.NDArray[np.integer] | Sequence[int] | None = None,
        stop_terminated: npt.NDArray[np.int64] | Sequence[int] | None = None,
    ) -> list[tuple[int, str, str | None]]:
        """Appends tokens[i] to sequence keys[i] (or the tokens cu_tokens[i]:cu_tokens[i+1]);
        returns (key, new text, stop string or None) for every key added with deltas=True, and for
        any other whose stop string matched in this call. Text that may still become
        part of a stop string, a partial character or an unfinished byte run is held back. The
        last token of a key in stop_terminated (EOS, a stop token id) adds no text."""
    def flush(self, key: int) -> str: ...  # releases everything held back; the sequence ends
    def text(self, key: int) -> str: ...   # tokenizer.decode of its tokens so far, cut at a stop
    def token_ids(self, key: int, start: int = 0) -> list[int]: ...  # tokens fed so far, from `start`
    def stop_reason(self, key: int) -> str | None: ...
    def is_finished(self, key: int) -> bool: ...
