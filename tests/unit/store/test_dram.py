"""The DRAM tier's bookkeeping: exact LRU order, pinning, leases, slot accounting."""

import pytest

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
