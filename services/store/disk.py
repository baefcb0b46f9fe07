"""The disk tier: one file per block under the store's directory (`block_files.py`
has the format), its own byte capacity and LRU, and an index rebuilt from the
directory at start.

A checksum that fails on read deletes the file and is reported as a miss (the
caller reports it as removed). A failed write is logged at once; the failures
that follow it (a full disk fails every block) are summed up in one line. Every
file operation runs on the tier's thread pool, never on the event loop; the index
itself is touched only on the event loop. The tier keeps no KV events: `tiers.py`
records them. A `LowerTier` (`tier.py`).
"""

import asyncio
import itertools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from libs.protocol.hashing import BlockHash
from libs.protocol.vocabulary import KVTier
from services.store.block_files import BlockFiles
from services.store.tier import TierStats

log = logging.getLogger(__name__)

FAILURE_SUMMARY_S = 10.0  # seconds of write failures summed up in one log line


class WriteFailures:
    """The disk tier's failed block writes, logged without a flood: the first of a run
    at once, then one line with the count, the bytes and the first error, once the run
    has lasted ``summary_after_s``, a write lands again, or the tier closes."""

    def __init__(self, summary_after_s: float = FAILURE_SUMMARY_S) -> None:
        self.summary_after_s = summary_after_s
        self.num_blocks = 0  # in the run not summed up yet, the first included
        self.num_bytes = 0
        self.first_error: str | None = None
        self._summary: asyncio.TimerHandle | None = None

    def failed(self, block_hash: BlockHash, nbytes: int, error: str) -> None:
        if self.num_blocks == 0:
            log.error("could not write block %s to disk: %s (further failures for %gs are summed up in one line)",
                      block_hash.hex(), error, self.summary_after_s)  # fmt: skip
            self.first_error = error
            self._summary = asyncio.get_running_loop().call_later(self.summary_after_s, self.summarize)
        self.num_blocks += 1
        self.num_bytes += nbytes

    def summarize(self) -> None:
        """Log the run so far, when more than its first failure (logged already) is in it."""
        if self._summary is not None:
            self._summary.cancel()
            self._summary = None
        if self.num_blocks > 1:
            log.error("could not write %d blocks (%d bytes) to disk; the first error: %s", self.num_blocks,
                      self.num_bytes, self.first_error)  # fmt: skip
        self.num_blocks = self.num_bytes = 0
        self.first_error = None


class DiskTier:
    """The disk index (LRU, least recent first) over `BlockFiles`, with a byte capacity
    that is never exceeded: room is made (and reserved) before a file is written."""

    name = KVTier.DISK

    def __init__(
        self,
        files: BlockFiles,
        capacity_bytes: int,
        on_evicted: Callable[[list[BlockHash]], None] = lambda hashes: None,
        threads: int = 4,
    ) -> None:
        """``on_evicted`` hears the blocks dropped for capacity, at the moment they
        leave the index (so a KV event log stays exact under concurrency)."""
        if capacity_bytes < files.file_nbytes:
            raise ValueError(f"disk capacity {capacity_bytes} bytes holds no block file of {files.file_nbytes} bytes")
        self.files = files
        self.capacity_bytes = capacity_bytes
        self.on_evicted = on_evicted
        self._index: OrderedDict[BlockHash, None] = OrderedDict()
        self._leases: Counter[BlockHash] = Counter()
        self._writing: set[BlockHash] = set()
        self._deleting: set[BlockHash] = set()
        self._reserved_bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="store-disk")
        self.write_failures = WriteFailures()

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.files.file_nbytes

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(list(self._index))

    def lru_order(self) -> list[BlockHash]:
        return list(self._index)

    def stats(self) -> TierStats:
        return TierStats(num_blocks=len(self._index), used_bytes=self.used_bytes, capacity_bytes=self.capacity_bytes)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def load(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """Rebuild the index from the directory: (blocks kept, blocks dropped for capacity)."""
        self.files.directory.mkdir(parents=True, exist_ok=True)
        found = [h for h, _ in await self._run(self.files.scan)]
        room = self.capacity_bytes // self.files.file_nbytes
        dropped, kept = found[: max(0, len(found) - room)], found[max(0, len(found) - room) :]
        for block_hash in dropped:
            await self._run(self.files.delete, block_hash)
        self._index = OrderedDict((h, None) for h in kept)
        return kept, dropped

    # --- reads ---------------------------------------------------------------------------
    def lease(self, block_hash: BlockHash) -> None:
        """Keep a block from eviction while it is being read (or about to be)."""
        self._leases[block_hash] += 1

    def release(self, block_hash: BlockHash) -> None:
        self._leases[block_hash] -= 1
        if self._leases[block_hash] == 0:
            del self._leases[block_hash]

    async def get_into(self, block_hash: BlockHash, into: memoryview) -> bool:
        """Read an indexed block into ``into`` under a lease; False when it turned out
        corrupt (then it is out of the index and its file is gone)."""
        self.lease(block_hash)
        try:
            problem = await self._run(self.files.read, block_hash, into)
        finally:
            self.release(block_hash)
        if problem is None:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
            return True
        self._index.pop(block_hash, None)
        return False

    # --- writes --------------------------------------------------------------------------
    async def put(self, block_hash: BlockHash, payload: memoryview) -> bool:
        """Write a block not on disk yet, evicting least recently used files for room.
        True: the file is in place and its bytes still reserved, but not yet in the
        index; the caller makes it visible with `add` (in the same step as the event
        that reports it) or drops it with `discard`."""
        if block_hash in self._index or block_hash in self._writing or block_hash in self._deleting:
            return False
        evicted = self._make_room()
        if evicted is None:
            return False
        self._writing.add(block_hash)
        self._reserved_bytes += self.files.file_nbytes
        await self.delete(evicted)
        try:
            await self._run(self.files.write, block_hash, payload)
        except OSError as e:
            self.write_failures.failed(block_hash, self.files.file_nbytes, str(e))
            self._written_not_added(block_hash)
            return False
        self.write_failures.summarize()  # a write landed: a run of failures, if any, is over
        return True

    async def put_many(self, blocks: list[tuple[BlockHash, memoryview]]) -> list[bool]:
        """`put` for a batch, as one job on one thread with one fsync of the directory
        (the write-behind's flush). For each block: True as `put` (the caller `add`s
        or `discard`s it), False when it was not written (on disk or being written or
        deleted already, no room, an I/O error)."""
        planned: list[int] = []  # indexes into blocks
        evicted: list[BlockHash] = []
        for i, (block_hash, _) in enumerate(blocks):
            if block_hash in self._index or block_hash in self._writing or block_hash in self._deleting:
                continue
            room = self._make_room()
            if room is None:
                break  # every file left is being read: the rest waits for the next flush or an eviction
            evicted += room
            self._writing.add(block_hash)
            self._reserved_bytes += self.files.file_nbytes
            planned.append(i)
        try:
            await self.delete(evicted)
            errors = await self._run(self.files.write_batch, [blocks[i] for i in planned]) if planned else []
        except OSError as e:  # the directory's fsync (or a delete) failed: count none of them as safe
            errors = [str(e)] * len(planned)
        written = [False] * len(blocks)
        for i, error in zip(planned, errors):
            if error is None:
                written[i] = True
            else:
                self.write_failures.failed(blocks[i][0], self.files.file_nbytes, error)
                self._written_not_added(blocks[i][0])
        if any(written):
            self.write_failures.summarize()
        return written

    def add(self, block_hash: BlockHash) -> None:
        """Make a block `put` wrote visible (most recently used)."""
        self._written_not_added(block_hash)
        self._index[block_hash] = None

    async def discard(self, block_hash: BlockHash) -> None:
        """Drop a block `put` wrote without ever making it visible."""
        self._written_not_added(block_hash)
        await self.delete([block_hash])

    def _written_not_added(self, block_hash: BlockHash) -> None:
        self._writing.discard(block_hash)
        self._reserved_bytes -= self.files.file_nbytes

    def _make_room(self) -> list[BlockHash] | None:
        """Take unleased files out of the index, least recent first, until one more file
        fits; None (and nothing taken) when that cannot be done."""
        need = self.used_bytes + self._reserved_bytes + self.files.file_nbytes - self.capacity_bytes
        if need <= 0:
            return []
        count = -(-need // self.files.file_nbytes)
        victims = list(itertools.islice((h for h in self._index if h not in self._leases), count))
        if len(victims) < count:
            return None
        for victim in victims:
            del self._index[victim]
        self.on_evicted(victims)
        return victims

    def forget(self, block_hash: BlockHash) -> bool:
        """Take a block out of the index now (its file goes with `delete`); False if absent."""
        if block_hash not in self._index:
            return False
        del self._index[block_hash]
        return True

    async def delete(self, block_hashes: list[BlockHash]) -> None:
        """Delete files already forgotten; no write of the same blocks starts meanwhile."""
        if not block_hashes:
            return
        self._deleting.update(block_hashes)
        try:
            await self._run(self.files.delete_many, block_hashes)
        finally:
            self._deleting.difference_update(block_hashes)

    def close(self) -> None:
        self.write_failures.summarize()
        self._pool.shutdown(wait=False, cancel_futures=True)
