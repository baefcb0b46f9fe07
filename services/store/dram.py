"""The DRAM tier's bookkeeping: which block hash lives in which slot of the store's
shared-memory segment, in what LRU order, pinned or not, and who is reading it.

A slot is free, reserved (handed to a put or a promotion, not yet visible),
or mapped to one block hash. Eviction order is exact: the least recently used
unpinned block whose slot no one is reading; a pinned block only when no
unpinned one can go. A slot under a lease (a copy out to a caller, a write-
back to disk) is never chosen, and a block unmapped while leased keeps its
slot until the last lease ends. A block may belong to an owner (a tenant's
cache scope) with a share of the slots: while an owner holds more than its
share, its least recently used unpinned blocks go first. Pure bookkeeping, no bytes and no I/O: the
caller (`tiers.py`) moves the data; it runs on one thread (the event loop).
The first `Tier` (`tier.py`) of every store.
"""

from collections import Counter, OrderedDict
from collections.abc import Iterator

from libs.protocol.hashing import BlockHash
from libs.protocol.schema.contracts import CacheOwner
from libs.protocol.vocabulary import KVTier
from services.store.tier import TierStats


class DramTier:
    name = KVTier.DRAM

    def __init__(self, num_slots: int, block_nbytes: int) -> None:
        if num_slots < 1:
            raise ValueError("the DRAM tier needs at least one slot")
        self.num_slots = num_slots
        self.block_nbytes = block_nbytes
        self._slot_of: dict[BlockHash, int] = {}
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()  # unpinned, least recent first
        self._pinned: OrderedDict[BlockHash, None] = OrderedDict()  # pinned, least recent first
        self._leaving: set[BlockHash] = set()  # chosen for eviction, still readable until unmapped
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._leases: Counter[int] = Counter()
        self._orphans: set[int] = set()  # unmapped while leased: freed when the last lease ends
        self._owner_of: dict[BlockHash, str] = {}
        self._owned: Counter[str] = Counter()  # each owner's blocks, those leaving not counted
        self._shares: dict[str, float] = {}  # of the slots, the most an owner keeps when room is needed

    # --- what it holds -------------------------------------------------------------
    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(list(self._slot_of))

    def slot_of(self, block_hash: BlockHash) -> int | None:
        return self._slot_of.get(block_hash)

    def is_pinned(self, block_hash: BlockHash) -> bool:
        return block_hash in self._pinned

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    @property
    def num_leased(self) -> int:
        """Slots with at least one lease."""
        return len(self._leases)

    def owners(self) -> dict[str, int]:
        """Blocks held per owner (those with one)."""
        return {owner: n for owner, n in self._owned.items() if n > 0}

    def lru_order(self) -> list[BlockHash]:
        """The eviction order as it stands: unpinned least recent first, then pinned."""
        return [*self._lru, *self._pinned]

    def stats(self) -> TierStats:
        return TierStats(num_blocks=len(self._slot_of), used_bytes=len(self._slot_of) * self.block_nbytes,
                         capacity_bytes=self.num_slots * self.block_nbytes)  # fmt: skip

    # --- use -------------------------------------------------------------------------
    def touch(self, block_hash: BlockHash) -> None:
        """A use: the block becomes the most recently used of its kind."""
        for order in (self._lru, self._pinned):
            if block_hash in order:
                order.move_to_end(block_hash)

    def pin(self, block_hash: BlockHash) -> None:
        if block_hash in self._lru:
            del self._lru[block_hash]
            self._pinned[block_hash] = None

    def lease(self, slot: int) -> None:
        self._leases[slot] += 1

    def release(self, slot: int) -> bool:
        """End one lease; True when that freed the slot (it had been unmapped meanwhile)."""
        self._leases[slot] -= 1
        if self._leases[slot] > 0:
            return False
        del self._leases[slot]
        if slot in self._orphans:
            self._orphans.discard(slot)
            self._free.append(slot)
            return True
        return False

    # --- slots -----------------------------------------------------------------------
    def take_free_slot(self) -> int | None:
        """A free slot, now reserved for the caller (invisible until `insert`)."""
        return self._free.pop() if self._free else None

    def give_back(self, slot: int) -> None:
        """A reserved slot that will not be used (a put that never committed)."""
        self._free.append(slot)

    def insert(self, block_hash: BlockHash, slot: int, pinned: bool = False, owner: CacheOwner | None = None) -> None:
        """Map a reserved slot, whose bytes are in place, to ``block_hash`` (most recently used),
        ``owner``'s when given, whose share of the slots becomes the one it names."""
        assert block_hash not in self._slot_of, "insert of a block already held"
        self._slot_of[block_hash] = slot
        (self._pinned if pinned else self._lru)[block_hash] = None
        if owner is not None:
            self._owner_of[block_hash] = owner.name
            self._owned[owner.name] += 1
            if owner.share is None:
                self._shares.pop(owner.name, None)
            else:
                self._shares[owner.name] = owner.share

    def pick_victims(self, count: int) -> list[BlockHash]:
        """Up to ``count`` blocks to evict, in eviction order, marked as leaving (so no
        one picks them again); each stays readable until `unmap`."""
        victims: list[BlockHash] = []
        over = {owner: excess for owner, share in self._shares.items()
                if (excess := self._owned[owner] - int(share * self.num_slots)) > 0}  # fmt: skip
        if over:  # the unpinned blocks of owners past their shares first, least recent first
            for block_hash in self._lru:
                if len(victims) == count:
                    break
                owner = self._owner_of.get(block_hash)
                if owner in over and over[owner] > 0 and self._slot_of[block_hash] not in self._leases:
                    victims.append(block_hash)
                    over[owner] -= 1
        chosen = set(victims)
        for order in (self._lru, self._pinned):
            for block_hash in order:
                if len(victims) == count:
                    break
                if block_hash not in chosen and self._slot_of[block_hash] not in self._leases:
                    victims.append(block_hash)
        for block_hash in victims:
            self._lru.pop(block_hash, None)
            self._pinned.pop(block_hash, None)
            self._leaving.add(block_hash)
            if (owner := self._owner_of.get(block_hash)) is not None:
                self._owned[owner] -= 1
        return victims

    def unmap(self, block_hash: BlockHash) -> bool:
        """Forget ``block_hash`` (evicted or removed); its slot is free now, or when its
        last lease ends. Returns True when the slot was freed now."""
        slot = self._slot_of.pop(block_hash)
        self._lru.pop(block_hash, None)
        self._pinned.pop(block_hash, None)
        if (owner := self._owner_of.pop(block_hash, None)) is not None and block_hash not in self._leaving:
            self._owned[owner] -= 1
        self._leaving.discard(block_hash)
        if slot in self._leases:
            self._orphans.add(slot)
            return False
        self._free.append(slot)
        return True

    def check(self) -> None:
        """Assert the invariants (tests): every slot is exactly one of free, mapped,
        orphaned or reserved, and no slot is counted twice."""
        mapped = list(self._slot_of.values())
        free = self._free
        assert len(set(mapped)) == len(mapped), "a slot mapped twice"
        assert not set(mapped) & set(free) and not set(mapped) & self._orphans and not set(free) & self._orphans
        assert len(mapped) + len(free) + len(self._orphans) <= self.num_slots
        assert set(self._lru) | set(self._pinned) | self._leaving == set(self._slot_of)
        counted = Counter(owner for h, owner in self._owner_of.items() if h not in self._leaving)
        assert +counted == +self._owned, "an owner's blocks miscounted"
