"""The store directory's manifest: the KV contract its block files were written
under, fixed when the directory is first used.

A store claims a directory by writing ``manifest.json`` (atomically) at its
first start; from then on only a store of the same contract may use it. A store
of another contract (another model, dtype, block size, layout or hash scheme)
is refused before it touches a file, so a restart with other settings can never
wipe a disk tier. The manifest is JSON, readable by hand.
"""

from pathlib import Path

import msgspec

from libs.protocol.errors import KVServeError
from libs.protocol.schema import KVContract
from services.store.atomic_write import write_atomically

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


class StoreManifest(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    contract: KVContract
    contract_digest: str  # hex of block_files.contract_digest(contract): what every block file's header carries
    block_nbytes: int


class StoreDirectoryError(KVServeError):
    """The store directory belongs to another KV contract, or its manifest cannot be read or written."""


def claim_directory(directory: Path, contract: KVContract, contract_digest: bytes, block_nbytes: int) -> bool:
    """Make sure ``directory`` is this contract's: True when it was claimed now (a
    new directory), False when its manifest already names this contract. Raises
    StoreDirectoryError, with the difference named, for any other manifest. Blocking."""
    path = directory / MANIFEST_NAME
    ours = StoreManifest(version=MANIFEST_VERSION, contract=contract, contract_digest=contract_digest.hex(),
                         block_nbytes=block_nbytes)  # fmt: skip
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            write_atomically(path, msgspec.json.format(msgspec.json.encode(ours), indent=2) + b"\n")
        except OSError as e:
            raise StoreDirectoryError(f"store directory {directory}: cannot write {MANIFEST_NAME}: {e}") from None
        return True
    except OSError as e:
        raise StoreDirectoryError(f"store directory {directory}: cannot read {MANIFEST_NAME}: {e}") from None
    try:
        theirs = msgspec.json.decode(raw, type=StoreManifest)
    except msgspec.DecodeError as e:
        raise StoreDirectoryError(f"store directory {directory}: {MANIFEST_NAME} is unreadable ({e}); "
                                  "nothing in it was touched") from None  # fmt: skip
    if theirs.version != MANIFEST_VERSION:
        raise StoreDirectoryError(f"store directory {directory}: {MANIFEST_NAME} has version {theirs.version}, this "
                                  f"store reads version {MANIFEST_VERSION}; nothing in it was touched")  # fmt: skip
    differences = []
    if mismatch := theirs.contract.mismatch(contract):
        differences.append(mismatch.removeprefix("KV contract mismatch: "))
    if theirs.block_nbytes != block_nbytes:
        differences.append(f"block_nbytes {theirs.block_nbytes} != {block_nbytes}")
    if not differences and theirs.contract_digest != ours.contract_digest:
        differences.append(f"contract digest {theirs.contract_digest} != {ours.contract_digest}")
    if differences:
        raise StoreDirectoryError(
            f"store directory {directory} holds blocks of another KV contract (the directory's != this store's: "
            f"{'; '.join(differences)}); nothing in it was touched: point KVSERVE_STORE_DIR at another directory, "
            "or leave it unset (each contract then gets its own)"
        )
    return False
