"""The DRAM tier's bookkeeping: exact LRU order, pinning, leases, slot accounting."""

import pytest

from libs.protocol.schema import CacheOwner
from services.store.dram import DramTier
from tests.unit.store.conftest import BLOCK, h


def filled(n: int, slots: int | None = None) -> DramTier:
    dram = DramTier(slots or n, block_nbytes=BLOCK)
    for i in range(n):
        dram.insert(h(i), dram.take_free_slot())
    return dram


def test_victims_are_least_recently_used_first_then_pinned():
    dram = filled(4)
    dram.touch(h(0))  # order now 1, 2, 3, 0
    dram.pin(h(2))  # pinned go last
    assert dram.lru_order() == [h(1), h(3), h(0), h(2)]
    assert dram.pick_victims(3) == [h(1), h(3), h(0)]
    assert dram.pick_victims(3) == [h(2)]  # the pinned one, only when nothing else can go
    assert dram.pick_victims(1) == []  # all leaving already
    dram.check()


def test_a_leased_slot_is_never_a_victim_and_outlives_its_block():
    dram = filled(3)
    slot0 = dram.slot_of(h(0))
    dram.lease(slot0)
    assert dram.pick_victims(3) == [h(1), h(2)]
    assert dram.num_free_slots == 0
    assert dram.unmap(h(0)) is False  # removed while read: the slot stays with its reader
    assert h(0) not in dram and dram.num_free_slots == 0
    assert dram.release(slot0) is True  # the last lease frees it
    assert dram.num_free_slots == 1
    dram.check()


def test_slots_are_handed_out_lowest_first_and_given_back():
    dram = DramTier(3, block_nbytes=BLOCK)
    assert [dram.take_free_slot() for _ in range(3)] == [0, 1, 2]
    assert dram.take_free_slot() is None
    dram.give_back(1)
    assert dram.take_free_slot() == 1


def test_no_slots_is_an_error():
    with pytest.raises(ValueError):
        DramTier(0, block_nbytes=BLOCK)


def test_an_owner_past_its_share_loses_its_own_blocks_first():
    dram = DramTier(10, block_nbytes=BLOCK)
    for i in range(3):  # b's blocks are the least recently used
        dram.insert(h(i), dram.take_free_slot(), owner=CacheOwner(name="tenant/b", share=0.5))
    for i in range(3, 10):  # a holds 7 of 10 slots, its share is 4
        dram.insert(h(i), dram.take_free_slot(), owner=CacheOwner(name="tenant/a", share=0.4))
    assert dram.owners() == {"tenant/b": 3, "tenant/a": 7}
    # a's 3 blocks past its share go first, least recent first; then plain LRU (b's oldest)
    assert dram.pick_victims(4) == [h(3), h(4), h(5), h(0)]
    assert dram.owners() == {"tenant/b": 2, "tenant/a": 4}  # those leaving no longer count
    for i in (3, 4, 5, 0):
        dram.unmap(h(i))
    assert dram.owners() == {"tenant/b": 2, "tenant/a": 4}
    assert dram.pick_victims(1) == [h(1)]  # a within its share now: LRU again
    dram.check()


def test_an_owners_pinned_or_leased_blocks_stay_and_its_latest_put_sets_its_share():
    dram = DramTier(4, block_nbytes=BLOCK)
    dram.insert(h(0), dram.take_free_slot(), owner=CacheOwner(name="x"))  # no share: never first
    for i in (1, 2, 3):  # a may keep 1 slot of 4
        dram.insert(h(i), dram.take_free_slot(), owner=CacheOwner(name="tenant/a", share=0.25))
    dram.pin(h(1))
    dram.lease(dram.slot_of(h(2)))
    assert dram.pick_victims(1) == [h(3)]  # a's only block that may go
    assert dram.pick_victims(1) == [h(0)]  # a is still past its share, but its pinned and leased blocks stay
    dram.unmap(h(3))
    dram.unmap(h(0))
    dram.insert(h(5), dram.take_free_slot(), owner=CacheOwner(name="x"))
    dram.insert(h(4), dram.take_free_slot(), owner=CacheOwner(name="tenant/a"))  # no share now: the latest put says so
    assert dram.pick_victims(1) == [h(5)]  # plain LRU, not a's newer block
    dram.check()
