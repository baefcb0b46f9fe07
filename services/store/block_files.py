"""The disk tier's file format and its blocking file operations, run on the
tier's threads (`disk.py`), never on the event loop.

A block file is ``<hash hex>.kvb``: a 64-byte header (magic, format version, a
digest of the KV contract, a digest of the block hash, the payload length, and
the xxh3-64 checksum of the payload) followed by the payload, one KV block.
xxh3 hashes at memory speed (tens of GB/s), so verifying it on every read costs
far less than the read itself. Writes are atomic: a temp file in the same
directory, fsync, rename, fsync of the directory (one for a whole batch of
renames); a crash leaves the old state or the new one, never half a block
under a block's name (`atomic_write.py`).

A scan deletes (and logs) temp files and block files of the wrong size or
header, and leaves block files of another KV contract untouched (the
directory's manifest keeps other stores out, `manifest.py`). A read whose
checksum fails deletes the file.
"""

import hashlib
import logging
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import msgspec
import xxhash

from libs.common import failpoints
from libs.protocol.hashing import BlockHash
from libs.protocol.schema import KVContract
from services.store.atomic_write import TEMP_SUFFIX, sync_directory, write_temp

log = logging.getLogger(__name__)

MAGIC = b"KVSB"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHH16s16sQQ8x")  # magic, version, flags, contract digest, key digest, length, xxh3
SUFFIX = ".kvb"
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
        os.rename(self._write_temp(block_hash, payload), self.path(block_hash))
        self.sync_directory()

    def write_batch(self, blocks: list[tuple[bytes, memoryview]]) -> list[str | None]:
        """Atomically (re)place each block's file, with one fsync of the directory for
        all the renames: for each block None when it is in place, else why not."""
        errors: list[str | None] = []
        for block_hash, payload in blocks:
            try:
                os.rename(self._write_temp(block_hash, payload), self.path(block_hash))
                errors.append(None)
            except OSError as e:
                errors.append(str(e))
        if any(e is None for e in errors):
            self.sync_directory()
        return errors

    def _write_temp(self, block_hash: bytes, payload: memoryview) -> Path:
        """The block's file under a temp name, its bytes fsynced; the caller renames it."""
        header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, self.contract, key_digest(block_hash), len(payload),
                             xxhash.xxh3_64_intdigest(payload))  # fmt: skip
        if failpoints.active("store.stall_disk_write"):
            temp = write_temp(self.directory, block_hash.hex(), [header, payload[: len(payload) // 2]])
            log.warning("failpoint store.stall_disk_write: holding %s half-written", temp.name)
            threading.Event().wait()  # until the process is killed
        return write_temp(self.directory, block_hash.hex(), [header, payload])

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

    def delete_many(self, block_hashes: list[bytes]) -> None:
        for block_hash in block_hashes:
            self.delete(block_hash)

    def sync_directory(self) -> None:
        sync_directory(self.directory)

    def scan(self) -> list[tuple[BlockHash, float]]:
        """The intact-looking block files, oldest first (by modification time); deletes
        and logs temp files and block files of the wrong size or header. Block files of
        another KV contract are not this store's to judge: they are left as they are."""
        found: list[tuple[float, BlockHash]] = []
        foreign = 0
        for entry in os.scandir(self.directory):
            if entry.name.endswith(TEMP_SUFFIX):
                log.warning("deleted %s: a write that never finished", entry.name)
                os.unlink(entry.path)
                continue
            match = _NAME.match(entry.name)
            if match is None:
                continue  # not ours
            block_hash = BlockHash(bytes.fromhex(match.group(1)))
            with open(entry.path, "rb") as f:
                header = f.read(HEADER.size)
            if _is_foreign(header, self.contract):
                foreign += 1
                continue
            stat = entry.stat()
            problem = self._check_header(header, block_hash)
            if problem is None and stat.st_size != self.file_nbytes:
                problem = f"{stat.st_size} bytes, expected {self.file_nbytes}"
            if problem is not None:
                log.warning("deleted %s: %s", entry.name, problem)
                os.unlink(entry.path)
                continue
            found.append((stat.st_mtime, block_hash))
        if foreign:
            log.warning("left %d block files of another KV contract in %s untouched (not counted, never served)",
                        foreign, self.directory)  # fmt: skip
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


def _is_foreign(header: bytes, contract: bytes) -> bool:
    """A whole kvserve block header naming another contract than ``contract``."""
    if len(header) != HEADER.size:
        return False
    magic, _, _, theirs, *_ = HEADER.unpack(header)
    return magic == MAGIC and theirs != contract
