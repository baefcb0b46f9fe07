"""A TieredStore over a real shared-memory segment and a real directory, and helpers
that put blocks into it the way the service does (reserve, write the slot, commit)."""

import pytest

from libs.common.kv_events import KVEventLog
from libs.protocol.schema import KVContract
from libs.transfer import SharedSegment
from libs.transfer.segment import new_segment_name
from services.store.block_files import HEADER, BlockFiles, contract_digest
from services.store.disk import DiskTier
from services.store.tiers import TieredStore

BLOCK = 256
CONTRACT = KVContract(model_id="m", block_size=4, layout="test", hash_scheme="blake2b-128/chain-v1")


def h(i: int) -> bytes:
    return bytes([i]) * 16


def payload(i: int) -> bytes:
    return bytes((i * 31 + k) % 251 for k in range(BLOCK))


def events_of(log: KVEventLog) -> list[tuple]:
    """Every event recorded since the last call, as (kind, tier, [block numbers])."""
    out = []
    while (batch := log.take_batch()) is not None:
        out += [(e.kind, e.tier, [b[0] for b in e.block_hashes]) for e in batch.events]
    return out


@pytest.fixture
def make_store(tmp_path):
    made = []

    def make(slots: int, disk_blocks: int | None, directory=None, compose=lambda disk: disk) -> TieredStore:
        """``compose``: the tiers below DRAM, in order, given the disk tier's list."""
        segment = SharedSegment.create(new_segment_name("test", "store"), slots * BLOCK)
        disk = []
        if disk_blocks is not None:
            files = BlockFiles(directory or tmp_path / "blocks", contract_digest(CONTRACT), BLOCK)
            disk = [DiskTier(files, disk_blocks * (HEADER.size + BLOCK))]
        lower = compose(disk)
        events = KVEventLog("store-test", epoch=1, tiers=["dram", *(tier.name for tier in lower)])
        store = TieredStore(segment, BLOCK, lower, events)
        made.append(store)
        return store

    yield make
    for store in made:
        for tier in store.lower:
            tier.close()
        store.segment.close()


async def put(store: TieredStore, numbers: list[int], pin: bool = False) -> int:
    slots = await store.reserve(len(numbers))
    assert len(slots) == len(numbers), "no room"
    for i, slot in zip(numbers, slots):
        store.slot_view(slot)[:] = payload(i)
    return store.commit([h(i) for i in numbers], slots, pin)


async def read(store: TieredStore, numbers: list[int]) -> list[tuple[str, bytes] | None]:
    """acquire + copy out + release, as a get does."""
    found = await store.acquire([h(i) for i in numbers])
    out = [None if f is None else (f[0], bytes(store.slot_view(f[1]))) for f in found]
    store.release([f[1] for f in found if f is not None])
    return out
