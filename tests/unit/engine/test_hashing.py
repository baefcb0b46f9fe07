"""Block hashes: deterministic everywhere, chained, full blocks only."""

import json
import os
import subprocess
import sys
from pathlib import Path

from libs.protocol.hashing import ROOT, block_hashes, hash_block, model_extra

ROOT_DIR = Path(__file__).resolve().parents[3]
TOKENS = list(range(1000, 1070))  # 4 full blocks of 16 and 6 spare tokens
EXTRA = model_extra("SmolLM2-135M-Instruct")


def test_equal_prefixes_give_equal_chains_in_another_process():
    code = (
        "import json,sys; from libs.protocol.hashing import block_hashes, model_extra;"
        "print(json.dumps([h.hex() for h in block_hashes(list(range(1000, 1070)), 16, "
        "model_extra('SmolLM2-135M-Instruct'))]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # Python's own hash() would differ
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT_DIR)
    assert json.loads(out.stdout) == [h.hex() for h in block_hashes(TOKENS, 16, EXTRA)]


def test_partial_blocks_are_not_hashed():
    assert len(block_hashes(TOKENS, 16, EXTRA)) == 4
    assert block_hashes(TOKENS[:15], 16, EXTRA) == []
    assert len(block_hashes(TOKENS[:16], 16, EXTRA)) == 1


def test_a_changed_token_changes_its_block_and_every_later_one():
    base = block_hashes(TOKENS, 16, EXTRA)
    changed = list(TOKENS)
    changed[20] += 1  # inside block 1
    other = block_hashes(changed, 16, EXTRA)
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(base[1:], other[1:]))


def test_chain_is_parent_then_tokens_then_extra():
    first = hash_block(ROOT, TOKENS[:16], EXTRA)
    assert block_hashes(TOKENS, 16, EXTRA)[:2] == [first, hash_block(first, TOKENS[16:32], EXTRA)]
    assert len(first) == 16


def test_model_id_is_mixed_in():
    assert block_hashes(TOKENS, 16, model_extra("a")) != block_hashes(TOKENS, 16, model_extra("b"))
