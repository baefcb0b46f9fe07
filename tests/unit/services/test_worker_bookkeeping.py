"""Decode leases and recent-id sets: exact bookkeeping (the store's tiers: tests/unit/store)."""

from libs.common.recent import RecentIds
from services.decode.leases import LeaseTable


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
