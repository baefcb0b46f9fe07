"""A content-addressed DRAM block store: fixed-size slots in one shared-memory
segment, keyed by block hash, with a byte capacity and LRU eviction.

Pure bookkeeping plus memory copies through the transfer engine; it is not
thread-safe, and the service calls it from a single thread.
"""

from collections import OrderedDict
from collections.abc import Sequence

from libs.common.model.hashing import BlockHash
from libs.common.transfer import Descriptor, SharedSegment, TransferEngine


class DramBlockStore:
    def __init__(self, segment: SharedSegment, block_nbytes: int, transfers: TransferEngine) -> None:
        self.segment = segment
        self.block_nbytes = block_nbytes
        self.num_slots = segment.nbytes // block_nbytes
        if self.num_slots < 1:
            raise ValueError(f"capacity {segment.nbytes} bytes holds no block of {block_nbytes} bytes")
        self.transfers = transfers
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.evictions: list[BlockHash] = []  # most recent last; tests read the order

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def exists(self, hashes: Sequence[BlockHash]) -> list[bool]:
        return [h in self._index for h in hashes]

    def put(self, hashes: Sequence[BlockHash], src_segment: str, offsets: Sequence[int]) -> int:
        """Copy in each block not yet stored (evicting the least recently used); return how many were new."""
        batch, stored = [], 0
        for block_hash, offset in zip(hashes, offsets):
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                continue
            slot = self._take_slot()
            batch.append(Descriptor(src_segment, offset, self.segment.name, slot * self.block_nbytes, self.block_nbytes))
            self._index[block_hash] = slot
            stored += 1
        self.transfers.copy(batch)
        return stored

    def get(self, hashes: Sequence[BlockHash], dst_segment: str, offsets: Sequence[int]) -> int:
        """Copy out the longest stored prefix of ``hashes``; return its length in blocks."""
        batch = []
        for block_hash, offset in zip(hashes, offsets):
            slot = self._index.get(block_hash)
            if slot is None:
                break
            self._index.move_to_end(block_hash)
            batch.append(Descriptor(self.segment.name, slot * self.block_nbytes, dst_segment, offset, self.block_nbytes))
        self.transfers.copy(batch)
        return len(batch)

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        victim, slot = self._index.popitem(last=False)
        self.evictions.append(victim)
        return slot
