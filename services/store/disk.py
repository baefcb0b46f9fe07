"""The disk tier: one file per block under the store's directory, its own byte
capacity and LRU, and an index rebuilt from the directory at start.

A block file is ``<hash hex>.kvb``: a 64-byte header (magic, format version, a
digest of the KV contract, a digest of the block hash, the payload length, and
the xxh3-64 checksum of the payload) followed by the payload, one KV block.
xxh3 hashes at memory speed (tens of GB/s), so verifying it on every read costs
far less than the read itself. Writes are atomic: a temp file in the same
directory, fsync, rename, fsync of the directory; a crash leaves the old state
or the new one, never half a block under a block's name.

At start, temp files and block files of the wrong size or header are deleted
and logged. A checksum that fails on read deletes the file and is reported as
a miss (the caller reports it as removed). Every file operation runs on the
tier's thread pool, never on the event loop; the index itself is touched only
on the event loop. The tier keeps no KV events: `tiers.py` records them.
"""

import asyncio
import hashlib
import itertools
import logging
import os
import re
import secrets
import struct
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec
import xxhash

from libs.common import failpoints
from libs.common.model.hashing import BlockHash
from libs.common.schema import KVContract

log = logging.getLogger(__name__)

MAGIC = b"KVSB"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHH16s16sQQ8x")  # magic, version, flags, contract digest, key digest, length, xxh3
SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
_NAME = re.compile(r"^([0-9a-f]{2,128})\.kvb$")


def contract_digest(contract: KVContract) -> bytes:
    return hashlib.blake2b(msgspec.msgpack.encode(contract), digest_size=16).digest()


def key_digest(block_hash: bytes) -> bytes:
    return hashlib.blake2b(block_hash, digest_size=16).digest()


@dataclass(frozen=True)
class BlockFiles:
    """The file format and the blocking file operations (run on the pool's threads)."""

    directory: Path
    contract: bytes  # contract_digest of the store's KV contract
    block_nbytes: int

    @property
    def file_nbytes(self) -> int:
        return HEADER.size + self.block_nbytes

    def path(self, block_hash: bytes) -> Path:
        return self.directory / f"{block_hash.hex()}{SUFFIX}"

    def write(self, block_hash: bytes, payload: memoryview) -> None:
        """Atomically (re)place the block's file; raises OSError on failure."""
        header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, self.contract, key_digest(block_hash), len(payload),
                             xxhash.xxh3_64_intdigest(payload))  # fmt: skip
        temp = self.directory / f".{block_hash.hex()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if failpoints.active("store.stall_disk_write"):
                os.write(fd, header)
                os.write(fd, payload[: len(payload) // 2])
                os.fsync(fd)
                log.warning("failpoint store.stall_disk_write: holding %s half-written", temp.name)
                threading.Event().wait()  # until the process is killed
            _write_all(fd, [header, payload])
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.rename(temp, self.path(block_hash))
        self.sync_directory()

    def read(self, block_hash: bytes, into: memoryview) -> str | None:
        """Read the block's payload into ``into``; None when it is intact, else why not
        (the file is then deleted)."""
        path = self.path(block_hash)
        try:
            with open(path, "rb", buffering=0) as f:
                header = f.read(HEADER.size)
                problem = self._check_header(header, block_hash)
                if problem is None:
                    got = f.readinto(into)
                    if got != len(into):
                        problem = f"payload is {got} bytes, not {len(into)}"
                    elif xxhash.xxh3_64_intdigest(into) != HEADER.unpack(header)[6]:
                        problem = "checksum mismatch"
        except FileNotFoundError:
            return "file missing"
        except OSError as e:
            problem = f"unreadable ({e})"
        if problem is not None:
            log.error("block file %s is corrupt (%s): deleted", path.name, problem)
            path.unlink(missing_ok=True)
        return problem

    def delete(self, block_hash: bytes) -> None:
        self.path(block_hash).unlink(missing_ok=True)

    def sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def scan(self) -> list[tuple[BlockHash, float]]:
        """The intact-looking block files, oldest first (by modification time); deletes
        and logs temp files and block files of the wrong size or header."""
        found: list[tuple[float, BlockHash]] = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(TEMP_SUFFIX):
                log.warning("deleted %s: a write that never finished", entry.name)
                os.unlink(entry.path)
                continue
            match = _NAME.match(entry.name)
            if match is None:
                continue  # not ours
            block_hash = BlockHash(bytes.fromhex(match.group(1)))
            stat = entry.stat()
            problem = None
            if stat.st_size != self.file_nbytes:
                problem = f"{stat.st_size} bytes, expected {self.file_nbytes}"
            else:
                with open(entry.path, "rb") as f:
                    problem = self._check_header(f.read(HEADER.size), block_hash)
            if problem is not None:
                log.warning("deleted %s: %s", entry.name, problem)
                os.unlink(entry.path)
                continue
            found.append((stat.st_mtime, block_hash))
        found.sort()
        return [(h, mtime) for mtime, h in found]

    def _check_header(self, header: bytes, block_hash: bytes) -> str | None:
        if len(header) != HEADER.size:
            return "truncated header"
        magic, version, _, contract, key, length, _ = HEADER.unpack(header)
        if magic != MAGIC:
            return "not a kvserve block file"
        if version != FORMAT_VERSION:
            return f"format version {version}, expected {FORMAT_VERSION}"
        if contract != self.contract:
            return "written under another KV contract"
        if key != key_digest(block_hash):
            return "holds another block than its name says"
        if length != self.block_nbytes:
            return f"payload of {length} bytes, expected {self.block_nbytes}"
        return None


def _write_all(fd: int, buffers: list) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


class DiskTier:
    """The disk index (LRU, least recent first) over `BlockFiles`, with a byte capacity
    that is never exceeded: room is made (and reserved) before a file is written."""

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

    async def read(self, block_hash: BlockHash, into: memoryview) -> bool:
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
    async def write(self, block_hash: BlockHash, payload: memoryview) -> bool:
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
            return True
        except OSError as e:
            log.error("could not write block %s to disk: %s", block_hash.hex(), e)
            self._written_not_added(block_hash)
            return False

    def add(self, block_hash: BlockHash) -> None:
        """Make a block `write` put on disk visible (most recently used)."""
        self._written_not_added(block_hash)
        self._index[block_hash] = None

    async def discard(self, block_hash: BlockHash) -> None:
        """Drop a block `write` put on disk without ever making it visible."""
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
        self._deleting.update(block_hashes)
        try:
            for block_hash in block_hashes:
                await self._run(self.files.delete, block_hash)
        finally:
            self._deleting.difference_update(block_hashes)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
