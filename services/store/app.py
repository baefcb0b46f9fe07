"""The store service: one instance of the sharded KV block store, answering its
batched operations (exists, get, put + commit, remove, stats) on its own NATS
subjects, publishing exact KV events, and moving block bytes only through the
transfer engine (shared memory on this host, TCP otherwise).

Every request carries the caller's KV contract and the block size it means;
either one differing from the store's is refused with the difference named, so
a mismatch can never pass for a 0% hit rate. An unknown operation or a message
that does not decode gets an error reply, and the store keeps serving. Which
instance owns which block is the callers' business (`libs/common/hash_ring.py`).

The disk tier's directory belongs to one KV contract (`manifest.py`): a store
of another contract is refused before it opens a file. Committed blocks are
written behind to disk; a graceful stop writes whatever is still pending.
"""

import asyncio
import time
from contextlib import AsyncExitStack

from nats.aio.msg import Msg

from libs.common.kv_events import KVEventLog, KVEventPublisher
from libs.common.service import Service
from libs.common.store_client import STORE_CALLS
from libs.protocol import subjects
from libs.protocol.hashing import BlockHash
from libs.protocol.schema import (
    CostCoefficients,
    ErrorReply,
    Heartbeat,
    KVContract,
    StoreBeat,
    StoreCommitReply,
    StoreCommitRequest,
    StoreExistsReply,
    StoreExistsRequest,
    StoreGetReply,
    StoreGetRequest,
    StorePutReply,
    StorePutRequest,
    StoreRemoveReply,
    StoreRemoveRequest,
    StoreStatsReply,
    StoreStatsRequest,
)
from libs.protocol.vocabulary import ErrorCode, KVTier
from libs.transfer import Descriptor, SharedSegment, Span, TransferEngine, TransferError
from libs.transfer.segment import new_segment_name, remove_stale_segments
from services.store.block_files import BlockFiles, contract_digest
from services.store.disk import DiskTier
from services.store.manifest import claim_directory
from services.store.puts import PendingPut, PendingPuts
from services.store.settings import StoreSettings
from services.store.store_metrics import declare_store_metrics
from services.store.tier import LowerTier, TierStats
from services.store.tiers import TieredStore

INLINE_COPY_BYTES = 256 << 10  # shm copies up to this size run on the event loop (a thread costs more)
LOAD_EWMA = 0.2  # weight of the newest sample in the measured per-block load times


class StoreService(Service):
    settings: StoreSettings

    def __init__(self, settings: StoreSettings, contract: KVContract, block_nbytes: int) -> None:
        super().__init__(settings)
        self.contract = contract
        self.block_nbytes = block_nbytes
        num_slots = settings.capacity_bytes // block_nbytes
        if num_slots < 1:
            raise ValueError(f"KVSERVE_STORE_CAPACITY_BYTES={settings.capacity_bytes} holds no block of "
                             f"{block_nbytes} bytes")  # fmt: skip
        digest = contract_digest(contract)
        if settings.disk_bytes and claim_directory(settings.directory, contract, digest, block_nbytes):
            self.log.info("claimed %s for KV contract %s", settings.directory, digest.hex()[:12])
        removed = remove_stale_segments()
        if removed:
            self.log.info("removed %d shared-memory segments left by dead processes", len(removed))
        self.segment = SharedSegment.create(new_segment_name(self.instance_id, "dram"), num_slots * block_nbytes)
        t = settings.transfer
        self.transfers = TransferEngine(settings.host_id, listen=f"{t.listen_host}:0", transport=t.transport,
                                        connections=t.connections, timeout=t.timeout,
                                        max_connections=t.max_connections, idle_timeout=t.idle_timeout,
                                        tls=t.tls, metrics=self.metrics)  # fmt: skip
        self.transfers.register(self.segment)
        lower: list[LowerTier] = []  # the tiers below DRAM, fastest first: a new tier is one entry here
        if settings.disk_bytes:
            lower.append(DiskTier(BlockFiles(settings.directory, digest, block_nbytes), settings.disk_bytes))
        self.events = KVEventLog(self.instance_id)
        self.tiers = TieredStore(self.segment, block_nbytes, lower, self.events)
        declare_store_metrics(self.metrics, self.tiers)
        self.puts = PendingPuts(self._put_expired)
        self.load_per_block: dict[str, float] = {}  # measured seconds to serve one block, by tier
        self._ops_subscription = None
        self._write_behind: asyncio.Task | None = None
        handlers = {"exists": self.on_exists, "get": self.on_get, "put": self.on_put, "commit": self.on_commit,
                    "remove": self.on_remove, "stats": self.on_stats}  # fmt: skip
        self._ops = {op: (request, handlers[op]) for op, (request, _) in STORE_CALLS.items()}  # op -> (request, handler)

    async def start(self, stack: AsyncExitStack) -> None:
        stack.callback(self._close)
        await self.tiers.start()
        self.log.info("DRAM tier: %d slots of %d bytes in %s; disk tier: %s", self.tiers.dram.num_slots,
                      self.block_nbytes, self.segment.name, disk_state(self.tiers.disk))  # fmt: skip
        await KVEventPublisher(self, self.events).start(stack)
        if self.tiers.next_tier is not None:
            self._write_behind = self.spawn(self.tiers.write_behind(self.settings.write_behind_s), essential=True)
        self._ops_subscription = await self.nc.subscribe(subjects.store_ops(self.instance_id), cb=self._dispatch)

    async def stop(self) -> None:
        """Take no more operations, then put every block DRAM holds and disk lacks on disk."""
        if self._ops_subscription is not None:
            await self._ops_subscription.unsubscribe()
        if self._write_behind is not None:
            self._write_behind.cancel()
            pending, before = self.tiers.num_unwritten, self.tiers.counters["written_behind"]
            await self.tiers.flush()  # after a flush under way, if any
            written = self.tiers.counters["written_behind"] - before
            self.log.info("wrote %d of %d pending blocks to disk before stopping", written, pending)

    def _close(self) -> None:
        self.puts.expire_all()
        for tier in self.tiers.lower:
            tier.close()
        self.transfers.close()

    async def _dispatch(self, msg: Msg) -> None:
        op = msg.subject.rsplit(".", 1)[-1]
        entry = self._ops.get(op)
        if entry is None:
            self.log.warning("refused unknown operation %r", op)
            error = ErrorReply(code=ErrorCode.UNKNOWN_OP, message=f"store {self.instance_id} has no operation {op!r}; "
                                                         f"it answers {', '.join(subjects.STORE_OPS)}")  # fmt: skip
            self.spawn(self._reply(msg, error))
            return
        self.spawn(self._handle(msg, *entry))

    def _refusal(self, contract: KVContract, block_nbytes: int | None = None) -> ErrorReply | None:
        mismatch = self.contract.mismatch(contract)
        if mismatch is not None:
            self.log.warning("refused a peer: %s", mismatch)
            return ErrorReply(code=ErrorCode.CONTRACT_MISMATCH, message=f"store {self.instance_id}: {mismatch}")
        if block_nbytes is not None and block_nbytes != self.block_nbytes:
            self.log.warning("refused blocks of %d bytes", block_nbytes)
            return ErrorReply(code=ErrorCode.BAD_BLOCK_SIZE, message=(
                f"store {self.instance_id}: blocks of {block_nbytes} bytes refused; its slots hold exactly "
                f"{self.block_nbytes} bytes (one KV block, every layer, under contract {self.contract.layout})"))  # fmt: skip
        return None

    # --- operations ---------------------------------------------------------------------
    async def on_exists(self, request: StoreExistsRequest, msg: Msg) -> StoreExistsReply | ErrorReply:
        if error := self._refusal(request.contract):
            return error
        return StoreExistsReply(tiers=self.tiers.locate([BlockHash(h) for h in request.block_hashes]))

    async def on_get(self, request: StoreGetRequest, msg: Msg) -> StoreGetReply | ErrorReply:
        if error := self._refusal(request.contract, request.block_nbytes) or _lengths_differ(request):
            return error
        started = time.perf_counter()
        found = await self.tiers.acquire([BlockHash(h) for h in request.block_hashes])
        slots = [f[1] for f in found if f is not None]
        try:
            spans = [Span(self.tiers.slot_offset(f[1]), offset, self.block_nbytes)
                     for f, offset in zip(found, request.offsets) if f is not None]  # fmt: skip
            if spans:
                await self._write_out(request, spans)
        except TransferError as e:
            return ErrorReply(code=ErrorCode(e.cause), message=f"store {self.instance_id}: {e}")
        finally:
            self.tiers.release(slots)
        tiers = [f[0] if f is not None else None for f in found]
        self._measure_load(tiers, time.perf_counter() - started)
        return StoreGetReply(tiers=tiers)

    async def _write_out(self, request: StoreGetRequest, spans: list[Span]) -> None:
        """Into the caller's blocks: a plain copy between mapped segments on this host
        (small ones right here, they take microseconds), a TCP transfer otherwise."""
        loop = asyncio.get_running_loop()
        ticket = request.ticket
        if self.transfers.choose_transport(ticket) == "shm":
            self.transfers.claim(ticket)  # no TCP writer may use it too
            batch = [Descriptor(self.segment.name, s.src_offset, ticket.segment, s.dst_offset, s.length) for s in spans]
            if sum(s.length for s in spans) <= INLINE_COPY_BYTES:
                self.transfers.copy(batch)
            else:
                await loop.run_in_executor(None, self.transfers.copy, batch)
            return
        writer = await loop.run_in_executor(None, self.transfers.writer, ticket, self.segment.name)  # dials: off the loop
        writer.submit(spans)
        await self.transfers.finish(writer)

    def _measure_load(self, tiers: list[str | None], seconds: float) -> None:
        hit = [t for t in tiers if t is not None]
        if hit and len(set(hit)) == 1:
            per_block = seconds / len(hit)
            old = self.load_per_block.get(hit[0])
            self.load_per_block[hit[0]] = per_block if old is None else old + LOAD_EWMA * (per_block - old)

    async def on_put(self, request: StorePutRequest, msg: Msg) -> StorePutReply | ErrorReply:
        if error := self._refusal(request.contract, request.block_nbytes):
            return error
        hashes = [BlockHash(h) for h in request.block_hashes]
        where = self.tiers.locate(hashes)
        if request.pin:
            self.tiers.pin([h for h, tier in zip(hashes, where) if tier == KVTier.DRAM])
        first: dict[BlockHash, int] = {}
        for i, (h, tier) in enumerate(zip(hashes, where)):
            if tier is None:
                first.setdefault(h, i)  # a hash twice in one put is written once
        missing = list(first.values())
        slots = await self.tiers.reserve(len(missing))
        placed, no_room = missing[: len(slots)], missing[len(slots) :]
        if no_room:
            self.log.warning("no room for %d of %d blocks: every slot is pinned, leased or reserved", len(no_room),
                             len(missing))  # fmt: skip
        if not placed:
            return StorePutReply(no_room=no_room)
        ttl = self.settings.put_ttl_s
        offsets = [self.tiers.slot_offset(s) for s in slots]
        ticket = self.transfers.expect(self.segment.name, [(o, self.block_nbytes) for o in offsets], ttl,
                                       sender_host=request.host_id)  # fmt: skip
        put = self.puts.open([hashes[i] for i in placed], slots, request.pin, ticket.token, ttl, request.owner)
        return StorePutReply(put_id=put.put_id, missing=placed, offsets=offsets, ticket=ticket, ttl_s=ttl,
                             no_room=no_room)  # fmt: skip

    async def on_commit(self, request: StoreCommitRequest, msg: Msg) -> StoreCommitReply | ErrorReply:
        if error := self._refusal(request.contract):
            return error
        put = self.puts.take(request.put_id)
        if put is None:
            return ErrorReply(code=ErrorCode.UNKNOWN_PUT, message=(
                f"store {self.instance_id}: no put {request.put_id!r} is open (never opened, committed, or expired)"))  # fmt: skip
        record = self.transfers.close_ticket(put.token)
        if record is not None and record.failed:
            self.tiers.give_back(put.slots)
            return ErrorReply(code=ErrorCode(record.failed), message=(
                f"store {self.instance_id}: the put's transfer failed ({record.failed}); nothing stored"))  # fmt: skip
        return StoreCommitReply(num_stored=self.tiers.commit(put.hashes, put.slots, put.pin, put.owner))

    def _put_expired(self, put: PendingPut) -> None:
        self.log.warning("put %s was not committed in time: %d slots given back", put.put_id, len(put.slots))
        self.transfers.close_ticket(put.token)
        self.tiers.give_back(put.slots)
        self.tiers.counters["puts_expired"] += 1

    async def on_remove(self, request: StoreRemoveRequest, msg: Msg) -> StoreRemoveReply | ErrorReply:
        if error := self._refusal(request.contract):
            return error
        return StoreRemoveReply(num_removed=await self.tiers.remove([BlockHash(h) for h in request.block_hashes]))

    async def on_stats(self, request: StoreStatsRequest, msg: Msg) -> StoreStatsReply | ErrorReply:
        if error := self._refusal(request.contract):
            return error
        dram, disk = self.tiers.dram, self.tiers.disk
        on_disk = disk.stats() if disk is not None else TierStats(num_blocks=0, used_bytes=0, capacity_bytes=0)
        return StoreStatsReply(
            instance_id=self.instance_id, block_nbytes=self.block_nbytes,
            dram_slots=dram.num_slots, dram_blocks=len(dram), dram_pinned=dram.num_pinned, dram_leased=dram.num_leased,
            disk_blocks=on_disk.num_blocks, disk_bytes=on_disk.used_bytes,
            disk_capacity_bytes=on_disk.capacity_bytes, disk_pending=self.tiers.num_unwritten,
            counters=dict(self.tiers.counters), kv_epoch=self.events.epoch, kv_seq=self.events.seq,
            dram_owners=dram.owners(),
        )  # fmt: skip

    # --- membership -------------------------------------------------------------------------
    def heartbeat(self) -> Heartbeat:
        beat = super().heartbeat()
        dram = self.tiers.dram
        beat.payload = StoreBeat(
            capacity=dram.num_slots, free_blocks=dram.num_free_slots, segment=self.segment.name, contract=self.contract,
            kv_epoch=self.events.epoch, kv_seq=self.events.published_seq,
        )  # fmt: skip
        if self.load_per_block:  # a store's cost model is its measured load times; the rest does not apply
            per_block = dict(self.load_per_block)
            beat.payload.cost = CostCoefficients(
                block_size=self.contract.block_size, prefill_base=0.0, prefill_per_token=0.0,
                prefill_per_token_context=0.0, decode_base=0.0, decode_per_seq=0.0, decode_per_context_token=0.0,
                transfer_per_block=per_block.get(KVTier.DRAM, 0.0), load_per_block=per_block,
            )  # fmt: skip
        return beat


def _lengths_differ(request: StoreGetRequest) -> ErrorReply | None:
    if len(request.block_hashes) != len(request.offsets):
        return ErrorReply(code=ErrorCode.INVALID_REQUEST, message="block_hashes and offsets differ in length")
    return None


def disk_state(disk: LowerTier | None) -> str:
    """What the start log says of the disk tier once loaded: what it holds and where,
    or "off" when none is composed (an empty tier is still a tier)."""
    if disk is None:
        return "off"
    stats = disk.stats()
    where = f" in {disk.files.directory}" if isinstance(disk, DiskTier) else ""
    return f"{stats.num_blocks} blocks ({stats.used_bytes} bytes) found{where}, capacity {stats.capacity_bytes} bytes"
