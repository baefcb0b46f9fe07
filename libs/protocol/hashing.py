"""Chained, deterministic block hashes: the names KV blocks go by everywhere.

``hash(block i) = blake2b(hash(block i-1) || token ids of block i || extra)``
with ``hash(block -1) = ROOT``. Token ids are packed as little-endian uint32 and
``extra`` carries the model id (and, later, adapters or salts), so equal prefixes
give equal chains in every process and on every machine, and different models
never share a name. Only full blocks are hashed: a partial block has no hash.
A cache scope (a tenant's, a shared one, a request's cache_salt) starts its chains
from its own root (`scope_root`), so equal prompts in two scopes share no name.
"""

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

HASH_SCHEME = "blake2b-128/chain-v1"
_DIGEST_SIZE = 16
ROOT = BlockHash(hashlib.blake2b(b"kvserve/" + HASH_SCHEME.encode(), digest_size=_DIGEST_SIZE).digest())


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return BlockHash(h.digest())


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes = b"",
    parent: BlockHash = ROOT,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``; a trailing partial block is left out."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


def model_extra(model_id: str) -> bytes:
    """The ``extra`` bytes every block of ``model_id`` is hashed with."""
    return model_id.encode()


def scope_root(scope: bytes, parent: BlockHash = ROOT) -> BlockHash:
    """The root the chains of cache scope ``scope`` start from instead of ``parent``:
    no block of one scope can name a block of another. Scopes nest (a tenant's, then
    a request's cache_salt within it); the default scope's root is ROOT itself."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    h.update(b"scope")
    h.update(struct.pack("<I", len(scope)))
    h.update(scope)
    return BlockHash(h.digest())
