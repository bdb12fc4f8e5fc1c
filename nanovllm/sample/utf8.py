"""Which tokens keep a constrained output valid UTF-8.

A grammar's character classes are sets of code points, and xgrammar decodes a token's bytes into
them leniently: a surrogate (ED A0..BF xx) passes a negated class such as JSON's string
characters, and the text then holds U+FFFD, which breaks maxLength and regex bounds. So a
constrained sequence also runs a UTF-8 automaton over its output bytes: its state says how much of
a character is pending (and which byte ranges may come next), and each step a token is allowed
only if its bytes keep the automaton out of its reject state. A stop token is allowed only between
characters. Tokens without bytes of their own (special tokens) leave the state as it is.

The tables are built once per vocabulary: `next_state[state, token]` and, per state, the packed
allowed-token bitmask in xgrammar's layout (bit t of word t // 32), ANDed into the grammar's mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import xgrammar as xgr

# States: between characters, then the continuation bytes a character still needs (with the
# narrower ranges after E0, ED, F0 and F4 that rule out overlong forms, surrogates and code points
# past U+10FFFF), and reject.
ACCEPT, NEED1, NEED2, NEED2_E0, NEED2_ED, NEED3, NEED3_F0, NEED3_F4, REJECT = range(9)
NUM_STATES = 9


def _byte_table() -> np.ndarray:
    t = np.full((NUM_STATES, 256), REJECT, dtype=np.uint8)

    def put(state: int, lo: int, hi: int, nxt: int) -> None:
        t[state, lo:hi + 1] = nxt

    put(ACCEPT, 0x00, 0x7F, ACCEPT)
    put(ACCEPT, 0xC2, 0xDF, NEED1)
    put(ACCEPT, 0xE0, 0xE0, NEED2_E0)
    put(ACCEPT, 0xE1, 0xEC, NEED2)
    put(ACCEPT, 0xED, 0xED, NEED2_ED)
    put(ACCEPT, 0xEE, 0xEF, NEED2)
    put(ACCEPT, 0xF0, 0xF0, NEED3_F0)
    put(ACCEPT, 0xF1, 0xF3, NEED3)
    put(ACCEPT, 0xF4, 0xF4, NEED3_F4)
    put(NEED1, 0x80, 0xBF, ACCEPT)
    put(NEED2, 0x80, 0xBF, NEED1)
    put(NEED2_E0, 0xA0, 0xBF, NEED1)
    put(NEED2_ED, 0x80, 0x9F, NEED1)
    put(NEED3, 0x80, 0xBF, NEED2)
    put(NEED3_F0, 0x90, 0xBF, NEED2)
    put(NEED3_F4, 0x80, 0x8F, NEED2)
    return t


BYTE_TABLE = _byte_table()


class Utf8Tokens:
    @classmethod
    def of(cls, info: xgr.TokenizerInfo, vocab_size: int) -> Utf8Tokens:
        """The tables of a vocabulary as xgrammar sees it (a fraction of a second for 150k tokens)."""
        stops = set(info.stop_token_ids)
        return cls(info.decoded_vocab, vocab_size, [t for t in info.special_token_ids if t not in stops],
                   sorted(stops))

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int, neutral: Sequence[int],
                 stop_token_ids: Sequence[int]) -> None:
        """`token_bytes[t]`: the bytes token t adds to the output; `neutral`: tokens that add none
        of their own (special tokens); `stop_token_ids` end the output."""
        n = len(token_bytes)
        lengths = np.fromiter((len(b) for b in token_bytes), dtype=np.int64, count=n)
        flat = np.frombuffer(b"".join(token_bytes), dtype=np.uint8)
        starts = np.cumsum(lengths) - lengths
        # Run the automaton from every state at once, one byte position at a time, over the tokens
        # still that long (sorted by length, so those are a suffix).
        order = np.argsort(lengths, kind="stable")
        sorted_lengths = lengths[order]
        state = np.repeat(np.arange(NUM_STATES, dtype=np.uint8)[:, None], n, axis=1)
        for pos in range(int(lengths.max(initial=0))):
            active = order[np.searchsorted(sorted_lengths, pos, side="right"):]
            state[:, active] = BYTE_TABLE[state[:, active], flat[starts[active] + pos]]
        next_state = np.full((NUM_STATES, vocab_size), REJECT, dtype=np.uint8)  # ids past the tokenizer
        next_state[:, :n] = state
        neutral_ids = np.asarray([t for t in neutral if 0 <= t < vocab_size], dtype=np.int64)
        next_state[:, neutral_ids] = np.arange(NUM_STATES, dtype=np.uint8)[:, None]
        stops = np.asarray([t for t in stop_token_ids if 0 <= t < vocab_size], dtype=np.int64)
        next_state[:, stops] = REJECT
        next_state[ACCEPT, stops] = ACCEPT
        self.next_state = next_state
        # One bytes object per state: indexing one is the cheapest lookup Python has (record
        # advances each constrained row with it).
        self._next = [row.tobytes() for row in next_state]
        allowed = next_state != REJECT
        allowed[REJECT] = False
        self.allowed_bitmask = _pack(allowed)

    def advance(self, state: int, token: int) -> int:
        return self._next[state][token]


def _pack(allowed: np.ndarray) -> np.ndarray:
    """[rows, vocab] bools -> [rows, ceil(vocab / 32)] int32, bit t % 32 of word t // 32."""
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = np.zeros((rows, words * 32), dtype=bool)
    padded[:, :vocab] = allowed
    bits = np.packbits(padded.reshape(rows, words, 4, 8), axis=-1, bitorder="little").reshape(rows, words, 4)
    return bits.view("<i4").reshape(rows, words)
