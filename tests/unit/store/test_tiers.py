"""DRAM and disk together: exact eviction order and events, capacities never
exceeded, pinned and leased blocks surviving pressure, write-back, promotion,
corruption, restart and removal."""

import os

from services.store.block_files import HEADER
from tests.unit.store.conftest import BLOCK, events_of, h, payload, put, read


def assert_log_matches(store) -> None:
    """The event log's view of the store equals the store's tiers, exactly."""
    assert store.events.contents("dram") == set(store.dram)
    assert store.events.contents("disk") == (set(store.disk) if store.disk is not None else set())
    store.dram.check()
    if store.disk is not None:
        assert store.disk.used_bytes <= store.disk.capacity_bytes


async def test_eviction_writes_back_and_promotion_copies_up_in_exact_order(make_store):
    store = make_store(slots=2, disk_blocks=2)
    await store.start()
    await put(store, [1, 2])
    for i in (3, 4, 5):
        await put(store, [i])
        assert len(store.dram) == 2 and len(store.disk) <= 2
    # 5 pushed 3 out to a full disk, which dropped its least recently used file (1)
    assert store.dram.lru_order() == [h(4), h(5)] and store.disk.lru_order() == [h(2), h(3)]
    assert await read(store, [2]) == [("disk", payload(2))]  # made room by demoting 4; 2 stays on disk
    assert await read(store, [5, 3, 1]) == [("dram", payload(5)), None, None]
    assert events_of(store.events) == [
        ("stored", "dram", [1, 2]),
        ("demoted", "disk", [1]), ("stored", "dram", [3]),
        ("demoted", "disk", [2]), ("stored", "dram", [4]),
        ("evicted", "disk", [1]), ("demoted", "disk", [3]), ("stored", "dram", [5]),
        ("evicted", "disk", [3]), ("demoted", "disk", [4]), ("promoted", "dram", [2]),
    ]  # fmt: skip
    assert store.dram.lru_order() == [h(2), h(5)] and store.disk.lru_order() == [h(4), h(2)]  # reads count as use
    assert (store.counters["hits_dram"], store.counters["hits_disk"], store.counters["misses"]) == (1, 1, 2)
    assert_log_matches(store)


async def test_pinned_and_leased_blocks_survive_pressure(make_store):
    store = make_store(slots=3, disk_blocks=None)
    await put(store, [1], pin=True)
    await put(store, [2, 3])
    found = await store.acquire([h(2)])  # a reader holds 2
    for i in (4, 5):
        await put(store, [i])
    assert events_of(store.events) == [
        ("stored", "dram", [1]), ("stored", "dram", [2, 3]),
        ("evicted", "dram", [3]), ("stored", "dram", [4]),  # 1 is older but pinned; 2 is being read
        ("evicted", "dram", [4]), ("stored", "dram", [5]),
    ]  # fmt: skip
    held = await store.acquire([h(5)])
    await put(store, [6])  # nothing unpinned can go: now the pinned block does
    assert events_of(store.events) == [("evicted", "dram", [1]), ("stored", "dram", [6])]
    more = await store.acquire([h(6)])
    assert await store.reserve(1) == []  # every slot is being read: no room, nothing evicted
    assert sorted(store.dram) == [h(2), h(5), h(6)] and events_of(store.events) == []
    assert bytes(store.slot_view(found[0][1])) == payload(2)
    store.release([f[1] for f in found + held + more])
    assert_log_matches(store)


async def test_a_put_that_never_commits_frees_its_slots_and_shows_nothing(make_store):
    store = make_store(slots=2, disk_blocks=None)
    slots = await store.reserve(2)
    assert store.locate([h(1)]) == [None] and store.dram.num_free_slots == 0
    store.give_back(slots)
    assert store.dram.num_free_slots == 2 and events_of(store.events) == []
    assert await put(store, [1]) == 1
    assert await put(store, [1]) == 0  # committing a block held already is a no-op
    assert events_of(store.events) == [("stored", "dram", [1])]


async def test_a_corrupt_file_is_dropped_reported_and_a_miss(make_store):
    store = make_store(slots=1, disk_blocks=4)
    await store.start()
    await put(store, [1])
    await put(store, [2])  # 1 goes to disk
    path = store.disk.files.path(h(1))
    with open(path, "r+b") as f:
        f.seek(HEADER.size + 100)
        byte = f.read(1)
        f.seek(HEADER.size + 100)
        f.write(bytes([byte[0] ^ 1]))
    assert await read(store, [1]) == [None]
    assert not path.exists() and store.counters["corrupt_blocks"] == 1
    assert events_of(store.events)[-1] == ("removed", "disk", [1])
    # making room for the failed read had demoted 2: it is served, bit-exact, from disk
    assert await read(store, [2]) == [("disk", payload(2))]
    assert_log_matches(store)


async def test_restart_rebuilds_the_index_and_drops_partial_and_foreign_files(make_store, tmp_path):
    first = make_store(slots=1, disk_blocks=8, directory=tmp_path / "d")
    await first.start()
    for i in (1, 2, 3):
        await put(first, [i])  # 1 and 2 end on disk
    d = tmp_path / "d"
    (d / f".{h(9).hex()}.abcd.tmp").write_bytes(b"half a block")
    (d / f"{h(8).hex()}.kvb").write_bytes(b"short")
    good = (d / f"{h(1).hex()}.kvb").read_bytes()
    (d / f"{h(7).hex()}.kvb").write_bytes(good)  # right size, but its header names another block
    (d / "notes.txt").write_text("not ours")
    second = make_store(slots=2, disk_blocks=8, directory=d)  # a disk hit is read into a DRAM slot
    await second.start()
    assert events_of(second.events) == [("stored", "disk", [1, 2])]
    assert sorted(os.listdir(d)) == sorted([f"{h(1).hex()}.kvb", f"{h(2).hex()}.kvb", "notes.txt"])
    assert await read(second, [2, 1]) == [("disk", payload(2)), ("disk", payload(1))]
    assert_log_matches(second)


async def test_remove_drops_a_block_from_every_tier(make_store):
    store = make_store(slots=1, disk_blocks=4)
    await store.start()
    await put(store, [1])
    await put(store, [2])
    assert await read(store, [1]) == [("disk", payload(1))]  # now in both tiers
    events_of(store.events)
    assert store.locate([h(1), h(2)]) == ["dram", "disk"]
    assert await store.remove([h(1), h(1), h(5)]) == 1
    assert events_of(store.events) == [("removed", "dram", [1]), ("removed", "disk", [1])]
    assert store.locate([h(1)]) == [None] and not store.disk.files.path(h(1)).exists()
    assert_log_matches(store)


def test_block_files_are_header_plus_one_block():
    assert HEADER.size == 64 and BLOCK == 256
