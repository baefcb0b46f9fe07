"""A store directory belongs to one KV contract: claimed by a manifest at first use,
refused (with the difference named, nothing touched) to a store of another; block
files of another contract are never deleted; each contract gets its own default
directory."""

import json
import os

import pytest

from libs.protocol.schema import KVContract
from services.store.__main__ import default_directory
from services.store.block_files import BlockFiles, contract_digest
from services.store.manifest import MANIFEST_NAME, StoreDirectoryError, claim_directory
from tests.unit.store.conftest import BLOCK, CONTRACT, h, payload

BF16 = KVContract(model_id="m", block_size=4, layout="layers=2 block=4 kv_heads=1 head_dim=8 bfloat16",
                  hash_scheme="blake2b-128/chain-v1")  # fmt: skip
F32 = KVContract(model_id="m", block_size=4, layout="layers=2 block=4 kv_heads=1 head_dim=8 float32",
                 hash_scheme="blake2b-128/chain-v1")  # fmt: skip


def claim(directory, contract: KVContract, block_nbytes: int) -> bool:
    return claim_directory(directory, contract, contract_digest(contract), block_nbytes)


def test_the_first_start_claims_the_directory_and_the_same_contract_is_let_back_in(tmp_path):
    directory = tmp_path / "new" / "store"
    assert claim(directory, BF16, 128) is True
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    assert manifest["contract"]["layout"].endswith("bfloat16") and manifest["block_nbytes"] == 128
    assert manifest["contract_digest"] == contract_digest(BF16).hex()
    assert claim(directory, BF16, 128) is False
    assert [p.name for p in directory.iterdir()] == [MANIFEST_NAME]  # no temp file left behind


def test_another_contract_is_refused_with_the_difference_named_and_nothing_is_touched(tmp_path):
    claim(tmp_path, BF16, 128)
    files = BlockFiles(tmp_path, contract_digest(BF16), 128)
    files.write(h(1), memoryview(bytes(128)))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(StoreDirectoryError) as refused:
        claim(tmp_path, F32, 256)
    message = str(refused.value)
    assert f"store directory {tmp_path} holds blocks of another KV contract" in message
    assert "layout 'layers=2 block=4 kv_heads=1 head_dim=8 bfloat16' != " in message and "float32'" in message
    assert "block_nbytes 128 != 256" in message and "model_id" not in message  # only what differs
    assert "\n" not in message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_an_unreadable_manifest_is_refused_and_kept(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(StoreDirectoryError, match="manifest.json is unreadable"):
        claim(tmp_path, BF16, 128)
    assert (tmp_path / MANIFEST_NAME).read_text() == "{not json"


def test_a_scan_never_deletes_block_files_of_another_contract(tmp_path):
    theirs = BlockFiles(tmp_path, contract_digest(BF16), BLOCK // 2)  # another dtype: other sizes too
    ours = BlockFiles(tmp_path, contract_digest(CONTRACT), BLOCK)
    theirs.write(h(1), memoryview(payload(1)[: BLOCK // 2]))
    ours.write(h(2), memoryview(payload(2)))
    (tmp_path / f"{h(3).hex()}.kvb").write_bytes(b"short")  # partial: ours to clean up
    assert [block for block, _ in ours.scan()] == [h(2)]
    assert sorted(os.listdir(tmp_path)) == sorted([f"{h(1).hex()}.kvb", f"{h(2).hex()}.kvb"])
    assert [block for block, _ in theirs.scan()] == [h(1)]  # still whole for its own store


def test_each_contract_has_its_own_default_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    bf16, f32 = default_directory("store-0", BF16), default_directory("store-0", F32)
    assert bf16 != f32 and bf16.parent == f32.parent == tmp_path / "store" / "store-0"
    assert default_directory("store-0", BF16) == bf16 and default_directory("store-1", BF16) != bf16
