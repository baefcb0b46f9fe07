"""The store's operations.

Each store instance answers on its own subjects (subjects.store_op). Block bytes
never travel here: a get writes into the caller's WriteTicket, a put hands the
caller a WriteTicket for fresh slots, and the blocks become visible at commit.
"""

import msgspec

from libs.protocol.hashing import BlockHash
from libs.protocol.ids import InstanceId
from libs.protocol.schema.codec import Message
from libs.protocol.schema.contracts import CacheOwner, KVContract, WriteTicket
from libs.protocol.vocabulary import StoreTier


class StoreExistsRequest(Message):
    contract: KVContract
    block_hashes: list[BlockHash]


class StoreExistsReply(Message):
    tiers: list[StoreTier | None]  # per hash: fastest tier, None = absent


class StoreGetRequest(Message):
    """Write every stored block of ``block_hashes`` through ``ticket`` at ``offsets``
    (one per hash) of the caller's segment; each block is ``block_nbytes`` long."""

    contract: KVContract
    block_hashes: list[BlockHash]
    block_nbytes: int
    ticket: WriteTicket
    offsets: list[int]


class StoreGetReply(Message):
    tiers: list[StoreTier | None]  # per hash: where it came from; None = miss


class StorePutRequest(Message):
    """Phase one of a put: which of these blocks does the store lack? Blocks it holds
    already are a no-op (pinned if ``pin``)."""

    contract: KVContract
    block_hashes: list[BlockHash]
    block_nbytes: int
    pin: bool = False  # evicted only when no unpinned block can be
    host_id: str | None = None  # the writer's host for shared memory; None: it may write over TCP (the store listens)
    owner: CacheOwner | None = None  # whose blocks (a tenant's cache scope); None: nobody's


class StorePutReply(Message):
    """Write block ``block_hashes[missing[i]]`` at ``offsets[i]`` through ``ticket``,
    then commit ``put_id`` within ``ttl_s`` seconds; ``no_room``: blocks the store
    could not place (every slot pinned or being read)."""

    put_id: str | None = None  # None: nothing to write (all held already, or no room)
    missing: list[int] = msgspec.field(default_factory=list)
    offsets: list[int] = msgspec.field(default_factory=list)
    ticket: WriteTicket | None = None
    ttl_s: float = 0.0
    no_room: list[int] = msgspec.field(default_factory=list)


class StoreCommitRequest(Message):
    """Phase two of a put: the bytes are written; make the blocks visible."""

    contract: KVContract
    put_id: str


class StoreCommitReply(Message):
    num_stored: int


class StoreRemoveRequest(Message):
    contract: KVContract
    block_hashes: list[BlockHash]


class StoreRemoveReply(Message):
    num_removed: int  # blocks that were held in some tier


class StoreStatsRequest(Message):
    contract: KVContract


class StoreStatsReply(Message):
    instance_id: InstanceId
    block_nbytes: int
    dram_slots: int
    dram_blocks: int
    dram_pinned: int
    dram_leased: int
    disk_blocks: int
    disk_bytes: int
    disk_capacity_bytes: int
    disk_pending: int  # blocks in DRAM the write-behind has not put on disk yet
    counters: dict[str, int]  # hits, misses, puts, evictions, corruptions...
    kv_epoch: int
    kv_seq: int
    dram_owners: dict[str, int] = msgspec.field(default_factory=dict)  # blocks in DRAM per owner (tenant scope)
