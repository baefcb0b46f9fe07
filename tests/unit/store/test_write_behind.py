"""Write-behind: every committed block reaches disk in a batch after its commit, with
exact events; eviction then writes nothing; a block removed mid-write leaves no
file; a put waiting for the flush's slots gets them; a cancelled write-behind
never stops a flush half-way."""

import asyncio
import threading

from services.store.block_files import BlockFiles
from tests.unit.store.conftest import events_of, h, payload, put, read
from tests.unit.store.test_tiers import assert_log_matches


class GatedFiles(BlockFiles):
    """Block files whose batch writes wait on the thread until the test opens the gate."""

    def __init__(self, files: BlockFiles, entered: asyncio.Event) -> None:
        super().__init__(files.directory, files.contract, files.block_nbytes)
        object.__setattr__(self, "gate", threading.Event())
        object.__setattr__(self, "entered", entered)
        object.__setattr__(self, "loop", asyncio.get_running_loop())

    def write_batch(self, blocks):
        self.loop.call_soon_threadsafe(self.entered.set)
        self.gate.wait(30)
        return super().write_batch(blocks)


def gate(store) -> GatedFiles:
    store.disk.files = GatedFiles(store.disk.files, asyncio.Event())
    return store.disk.files


async def test_a_flush_puts_every_committed_block_on_disk_and_eviction_then_writes_nothing(make_store):
    store = make_store(slots=2, disk_blocks=8)
    await store.start()
    await put(store, [1, 2])
    assert store.num_unwritten == 2 and len(store.disk) == 0
    assert await store.flush() == 2
    assert store.num_unwritten == 0 and store.disk.files.path(h(1)).exists() and store.disk.files.path(h(2)).exists()
    await put(store, [3])  # 1 leaves DRAM: disk has it already
    await put(store, [4])
    assert store.num_unwritten == 2 and store.counters["demoted"] == 0
    assert await store.flush() == 2
    assert events_of(store.events) == [
        ("stored", "dram", [1, 2]), ("stored", "disk", [1, 2]),
        ("evicted", "dram", [1]), ("stored", "dram", [3]),
        ("evicted", "dram", [2]), ("stored", "dram", [4]),
        ("stored", "disk", [3, 4]),
    ]  # fmt: skip
    assert store.disk.lru_order() == [h(1), h(2), h(3), h(4)]
    assert await read(store, [1, 4]) == [("disk", payload(1)), ("dram", payload(4))]
    assert_log_matches(store)


async def test_flushes_are_batched_and_a_block_evicted_before_its_flush_is_written_back(make_store):
    store = make_store(slots=2, disk_blocks=8)
    store.flush_batch = 1
    await store.start()
    await put(store, [1, 2])
    await put(store, [3])  # 1 was never flushed: written back on its way out
    assert store.num_unwritten == 2 and store.counters["demoted"] == 1
    await put(store, [5, 6])  # 2 and 3 too
    await put(store, [7])
    assert await store.flush() == 2  # 6, then 7 (one per batch); 5 was demoted by the last put
    assert events_of(store.events) == [
        ("stored", "dram", [1, 2]),
        ("demoted", "disk", [1]), ("stored", "dram", [3]),
        ("demoted", "disk", [2]), ("demoted", "disk", [3]), ("stored", "dram", [5, 6]),
        ("demoted", "disk", [5]), ("stored", "dram", [7]),
        ("stored", "disk", [6]), ("stored", "disk", [7]),
    ]  # fmt: skip
    assert store.num_unwritten == 0
    assert_log_matches(store)


async def test_the_write_behind_runs_on_its_own_after_a_commit(make_store):
    store = make_store(slots=4, disk_blocks=8)
    await store.start()
    events_of(store.events)
    landed = asyncio.Event()
    store.events.on_pending = landed.set  # the next event recorded after the commit's
    writer = asyncio.ensure_future(store.write_behind(0.0))
    try:
        await put(store, [1, 2])
        assert events_of(store.events) == [("stored", "dram", [1, 2])]
        landed.clear()
        await asyncio.wait_for(landed.wait(), 30)
        assert events_of(store.events) == [("stored", "disk", [1, 2])]
        assert store.num_unwritten == 0 and store.counters["written_behind"] == 2
    finally:
        writer.cancel()
    assert_log_matches(store)


async def test_a_block_removed_while_written_behind_leaves_no_file(make_store):
    store = make_store(slots=2, disk_blocks=8)
    await store.start()
    files = gate(store)
    await put(store, [1, 2])
    flush = asyncio.ensure_future(store.flush())
    await asyncio.wait_for(files.entered.wait(), 30)
    assert await store.remove([h(1)]) == 1  # its slot stays leased to the write until it ends
    files.gate.set()
    assert await flush == 1
    assert events_of(store.events) == [("stored", "dram", [1, 2]), ("removed", "dram", [1]), ("stored", "disk", [2])]
    assert not files.path(h(1)).exists() and files.path(h(2)).exists()
    assert store.dram.num_free_slots == 1
    assert_log_matches(store)


async def test_a_put_waits_for_the_slots_a_flush_is_reading_then_evicts_without_writing(make_store):
    store = make_store(slots=1, disk_blocks=8)
    await store.start()
    files = gate(store)
    await put(store, [1])
    flush = asyncio.ensure_future(store.flush())
    await asyncio.wait_for(files.entered.wait(), 30)
    second = asyncio.ensure_future(put(store, [2]))  # the one slot is being written: no room yet
    files.gate.set()
    assert await flush == 1 and await second == 1
    assert events_of(store.events) == [
        ("stored", "dram", [1]), ("stored", "disk", [1]), ("evicted", "dram", [1]), ("stored", "dram", [2]),
    ]  # fmt: skip
    assert store.counters["demoted"] == 0
    assert_log_matches(store)


async def test_cancelling_the_write_behind_never_cuts_a_flush_and_flush_finishes_the_rest(make_store):
    store = make_store(slots=4, disk_blocks=8)
    await store.start()
    files = gate(store)
    writer = asyncio.ensure_future(store.write_behind(0.0))
    await put(store, [1])
    await asyncio.wait_for(files.entered.wait(), 30)
    writer.cancel()  # as a stopping store does, mid-flush
    await put(store, [2])
    files.gate.set()
    assert await store.flush() == 0  # it waited for the flush under way, which wrote 1 and then 2
    assert [e for e in events_of(store.events) if e[1] == "disk"] == [("stored", "disk", [1]), ("stored", "disk", [2])]
    assert files.path(h(1)).exists() and files.path(h(2)).exists() and store.dram.num_leased == 0
    assert writer.cancelled()
    assert_log_matches(store)
