"""Gives sequences KV blocks: reuses cached prefix blocks by hash, allocates the
rest, names full blocks once computed, and frees them when a sequence ends.

Ties `block_pool.py` (who owns which block) to `hashing.py` (what a block is
called); it touches no tensors.
"""

from dataclasses import replace

from libs.engine.model.block_pool import BlockListener, BlockPool
from libs.engine.model.sequence import Sequence
from libs.protocol.hashing import block_hashes, hash_block


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, hash_extra: bytes, enable_prefix_cache: bool = True) -> None:
        self.block_pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.hash_extra = hash_extra
        self.enable_prefix_cache = enable_prefix_cache

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def set_listener(self, listener: BlockListener | None) -> None:
        """Hear each block that becomes findable by its hash or stops being so (on the thread that changed it)."""
        self.block_pool.listener = listener

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def prompt_hashes(self, seq: Sequence) -> list:
        return block_hashes(seq.prompt_token_ids, self.block_size, self.hash_extra, seq.hash_root)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach the longest cached prefix of a new sequence's prompt; return its token count.

        At least one prompt token is always left to compute, since prefill must
        produce the logits of the last one.
        """
        assert not seq.block_table, "match_prefix is for sequences without blocks"
        if not self.enable_prefix_cache:
            return 0
        hashes = self.prompt_hashes(seq)
        usable = (seq.num_prompt_tokens - 1) // self.block_size
        bs = self.block_size
        tokens = [seq.token_ids[i * bs : (i + 1) * bs] for i in range(usable)]
        hits = self.block_pool.lookup(hashes[:usable], tokens)
        self.block_pool.touch(hits)
        seq.block_table = list(hits)
        seq.block_hashes = hashes[: len(hits)]
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * bs
        return seq.num_cached_tokens

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.block_pool.can_allocate(max(0, self.blocks_needed(num_tokens) - len(seq.block_table)))

    def allocate(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Grow the block table to hold ``num_tokens`` tokens; return the new block ids."""
        need = self.blocks_needed(num_tokens) - len(seq.block_table)
        if need <= 0:
            return []
        new = self.block_pool.allocate(need)
        seq.block_table.extend(new)
        return new

    def can_allocate_blocks(self, n: int) -> bool:
        return self.block_pool.can_allocate(n)

    def allocate_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks for no sequence yet (e.g. a lease for KV on its way):
        ``attach`` them to one later, or give them back with ``free_blocks``."""
        return self.block_pool.allocate(n)

    def free_blocks(self, block_ids: list[int]) -> None:
        self.block_pool.free(block_ids)

    def attach(self, seq: Sequence, block_ids: list[int]) -> None:
        """Append blocks the caller already holds a reference on (e.g. filled by a transfer)."""
        seq.block_table.extend(block_ids)

    def fork(self, seq: Sequence, choice: int) -> tuple[Sequence, tuple[int, int] | None]:
        """Another sequence of ``seq``'s request (its ``choice``), sharing its computed KV:
        one more reference on each full block, and a fresh block for a partly filled
        last one, since each sequence writes its own next tokens there (copy on write,
        done at once). Returns the new sequence and the (source, copy) block ids whose
        KV the caller copies, or None. Right after a prefill only, when ``seq``'s blocks
        hold its computed tokens and nothing more."""
        if self.blocks_needed(seq.num_computed_tokens) != len(seq.block_table):
            raise ValueError(f"{seq.request_id}: only a sequence whose blocks hold exactly its computed KV forks")
        num_full = seq.num_computed_tokens // self.block_size
        shared = seq.block_table[:num_full]
        fresh = self.block_pool.allocate(len(seq.block_table) - num_full)  # first: it may raise
        self.block_pool.touch(shared)
        copy = (seq.block_table[num_full], fresh[0]) if fresh else None
        sibling = replace(seq, token_ids=list(seq.token_ids), block_table=shared + fresh,
                          block_hashes=list(seq.block_hashes), choice=choice, grammar=None)  # fmt: skip
        return sibling, copy

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash and publish every block of ``seq`` that is full and computed but not yet named."""
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        for i in range(len(seq.block_hashes), num_full):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            parent = seq.block_hashes[i - 1] if i else seq.hash_root
            block_hash = hash_block(parent, tokens, self.hash_extra)
            seq.block_hashes.append(block_hash)
            if self.enable_prefix_cache:
                self.block_pool.cache(seq.block_table[i], block_hash, tokens)

    def free(self, seq: Sequence) -> None:
        self.block_pool.free(seq.block_table)
        seq.block_table = []
