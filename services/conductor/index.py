"""The global KV index: which instance holds which block, in which tier.

Fed by KV events (through `libs.common.kv_events.KVEventTracker`, or directly
by the simulator); answers one question fast: for a prompt's block hashes, how
long a prefix does every instance hold (in any of its tiers), and in which tier
is each block of it. Keys are any hashable block names: 16-byte hashes live,
trace hash ids in the simulator.

Each block maps to one int whose bit ``3·slot + tier`` says that the instance in
``slot`` holds it in ``tier`` (0 device, 1 dram, 2 disk), so a prefix match is one
dict lookup and a few integer operations per block, whatever the cluster size; it
keeps its holders as bit sets by prefix length, and names them only when asked.
"""

from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from libs.common.kv_events import TIERS
from libs.protocol.ids import InstanceId
from libs.protocol.schema import KVEvent
from libs.protocol.vocabulary import KVEventKind

_TIER_BIT = {tier: i for i, tier in enumerate(TIERS)}
_BITS = len(TIERS)


@dataclass
class PrefixMatch:
    """The result of `KVIndex.match` for one prompt (read it before the index changes again)."""

    num_blocks: int  # blocks in the prompt
    # (length, slot bits of the instances whose prefix of the prompt is exactly that long), shortest first
    groups: list[tuple[int, int]]
    _masks: list[int]
    _slots: dict[str, int]
    _ids: dict[int, str]
    _prefix: dict[str, int] | None = None

    @property
    def prefix(self) -> dict[str, int]:
        """instance id -> blocks of the prompt's prefix it holds (absent: 0); built on first use."""
        if self._prefix is None:
            self._prefix = {i: length for length, ids in self.by_length() for i in ids}
        return self._prefix

    def blocks(self, instance_id: InstanceId) -> int:
        slot = self._slots.get(instance_id)
        if slot is None:
            return 0
        bit = 1 << (_BITS * slot)
        for length, holders in self.groups:
            if holders & bit:
                return length
        return 0

    def by_length(self) -> Iterator[tuple[int, list[str]]]:
        """(length, the instances holding exactly that long a prefix), longest first: a
        caller after the longest prefixes reads only the few instances holding them."""
        ids = self._ids
        for length, holders in reversed(self.groups):
            out = []
            while holders:
                low = holders & -holders
                out.append(ids[(low.bit_length() - 1) // _BITS])
                holders ^= low
            yield length, out

    def tiers(self, instance_id: InstanceId, start: int, end: int) -> list[str]:
        """The fastest tier ``instance_id`` holds each block of [start, end) in."""
        shift = _BITS * self._slots[instance_id]
        out = []
        for mask in self._masks[start:end]:
            bits = (mask >> shift) & 0b111
            out.append(TIERS[(bits & -bits).bit_length() - 1])
        return out


class KVIndex:
    def __init__(self) -> None:
        self._where: dict[Hashable, int] = {}
        self._held: dict[tuple[str, str], set[Hashable]] = {}  # (instance, tier) -> blocks
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._slot_bits = 0  # bit 3·slot set for every slot in use
        self._ids: dict[int, str] = {}  # slot -> instance

    # --- what it holds ----------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Distinct blocks held anywhere."""
        return len(self._where)

    def instances(self) -> list[str]:
        return sorted(self._slots)

    def contents(self, instance_id: InstanceId) -> dict[str, set[Hashable]]:
        """Blocks ``instance_id`` holds, by tier (tiers it holds nothing in are left out)."""
        return {t: set(held) for (i, t), held in self._held.items() if i == instance_id and held}

    # --- changes ------------------------------------------------------------------
    def apply_event(self, instance_id: InstanceId, event: KVEvent) -> None:
        self.apply(instance_id, event.kind, event.tier, event.block_hashes, event.source_tier)

    def apply(
        self, instance_id: InstanceId, kind: KVEventKind, tier: str, blocks: Iterable[Hashable], source_tier: str | None = None
    ) -> None:
        if kind in (KVEventKind.STORED, KVEventKind.PROMOTED):  # a promotion is a copy up: the source keeps it
            self.add(instance_id, tier, blocks)
        elif kind == KVEventKind.DEMOTED:
            blocks = list(blocks)
            self.add(instance_id, tier, blocks)
            if source_tier is not None:
                self.discard(instance_id, source_tier, blocks)
        elif kind in (KVEventKind.EVICTED, KVEventKind.REMOVED):
            self.discard(instance_id, tier, blocks)
        else:
            raise ValueError(f"unknown KV event kind {kind!r}")

    def add(self, instance_id: InstanceId, tier: str, blocks: Iterable[Hashable]) -> None:
        bit = 1 << (_BITS * self._slot(instance_id) + _TIER_BIT[tier])
        held = self._held.setdefault((instance_id, tier), set())
        where = self._where
        for block in blocks:
            where[block] = where.get(block, 0) | bit
            held.add(block)

    def discard(self, instance_id: InstanceId, tier: str, blocks: Iterable[Hashable]) -> None:
        held = self._held.get((instance_id, tier))
        if not held:
            return
        keep = ~(1 << (_BITS * self._slots[instance_id] + _TIER_BIT[tier]))
        where = self._where
        for block in blocks:
            if block in held:
                held.discard(block)
                mask = where[block] & keep
                if mask:
                    where[block] = mask
                else:
                    del where[block]

    def replace(self, instance_id: InstanceId, tiers: dict[str, Iterable[Hashable]]) -> None:
        """Make ``instance_id``'s contents exactly ``tiers`` (a snapshot); {} forgets it."""
        for tier in TIERS:
            held = self._held.get((instance_id, tier))
            if held:
                self.discard(instance_id, tier, list(held))
        for tier, blocks in tiers.items():
            self.add(instance_id, tier, blocks)
        if not tiers:
            self._release(instance_id)

    # --- the question ---------------------------------------------------------------
    def match(self, blocks: Sequence[Hashable]) -> PrefixMatch:
        """How long a prefix of ``blocks`` every instance holds, in any tier."""
        where, active = self._where, self._slot_bits
        groups: list[tuple[int, int]] = []
        masks: list[int] = []
        for i, block in enumerate(blocks):
            if not active:
                break
            mask = where.get(block, 0)
            masks.append(mask)
            holders = active & (mask | mask >> 1 | mask >> 2)
            if holders != active:
                if i:
                    groups.append((i, active & ~holders))
                active = holders
        else:
            if active and blocks:
                groups.append((len(blocks), active))
        return PrefixMatch(len(blocks), groups, masks, self._slots, self._ids)

    # --- slots ------------------------------------------------------------------------
    def _slot(self, instance_id: InstanceId) -> int:
        slot = self._slots.get(instance_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slots)
            self._slots[instance_id] = slot
            self._ids[slot] = instance_id
            self._slot_bits |= 1 << (_BITS * slot)
        return slot

    def _release(self, instance_id: InstanceId) -> None:
        slot = self._slots.pop(instance_id, None)
        if slot is not None:
            self._slot_bits &= ~(1 << (_BITS * slot))
            del self._ids[slot]
            self._free_slots.append(slot)
