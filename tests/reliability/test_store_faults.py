"""A store killed or stopped keeps what it promised. SIGKILL during a put: after a
restart the store shows each block whole or not at all (the failpoint
``store.stall_disk_write`` holds a block's disk write half-way, header and half
the payload fsynced in the temp file, until the kill). SIGKILL after the
write-behind ran: every block comes back. SIGTERM: every block comes back, those
the write-behind had not reached included."""

import asyncio
import time

import pytest

from libs.common.nats_server import NatsServer
from tests.integration.conftest import wait_until_async
from tests.integration.store_harness import Caller, StoreProcess, block_bytes, block_hash, store_contract


@pytest.fixture
def nats_url():
    server = NatsServer().start()
    yield server.url
    server.stop()


async def test_sigkill_during_a_put_leaves_the_whole_block_or_nothing(nats_url, tmp_path):
    contract, nb = store_contract()
    directory = tmp_path / "store-f"
    store = StoreProcess("store-f", nats_url, directory, slots=1, disk_blocks=8, block_nbytes=nb,
                         write_behind_s=3600).start()  # only eviction writes to disk here  # fmt: skip
    try:
        async with Caller(nats_url, contract, nb) as caller:
            await caller.wait_ready("store-f")
            x, y, a, b = (block_hash(i) for i in range(4))
            for i in range(4):
                caller.fill(i, block_bytes(i, nb))
            await caller.put("store-f", [x], [0])
            await caller.put("store-f", [y], [1])  # x is written back to disk, whole
            assert await caller.exists("store-f", [x, y]) == ["disk", "dram"]

            # restart with every disk write stalling half-way
            killed_at = time.time()
            store.kill()
            store.start(failpoints="store.stall_disk_write")
            await caller.wait_ready("store-f", started_after=killed_at)
            await caller.put("store-f", [a], [2])  # the one slot was free: no write-back yet
            put_b = asyncio.ensure_future(caller.put("store-f", [b], [3]))  # must write a back to make room
            await wait_until_async(lambda: store.logged("failpoint store.stall_disk_write") or put_b.done(), 30,
                                   "the write-back never started")  # fmt: skip
            assert not put_b.done(), "the write-back never started"
            partial = list(directory.glob("*.tmp"))
            assert len(partial) == 1 and 0 < partial[0].stat().st_size < nb
            killed_at = time.time()
            store.kill()  # mid-put: b waits for a slot, a is half on disk
            with pytest.raises(Exception):
                await put_b

            store.start(failpoints="")
            await caller.wait_ready("store-f", started_after=killed_at)
            assert await caller.exists("store-f", [x, y, a, b]) == ["disk", None, None, None]
            assert not list(directory.glob("*.tmp")) and store.logged("a write that never finished")
            assert await caller.get("store-f", [x], [10]) == ["disk"]
            assert caller.read(10) == block_bytes(0, nb)  # the whole block, bit for bit
            stats = await caller.stats("store-f")
            assert stats.disk_blocks == 1 and stats.dram_blocks == 1
    finally:
        store.stop()


async def test_blocks_written_behind_survive_sigkill_bit_exact(nats_url, tmp_path):
    contract, nb = store_contract()
    store = StoreProcess("store-k", nats_url, tmp_path / "store-k", slots=8, disk_blocks=16, block_nbytes=nb,
                         write_behind_s=0.2).start()  # fmt: skip
    try:
        async with Caller(nats_url, contract, nb) as caller:
            await caller.wait_ready("store-k")
            on_disk = await caller.watch_disk("store-k")
            hashes = [block_hash(i) for i in range(6)]
            for i in range(6):
                caller.fill(i, block_bytes(i, nb))
            assert await caller.put("store-k", hashes[:3], [0, 1, 2]) == 3
            assert await caller.put("store-k", hashes[3:], [3, 4, 5]) == 3
            assert await caller.exists("store-k", hashes) == ["dram"] * 6  # nothing evicted: room for all
            await wait_until_async(lambda: set(hashes) <= on_disk, 60, "the write-behind never wrote the blocks")
            stats = await caller.stats("store-k")
            assert stats.disk_pending == 0 and stats.counters["written_behind"] == 6
            assert stats.counters.get("demoted", 0) == 0  # no eviction wrote them

            killed_at = time.time()
            store.kill()
            store.start()
            await caller.wait_ready("store-k", started_after=killed_at)
            assert await caller.get("store-k", hashes, list(range(10, 16))) == ["disk"] * 6
            assert [caller.read(10 + i) for i in range(6)] == [block_bytes(i, nb) for i in range(6)]
    finally:
        store.stop()


async def test_a_graceful_stop_writes_every_pending_block_before_it_exits(nats_url, tmp_path):
    contract, nb = store_contract()
    store = StoreProcess("store-g", nats_url, tmp_path / "store-g", slots=8, disk_blocks=16, block_nbytes=nb,
                         write_behind_s=3600).start()  # the write-behind never runs by itself here  # fmt: skip
    try:
        async with Caller(nats_url, contract, nb) as caller:
            await caller.wait_ready("store-g")
            hashes = [block_hash(i) for i in range(5)]
            for i in range(5):
                caller.fill(i, block_bytes(i, nb))
            assert await caller.put("store-g", hashes[:3], [0, 1, 2]) == 3
            stats = await caller.stats("store-g")
            assert (stats.disk_pending, stats.disk_blocks) == (3, 0)
            assert await caller.put("store-g", hashes[3:], [3, 4]) == 2
            assert store.terminate() == 0  # right after the last put
            assert store.logged("wrote 5 of 5 pending blocks to disk before stopping")

            started = time.time()
            store.start()
            await caller.wait_ready("store-g", started_after=started)
            assert await caller.get("store-g", hashes, list(range(10, 15))) == ["disk"] * 5
            assert [caller.read(10 + i) for i in range(5)] == [block_bytes(i, nb) for i in range(5)]
    finally:
        store.stop()
