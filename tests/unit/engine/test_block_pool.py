"""Block ownership: reference counts, prefix-cache hits, and exact LRU eviction."""

import pytest

from libs.engine.model.block_pool import BlockPool
from libs.protocol.errors import OutOfKVBlocksError
from libs.protocol.hashing import BlockHash


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 16)


def test_allocate_takes_blocks_in_order_and_free_returns_them():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free_blocks == 1
    with pytest.raises(OutOfKVBlocksError, match="2 blocks needed, 1 free"):
        pool.allocate(2)
    pool.free([0, 1, 2])
    assert pool.num_free_blocks == 4


def test_cached_blocks_are_evicted_least_recently_freed_first_tail_first():
    pool = BlockPool(4)
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(2)  # [2, 3]
    for i, block in enumerate(a + b):
        pool.cache(block, h(i), [i])
    pool.free(a)  # frees 1 then 0: the tail of a sequence goes first
    pool.free(b)  # then 3, then 2
    assert pool.allocate(1) == [1]
    assert pool.lookup([h(0)], [[0]]) == [0]  # still cached
    assert pool.lookup([h(1)], [[1]]) == []  # evicted
    assert pool.allocate(2) == [0, 3]
    assert pool.cached_hashes() == [h(2)]


def test_a_hit_revives_a_free_block_and_removes_it_from_the_free_queue():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.cache(block, h(7), [1, 2])
    pool.free([block])
    hits = pool.lookup([h(7)], [[1, 2]])
    pool.touch(hits)
    assert hits == [block]
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [1]  # the revived block is not handed out


def test_a_hit_is_confirmed_against_token_ids():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.cache(block, h(1), [5, 6])
    assert pool.lookup([h(1)], [[5, 7]]) == []


def test_double_free_is_an_error():
    pool = BlockPool(1)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(ValueError):
        pool.free(ids)
