"""Ownership of the KV pool's blocks: reference counts, the prefix cache, eviction.

A block is in use while its ``ref_count`` > 0. A freed block that holds a full,
hashed block of KV stays findable by its hash (a prefix-cache hit revives it)
until it is reused for something else; free blocks are reused least recently
freed first, so the cache is LRU. The pool of tensors itself is `kv_pool.py`.
An optional ``listener`` hears each block that becomes findable ("stored") or
stops being findable ("evicted"), on the thread that changed it.
"""

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from libs.protocol.errors import OutOfKVBlocksError
from libs.protocol.hashing import BlockHash
from libs.protocol.vocabulary import KVEventKind


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = field(default=())  # kept to confirm a hash hit


BlockListener = Callable[[KVEventKind, BlockHash], None]  # (STORED or EVICTED, hash)


class BlockPool:
    def __init__(self, num_blocks: int, listener: BlockListener | None = None) -> None:
        self.listener = listener
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count == 0 blocks, least recently freed first; O(1) removal on a cache hit.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (evicting their cached contents) with ref_count 1."""
        if not self.can_allocate(n):
            raise OutOfKVBlocksError(n, len(self._free))
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._uncache(block)
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def lookup(self, hashes: Sequence[BlockHash], token_blocks: Sequence[Sequence[int]]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``, confirmed against the tokens."""
        hits = []
        for block_hash, tokens in zip(hashes, token_blocks):
            block_id = self._cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            hits.append(block_id)
        return hits

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block (reviving free cached blocks)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; the tail of a sequence is freed first
        so that, under pressure, its least shareable blocks are evicted first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} freed more times than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Make a full block findable by its hash; an existing entry for the hash wins."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block_id
        if self.listener is not None:
            self.listener(KVEventKind.STORED, block_hash)

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self.listener is not None:
                self.listener(KVEventKind.EVICTED, block.block_hash)
            block.block_hash = None
            block.token_ids = ()
