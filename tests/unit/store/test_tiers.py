"""DRAM and disk together: exact eviction order and events, capacities never
exceeded, pinned and leased blocks surviving pressure, write-back, promotion,
corruption, restart and removal."""

import os

from services.store.app import disk_state
from services.store.block_files import HEADER
from services.store.tier import TierStats
from tests.unit.store.conftest import BLOCK, events_of, h, payload, put, read


def assert_log_matches(store) -> None:
    """The event log's view of the store equals the store's tiers, exactly."""
    for tier in store.tiers:
        assert store.events.contents(tier.name) == set(tier)
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



class MemoryTier:
    """A test-only lower tier: blocks in a dict, no capacity of its own, nothing leased."""

    name = "memory"

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.written: dict[bytes, bytes] = {}  # by `put`, not visible until `add`
        self.on_evicted = lambda hashes: None

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self):
        return iter(list(self.blocks))

    def lru_order(self) -> list[bytes]:
        return list(self.blocks)

    def stats(self) -> TierStats:
        return TierStats(num_blocks=len(self.blocks), used_bytes=len(self.blocks) * BLOCK, capacity_bytes=1 << 20)

    async def load(self) -> tuple[list[bytes], list[bytes]]:
        return list(self.blocks), []

    def lease(self, block_hash: bytes) -> None:
        pass

    def release(self, block_hash: bytes) -> None:
        pass

    async def get_into(self, block_hash: bytes, into: memoryview) -> bool:
        into[:] = self.blocks[block_hash]
        return True

    async def put(self, block_hash: bytes, payload: memoryview) -> bool:
        self.written[block_hash] = bytes(payload)
        return True

    async def put_many(self, blocks: list[tuple[bytes, memoryview]]) -> list[bool]:
        return [await self.put(block_hash, payload) for block_hash, payload in blocks]

    def add(self, block_hash: bytes) -> None:
        self.blocks[block_hash] = self.written.pop(block_hash)

    async def discard(self, block_hash: bytes) -> None:
        del self.written[block_hash]

    def forget(self, block_hash: bytes) -> bool:
        return self.blocks.pop(block_hash, None) is not None

    async def delete(self, block_hashes: list[bytes]) -> None:
        pass

    def close(self) -> None:
        pass


async def test_a_tier_appended_after_disk_serves_a_get(make_store):
    memory = MemoryTier()
    memory.blocks[h(9)] = payload(9)
    store = make_store(slots=2, disk_blocks=2, compose=lambda disk: [*disk, memory])
    await store.start()
    assert events_of(store.events) == [("stored", "memory", [9])]
    await put(store, [1])
    assert store.locate([h(9), h(1), h(2)]) == ["memory", "dram", None]
    assert await read(store, [9]) == [("memory", payload(9))]  # a copy up: memory keeps it
    assert events_of(store.events) == [("stored", "dram", [1]), ("promoted", "dram", [9])]
    assert store.locate([h(9)]) == ["dram"] and h(9) in memory and store.counters["hits_memory"] == 1
    assert await store.remove([h(9)]) == 1
    assert events_of(store.events) == [("removed", "dram", [9]), ("removed", "memory", [9])]
    assert_log_matches(store)


async def test_a_tier_between_dram_and_disk_takes_the_write_downs(make_store):
    memory = MemoryTier()
    store = make_store(slots=1, disk_blocks=2, compose=lambda disk: [memory, *disk])
    await store.start()
    await put(store, [1])
    await put(store, [2])  # 1 is written down to the next tier, which is memory, not disk
    assert events_of(store.events) == [("stored", "dram", [1]), ("demoted", "memory", [1]), ("stored", "dram", [2])]
    assert memory.blocks == {h(1): payload(1)} and len(store.disk) == 0
    assert await store.flush() == 1  # the write-behind's target is memory too
    assert memory.blocks == {h(1): payload(1), h(2): payload(2)} and len(store.disk) == 0
    assert await read(store, [1]) == [("memory", payload(1))]
    assert_log_matches(store)


async def test_the_start_log_says_what_the_disk_tier_holds_even_when_empty(make_store, tmp_path):
    store = make_store(slots=2, disk_blocks=2)
    await store.start()
    capacity = 2 * (HEADER.size + BLOCK)
    assert disk_state(store.disk) == f"0 blocks (0 bytes) found in {tmp_path / 'blocks'}, capacity {capacity} bytes"
    await put(store, [1])
    assert await store.flush() == 1
    again = make_store(slots=2, disk_blocks=2)
    await again.start()
    assert disk_state(again.disk) == (f"1 blocks ({HEADER.size + BLOCK} bytes) found in {tmp_path / 'blocks'}, "
                                      f"capacity {capacity} bytes")  # fmt: skip
    assert disk_state(make_store(slots=1, disk_blocks=None).disk) == "off"

