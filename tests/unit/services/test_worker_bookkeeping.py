"""Decode leases, the store's DRAM tier and recent-id sets: exact bookkeeping."""

import pytest
import torch

from libs.common.recent import RecentIds
from libs.common.transfer import SharedSegment, TransferEngine
from libs.common.transfer.segment import new_segment_name
from services.decode.leases import LeaseTable
from services.store.block_store import DramBlockStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_leases_expire_and_are_taken_once():
    clock = Clock()
    table = LeaseTable(lease_seconds=30, clock=clock)
    table.grant("a", [1, 2])
    table.grant("b", [3])
    assert table.num_blocks == 3
    assert table.take("a").block_ids == [1, 2]
    assert table.take("a") is None
    clock.now = 29.9
    assert table.expired() == []
    clock.now = 30.0
    assert [lease.request_id for lease in table.expired()] == ["b"]
    assert len(table) == 0


def test_recent_ids_forget_the_oldest():
    ids = RecentIds(capacity=2)
    for i in "abc":
        ids.add(i)
    assert "a" not in ids and "b" in ids and "c" in ids


@pytest.fixture
def segments():
    engine = TransferEngine()
    made = []

    def make(nbytes: int) -> SharedSegment:
        segment = SharedSegment.create(new_segment_name("test", "seg"), nbytes)
        engine.register(segment)
        made.append(segment)
        return segment

    yield engine, make
    engine.close()


def h(i: int) -> bytes:
    return bytes([i]) * 16


def test_dram_store_evicts_least_recently_used_and_copies_bit_exact(segments):
    engine, make = segments
    block = 64
    store = DramBlockStore(make(3 * block + 10), block, engine)  # 3 slots; the 10 spare bytes are unused
    worker = make(8 * block)
    worker.tensor.copy_(torch.arange(8 * block, dtype=torch.uint8))
    assert store.num_slots == 3
    assert store.put([h(1), h(2), h(3)], worker.name, [0, block, 2 * block]) == 3
    assert store.put([h(1)], worker.name, [0]) == 0  # already there: a no-op that counts as a use
    assert store.put([h(4), h(5)], worker.name, [3 * block, 4 * block]) == 2
    assert store.evictions == [h(2), h(3)]
    assert store.exists([h(1), h(2), h(4), h(5)]) == [True, False, True, True]
    # get copies the longest stored prefix, bit for bit
    out = make(8 * block)
    assert store.get([h(1), h(4), h(2), h(5)], out.name, [0, block, 2 * block, 3 * block]) == 2
    assert out.tensor[:block].equal(worker.tensor[:block])
    assert out.tensor[block : 2 * block].equal(worker.tensor[3 * block : 4 * block])
    assert out.tensor[2 * block :].count_nonzero() == 0
