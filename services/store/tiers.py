"""The tiers together, an ordered list fastest first (`tier.py`: DRAM, then the
lower tiers, the disk tier in the service): what a get, a put, a remove does to
each, and the exact KV events each change produces.

Inclusive tiers, DRAM a cache over the next tier: a committed block is written
behind to the next tier (`write_behind`: in batches, a bounded delay after its
commit; event ``stored`` there when it is in place), so evicting it from DRAM
costs no write (event ``evicted`` from dram). A block evicted before its
write-behind ran is written back on the way out (event ``demoted``, dram ->
next tier). A hit in a lower tier (the first that holds it) is read into a DRAM
slot and stays where it was (event ``promoted``, that tier -> dram, a copy up).
A lower tier's own evictions for capacity drop the block from it (event
``evicted``). Every event is recorded in the same synchronous step as the
change it reports, so the log's contents equal the tiers' at every await point.

Runs on the event loop: bookkeeping here, bytes in the lower tiers (the disk
tier's threads) and in the transfer engine.
"""

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Sequence
from functools import partial

from libs.common.kv_events import KVEventLog
from libs.protocol.hashing import BlockHash
from libs.protocol.schema.contracts import CacheOwner
from libs.protocol.vocabulary import KVEventKind, KVTier
from libs.transfer import SharedSegment
from services.store.dram import DramTier
from services.store.tier import LowerTier, Tier

Found = tuple[str, int]  # (name of the tier it came from, DRAM slot now leased to the caller)
FLUSH_BATCH_BYTES = 64 << 20  # a flush writes (and leases) at most this much per thread job

log = logging.getLogger(__name__)


class TieredStore:
    def __init__(
        self, segment: SharedSegment, block_nbytes: int, lower: Sequence[LowerTier], events: KVEventLog
    ) -> None:
        """``lower``: the tiers below DRAM, fastest first (may be empty)."""
        self.segment = segment
        self.block_nbytes = block_nbytes
        self.dram = DramTier(segment.nbytes // block_nbytes, block_nbytes)
        self.lower = list(lower)
        self.tiers: list[Tier] = [self.dram, *self.lower]
        assert len({t.name for t in self.tiers}) == len(self.tiers), "two tiers of one name"
        self.next_tier = self.lower[0] if self.lower else None  # where DRAM writes behind and evicts to
        self.events = events
        self.counters: Counter[str] = Counter()
        self._evicting = 0
        self._freed = asyncio.Event()
        self._promoting: dict[BlockHash, asyncio.Future] = {}
        self._cancelled: set[BlockHash] = set()  # removed while being promoted
        self._unwritten: dict[BlockHash, None] = {}  # not in the next tier yet: the write-behind's queue, oldest first
        self._unwritten_added = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._flushing = 0  # flush batches under way
        self._in_flight = 0  # blocks they are writing
        self.flush_batch = max(1, FLUSH_BATCH_BYTES // block_nbytes)
        for tier in self.lower:
            tier.on_evicted = partial(self._lower_evicted, tier.name)

    @property
    def disk(self) -> LowerTier | None:
        """The disk tier, if composed."""
        return next((t for t in self.lower if t.name == KVTier.DISK), None)

    async def start(self) -> None:
        """Rebuild each lower tier's index; what they hold is the first event of this epoch."""
        for tier in self.lower:
            kept, dropped = await tier.load()
            self.events.record(KVEventKind.STORED, tier.name, kept)
            self.counters[f"{tier.name}_dropped_at_start"] += len(dropped)

    @property
    def num_unwritten(self) -> int:
        """Blocks in DRAM that the write-behind has not put in the next tier yet (being written included)."""
        return len(self._unwritten) + self._in_flight

    def slot_view(self, slot: int) -> memoryview:
        return self.segment.view[slot * self.block_nbytes : (slot + 1) * self.block_nbytes]

    def slot_offset(self, slot: int) -> int:
        return slot * self.block_nbytes

    # --- lookups ----------------------------------------------------------------------
    def locate(self, hashes: Sequence[BlockHash]) -> list[str | None]:
        """The name of the fastest tier holding each block, or None."""
        return [next((t.name for t in self.tiers if h in t), None) for h in hashes]

    def _lower_holder(self, h: BlockHash) -> LowerTier | None:
        return next((t for t in self.lower if h in t), None)

    async def acquire(self, hashes: Sequence[BlockHash]) -> list[Found | None]:
        """Lease a DRAM slot holding each block (promoting hits in lower tiers); the
        caller copies out of the slots, then `release`s them. None: a miss."""
        found: list[Found | None] = [None] * len(hashes)
        promote: dict[int, tuple[BlockHash, LowerTier]] = {}
        for i, h in enumerate(hashes):  # DRAM hits first, leased before anything can evict them
            slot = self.dram.slot_of(h)
            if slot is not None:
                self.dram.lease(slot)
                self.dram.touch(h)
                found[i] = (KVTier.DRAM, slot)
            elif (source := self._lower_holder(h)) is not None:
                promote[i] = (h, source)
        slots = await asyncio.gather(*(self._promote(h, source) for h, source in promote.values()))
        for (i, (_, source)), slot in zip(promote.items(), slots):
            if slot is not None:
                found[i] = (source.name, slot)
        hits = Counter(f[0] for f in found if f is not None)
        self.counters.update({f"hits_{tier}": n for tier, n in hits.items()})
        self.counters["misses"] += len(hashes) - sum(hits.values())
        return found

    def release(self, slots: Sequence[int]) -> None:
        for slot in slots:
            if self.dram.release(slot):
                self._slot_freed()

    async def _promote(self, h: BlockHash, source: LowerTier) -> int | None:
        """Read a block of ``source`` into a DRAM slot (it stays there too); the slot, leased, or None."""
        if h in self._promoting:  # someone is reading it already: use theirs
            await asyncio.shield(self._promoting[h])
            slot = self.dram.slot_of(h)
            if slot is not None:
                self.dram.lease(slot)
            return slot
        done = self._promoting[h] = asyncio.get_running_loop().create_future()
        try:
            return await self._read_up(h, source)
        finally:
            del self._promoting[h]
            self._cancelled.discard(h)
            done.set_result(None)

    async def _read_up(self, h: BlockHash, source: LowerTier) -> int | None:
        source.lease(h)  # making room must not evict the block we came for
        try:
            reserved = await self.reserve(1)
        finally:
            source.release(h)
        if not reserved:
            self.counters["promotions_without_room"] += 1
            return None
        slot = reserved[0]
        if h not in source:  # evicted or removed while we made room
            self.dram.give_back(slot)
            return None
        if not await source.get_into(h, self.slot_view(slot)):
            self.dram.give_back(slot)
            self.counters["corrupt_blocks"] += 1
            self.events.record(KVEventKind.REMOVED, source.name, [h])  # get_into took it out of the tier
            return None
        if h in self._cancelled or h in self.dram:  # removed meanwhile, or a put committed it
            self.dram.give_back(slot)
            slot = self.dram.slot_of(h)
            if slot is not None:
                self.dram.lease(slot)
            return slot
        self.dram.insert(h, slot)
        self.events.record(KVEventKind.PROMOTED, KVTier.DRAM, [h], source_tier=source.name)  # a copy up: the source keeps it
        self.counters["promotions"] += 1
        self.dram.lease(slot)
        return slot

    # --- puts ---------------------------------------------------------------------------
    async def reserve(self, count: int) -> list[int]:
        """Up to ``count`` free DRAM slots, evicting for them in LRU order; fewer only
        when every other slot is pinned-and-leased, leased or reserved."""
        got: list[int] = []
        while len(got) < count:
            while len(got) < count and (slot := self.dram.take_free_slot()) is not None:
                got.append(slot)
            need = count - len(got)
            if need == 0:
                break
            victims = self.dram.pick_victims(need)
            if victims:
                await self._evict(victims)
            elif self._evicting or self._flushing:  # their leases end soon
                freed = self._freed
                await freed.wait()
            else:
                break
        return got

    def give_back(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.dram.give_back(slot)
        if slots:
            self._slot_freed()

    def commit(self, hashes: Sequence[BlockHash], slots: Sequence[int], pin: bool = False,
               owner: CacheOwner | None = None) -> int:  # fmt: skip
        """Make written slots visible under their hashes (``owner``'s); a block committed
        meanwhile by someone else keeps its slot and ours goes back. Returns how many are new."""
        stored: list[BlockHash] = []
        for h, slot in zip(hashes, slots):
            if h in self.dram:
                self.dram.give_back(slot)
                self._slot_freed()
            else:
                self.dram.insert(h, slot, pinned=pin, owner=owner)
                stored.append(h)
                if self.next_tier is not None and h not in self.next_tier:
                    self._unwritten[h] = None
            if pin:
                self.dram.pin(h)
        self.events.record(KVEventKind.STORED, KVTier.DRAM, stored)
        if self._unwritten:
            self._unwritten_added.set()
        self.counters["blocks_put"] += len(stored)
        return len(stored)

    def pin(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self.dram.pin(h)

    async def _evict(self, victims: list[BlockHash]) -> None:
        """Write the victims the next tier lacks down to it (in parallel), then drop every
        victim from DRAM in the order picked: the events follow the eviction order."""
        self._evicting += 1
        slots = [self.dram.slot_of(v) for v in victims]
        for slot in slots:
            self.dram.lease(slot)  # the write-back reads the slot
        stray: list[BlockHash] = []
        try:
            below = self.next_tier
            to_write = [below is not None and v not in below for v in victims]
            results = iter(await asyncio.gather(
                *(below.put(v, self.slot_view(s)) for v, s, w in zip(victims, slots, to_write) if w)
            ))  # fmt: skip
            for victim, slot, write in zip(victims, slots, to_write):
                written = next(results) if write else False
                if self.dram.slot_of(victim) != slot:  # removed during the write-back: so goes the copy
                    if written:
                        stray.append(victim)
                    continue
                self.dram.unmap(victim)
                self._unwritten.pop(victim, None)
                if written:
                    below.add(victim)
                    self.events.record(KVEventKind.DEMOTED, below.name, [victim], source_tier=KVTier.DRAM)
                    self.counters["demoted"] += 1
                else:
                    self.events.record(KVEventKind.EVICTED, KVTier.DRAM, [victim])
                    self.counters["evicted_dram"] += 1
        finally:
            self._evicting -= 1
            self.release(slots)
        for victim in stray:
            await below.discard(victim)

    # --- write-behind ---------------------------------------------------------------------
    async def write_behind(self, delay_s: float) -> None:
        """Run forever: flush ``delay_s`` after a commit left blocks the next tier lacks, so
        each reaches it within about ``delay_s`` (plus a flush already under way). A
        cancellation never interrupts a flush half-way; `flush` once more to finish."""
        while True:
            await self._unwritten_added.wait()
            self._unwritten_added.clear()
            await asyncio.sleep(delay_s)  # let the blocks of the next delay_s join this flush
            try:
                await asyncio.shield(self.flush())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("write-behind flush failed; trying again at the next commit")

    async def flush(self) -> int:
        """Write every block DRAM holds and the next tier lacks to it, now, in batches (one
        `put_many` each: for disk one thread job and one directory fsync); returns how
        many landed. A block whose write fails stays in DRAM only (logged) and is
        written back if evicted."""
        if self.next_tier is None:
            return 0
        landed = 0
        async with self._flush_lock:
            while self._unwritten:
                batch = list(itertools.islice(self._unwritten, self.flush_batch))
                for h in batch:
                    del self._unwritten[h]
                landed += await self._write_batch(batch)
        return landed

    async def _write_batch(self, batch: list[BlockHash]) -> int:
        below = self.next_tier
        blocks = [(h, slot) for h in batch if (slot := self.dram.slot_of(h)) is not None and h not in below]
        slots = [slot for _, slot in blocks]
        for slot in slots:
            self.dram.lease(slot)  # the write reads the slot: not evicted, not reused meanwhile
        self._flushing += 1
        self._in_flight += len(blocks)
        landed: list[BlockHash] = []
        stray: list[BlockHash] = []
        try:
            written = await below.put_many([(h, self.slot_view(slot)) for h, slot in blocks])
            for (h, slot), ok in zip(blocks, written):
                if not ok:
                    continue
                if self.dram.slot_of(h) != slot:  # removed during the write: so goes the copy
                    stray.append(h)
                    continue
                below.add(h)
                landed.append(h)
            self.events.record(KVEventKind.STORED, below.name, landed)
            self.counters["written_behind"] += len(landed)
        finally:
            self._flushing -= 1
            self._in_flight -= len(blocks)
            self.release(slots)
            self._slot_freed()  # a reserve() waiting for these leases to end may evict now
        for h in stray:
            await below.discard(h)
        return len(landed)

    def _lower_evicted(self, name: str, hashes: list[BlockHash]) -> None:
        if hashes:
            self.events.record(KVEventKind.EVICTED, name, hashes)
            self.counters[f"evicted_{name}"] += len(hashes)

    def _slot_freed(self) -> None:
        self._freed.set()
        self._freed = asyncio.Event()

    # --- removal ----------------------------------------------------------------------------
    async def remove(self, hashes: Sequence[BlockHash]) -> int:
        """Drop blocks from every tier (a block being read stays readable to its reader)."""
        from_dram: list[BlockHash] = []
        from_lower: list[list[BlockHash]] = [[] for _ in self.lower]
        for h in dict.fromkeys(hashes):
            if h in self.dram:
                if self.dram.unmap(h):
                    self._slot_freed()
                from_dram.append(h)
                self._unwritten.pop(h, None)
            if h in self._promoting:
                self._cancelled.add(h)
            for tier, gone in zip(self.lower, from_lower):
                if tier.forget(h):
                    gone.append(h)
        self.events.record(KVEventKind.REMOVED, KVTier.DRAM, from_dram)
        for tier, gone in zip(self.lower, from_lower):
            self.events.record(KVEventKind.REMOVED, tier.name, gone)
        for tier, gone in zip(self.lower, from_lower):
            if gone:
                await tier.delete(gone)
        removed = len(set(from_dram).union(*from_lower))
        self.counters["removed"] += removed
        return removed
