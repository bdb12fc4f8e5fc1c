"""XXH64 and the chained block hash, against the `xxhash` package and numpy."""

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm import _C


def reference_chain(tokens: list[int], block_size: int) -> list[int]:
    hashes: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        payload = np.asarray(tokens[start : start + block_size], dtype="<i8").tobytes()
        if hashes:
            payload = hashes[-1].to_bytes(8, "little") + payload
        hashes.append(xxhash.xxh64(payload).intdigest())
    return hashes


@given(st.binary(max_size=600), st.integers(min_value=0, max_value=2**64 - 1))
@settings(max_examples=400, deadline=None)
def test_xxh64_matches_reference(data: bytes, seed: int) -> None:
    assert _C.xxh64(data, seed) == xxhash.xxh64(data, seed=seed).intdigest()


@pytest.mark.parametrize("length", range(0, 70))
def test_xxh64_every_tail_length(length: int) -> None:
    # Every combination of the 32-byte stripes and 8/4/1-byte tails.
    data = bytes((i * 37 + 11) % 256 for i in range(length))
    assert _C.xxh64(data) == xxhash.xxh64(data).intdigest()
    assert _C.xxh64(data, 12345) == xxhash.xxh64(data, seed=12345).intdigest()


@given(
    st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=200),
    st.sampled_from([1, 2, 3, 4, 16, 17]),
)
@settings(max_examples=200, deadline=None)
def test_chained_block_hash_matches_python(tokens: list[int], block_size: int) -> None:
    assert _C.hash_prompt_blocks(tokens, block_size) == reference_chain(tokens, block_size)


def test_hash_block_tokens_links() -> None:
    tokens = list(range(100, 112))
    chain = reference_chain(tokens, 4)
    assert _C.hash_block_tokens(None, tokens[:4]) == chain[0]
    assert _C.hash_block_tokens(chain[0], tokens[4:8]) == chain[1]
    assert _C.hash_block_tokens(chain[1], np.array(tokens[8:12], dtype=np.int32)) == chain[2]


def test_partial_block_is_not_hashed() -> None:
    assert len(_C.hash_prompt_blocks(list(range(7)), 4)) == 1
    assert _C.hash_prompt_blocks([1, 2, 3], 4) == []


def test_same_block_different_prefix_hashes_differ() -> None:
    a = _C.hash_prompt_blocks([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = _C.hash_prompt_blocks([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]
