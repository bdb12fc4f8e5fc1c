"""The block pool: ref counts, the LRU free queue and the hash -> block index."""

import pytest

from nanovllm import _C


def test_fresh_pool_counters() -> None:
    pool = _C.BlockPool(num_blocks=6, block_size=4)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks) == (6, 0, 0)
    assert pool.free_queue() == [0, 1, 2, 3, 4, 5]


def test_allocate_takes_head_and_free_returns() -> None:
    pool = _C.BlockPool(4, 4)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    pool.free(1)
    # An unhashed block is worth nothing cached: it goes to the head and is reused first.
    assert pool.free_queue() == [1, 3]
    assert pool.allocate() == 1


def test_ref_counts() -> None:
    pool = _C.BlockPool(2, 4)
    b = pool.allocate()
    pool.touch(b)
    assert pool.ref_count(b) == 2
    pool.free(b)
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 1
    pool.free(b)
    assert pool.ref_count(b) == 0 and pool.num_free_blocks == 2


def test_cached_free_blocks_evicted_least_recently_freed_first() -> None:
    pool = _C.BlockPool(4, 2)
    blocks = [pool.allocate() for _ in range(4)]
    for i, b in enumerate(blocks):
        assert pool.register(b, 1000 + i, [i, i])
    for b in [2, 0, 3, 1]:
        pool.free(b)
    assert pool.free_queue() == [2, 0, 3, 1]
    assert pool.num_cached_blocks == 4
    assert pool.allocate() == 2
    # Allocation evicted block 2's hash.
    assert pool.lookup(1002, [2, 2]) == -1
    assert pool.block_hash(2) is None
    assert pool.num_cached_blocks == 3
    assert pool.lookup(1000, [0, 0]) == 0


def test_hit_on_cached_free_block_leaves_middle_of_queue() -> None:
    pool = _C.BlockPool(4, 2)
    blocks = [pool.allocate() for _ in range(4)]
    for i, b in enumerate(blocks):
        pool.register(b, 50 + i, [i, 0])
        pool.free(b)
    assert pool.free_queue() == [0, 1, 2, 3]
    hit = pool.lookup(52, [2, 0])
    assert hit == 2
    pool.touch(hit)
    assert pool.free_queue() == [0, 1, 3]
    assert pool.ref_count(2) == 1 and pool.num_free_blocks == 3


def test_lookup_verifies_tokens() -> None:
    pool = _C.BlockPool(2, 3)
    b = pool.allocate()
    pool.register(b, 77, [1, 2, 3])
    assert pool.lookup(77, [1, 2, 3]) == b
    # Same hash, other tokens (a collision): never reuse wrong KV.
    assert pool.lookup(77, [1, 2, 4]) == -1


def test_register_refuses_duplicate_hash_and_rehash() -> None:
    pool = _C.BlockPool(3, 2)
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, 9, [1, 1])
    assert not pool.register(b, 9, [1, 1])
    assert pool.block_hash(b) is None
    assert not pool.register(a, 10, [1, 1])
    assert pool.block_hash(a) == 9


def test_many_hashes_survive_erase_with_collisions_in_index() -> None:
    # Hashes sharing low bits collide in the open-addressing index; erasing from the middle of a
    # probe run must keep the rest findable.
    n = 64
    pool = _C.BlockPool(n, 1)
    blocks = [pool.allocate() for _ in range(n)]
    keys = [(i << 40) | 5 for i in range(n)]
    for b, k in zip(blocks, keys):
        pool.register(b, k, [b])
        pool.free(b)
    for _ in range(n // 2):
        evicted = pool.allocate()
        assert pool.block_hash(evicted) is None
    for b, k in zip(blocks, keys):
        expected = b if b >= n // 2 else -1
        assert pool.lookup(k, [b]) == expected


def test_bad_arguments() -> None:
    pool = _C.BlockPool(2, 4)
    with pytest.raises(IndexError, match="block id 2"):
        pool.touch(2)
    with pytest.raises(IndexError):
        pool.ref_count(-1)
    with pytest.raises(ValueError, match="already free"):
        pool.free(0)
    b = pool.allocate()
    with pytest.raises(ValueError, match="holds 4 tokens"):
        pool.register(b, 1, [1, 2])
    pool.allocate()
    with pytest.raises(ValueError, match="no free block"):
        pool.allocate()
    with pytest.raises(ValueError, match="num_blocks"):
        _C.BlockPool(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        _C.BlockPool(4, 0)
