"""What a tier of the store is: a place that holds blocks by hash, in an LRU order,
with a capacity it reports. `tiers.py` composes an ordered list of them, fastest
first, and records every KV event; a tier records none.

The first tier is DRAM (`dram.py`): slots of the shared-memory segment the
transfer engine serves from, pure bookkeeping. Every tier after it is a
`LowerTier` (the disk tier, `disk.py`): keyed by hash, its bytes reached
asynchronously, off the event loop. A block is served by being read up into a
DRAM slot (a copy up), and a block DRAM evicts is written down to the next
tier unless that tier holds it. To add a tier, write one class that meets
`LowerTier` and put it in the list where the service composes its tiers
(`StoreService.__init__` in `app.py`).
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from libs.protocol.hashing import BlockHash


@dataclass(frozen=True)
class TierStats:
    num_blocks: int
    used_bytes: int
    capacity_bytes: int


class Tier(Protocol):
    name: str  # the tier's name in KV events, counters and replies ("dram", "disk")

    def __contains__(self, block_hash: BlockHash) -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[BlockHash]: ...

    def lru_order(self) -> list[BlockHash]:
        """The blocks held, least recently used first."""
        ...

    def stats(self) -> TierStats: ...


class LowerTier(Tier, Protocol):
    """A tier below DRAM. Its bookkeeping runs on the event loop; its bytes move in
    coroutines. A block it writes becomes visible only at `add`, so the caller can
    record the event in the same synchronous step."""

    on_evicted: Callable[[list[BlockHash]], None]  # blocks dropped for capacity, as they leave

    async def load(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """Rebuild what it holds at start: (blocks kept, blocks dropped for capacity)."""
        ...

    def lease(self, block_hash: BlockHash) -> None:
        """Keep a block from eviction while it is read (or about to be)."""
        ...

    def release(self, block_hash: BlockHash) -> None: ...

    async def get_into(self, block_hash: BlockHash, into: memoryview) -> bool:
        """Copy a held block into ``into``; False when it turned out unreadable (then
        it is no longer held, and the caller reports it removed)."""
        ...

    async def put(self, block_hash: BlockHash, payload: memoryview) -> bool:
        """Write a block it lacks, making room by eviction; True: written, invisible
        until `add` (or dropped with `discard`)."""
        ...

    async def put_many(self, blocks: list[tuple[BlockHash, memoryview]]) -> list[bool]:
        """`put` for a batch (the write-behind's flush)."""
        ...

    def add(self, block_hash: BlockHash) -> None: ...

    async def discard(self, block_hash: BlockHash) -> None: ...

    def forget(self, block_hash: BlockHash) -> bool:
        """Stop holding a block now (its bytes go with `delete`); False if not held."""
        ...

    async def delete(self, block_hashes: list[BlockHash]) -> None: ...

    def close(self) -> None: ...
