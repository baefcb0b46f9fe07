"""Cache isolation: a scope's chains start from its own root, so the same prompt in
two scopes shares no block name — in the hashes, in a KV cache, in the gateway's
roots per tenant — while the default scope names blocks exactly as before."""

import json

import pytest

from libs.common import tenants as tenants_file
from libs.common.tenants import Tenant, Tenants
from libs.engine.model.kv_cache import KVCacheManager
from libs.engine.model.sequence import Sequence
from libs.protocol.hashing import ROOT, block_hashes, hash_block, scope_root
from services.conductor.simulator.trace import load_trace
from services.gateway.errors import InvalidParameterError
from services.gateway.openai_protocol import parse_completion_request
from services.gateway.tenancy import TenantDirectory

TOKENS = list(range(100, 170))  # 4 full blocks of 16
EXTRA = b"model"


def test_a_scope_renames_every_block_and_the_default_scope_is_unchanged():
    a, b = scope_root(b"tenant-a"), scope_root(b"tenant-b")
    plain = block_hashes(TOKENS, 16, EXTRA)
    in_a, in_b = block_hashes(TOKENS, 16, EXTRA, a), block_hashes(TOKENS, 16, EXTRA, b)
    assert plain[0] == hash_block(ROOT, TOKENS[:16], EXTRA)  # no scope: the names of before
    assert not set(in_a) & set(in_b) and not set(in_a) & set(plain)
    assert in_a == block_hashes(TOKENS, 16, EXTRA, scope_root(b"tenant-a"))  # deterministic
    assert scope_root(b"salt", a) not in (a, scope_root(b"salt"))  # nested scopes differ from both parts


def cached_tokens(cache: KVCacheManager, root, request_id: str) -> int:
    """Run a prompt's prefill bookkeeping and return how many of its tokens were a hit."""
    seq = Sequence.from_prompt(request_id, TOKENS, hash_root=root)
    hit = cache.match_prefix(seq)
    cache.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    cache.cache_full_blocks(seq)
    cache.free(seq)
    return hit


def test_a_kv_cache_never_matches_another_scopes_blocks():
    cache = KVCacheManager(32, 16, EXTRA)
    a, b = scope_root(b"a"), scope_root(b"b")
    assert cached_tokens(cache, a, "a1") == 0
    assert cached_tokens(cache, b, "b1") == 0  # the same prompt: no hit across scopes
    assert cached_tokens(cache, a, "a2") == 64  # a hit within one
    assert cached_tokens(cache, ROOT, "d1") == 0


def test_the_gateway_gives_each_tenant_its_own_root_and_a_shared_scope_one_root(tmp_path):
    path = tmp_path / "tenants.toml"
    tenants_file.write(path, Tenants({"a": Tenant("a"), "b": Tenant("b"), "c": Tenant("c", cache_scope="pub"),
                                      "d": Tenant("d", cache_scope="pub")}, b"secret"))  # fmt: skip
    directory = TenantDirectory(str(path))
    t = directory.tenants.tenants
    roots = {name: directory.hash_root(t[name]) for name in "abcd"}
    assert len({roots["a"], roots["b"], roots["c"], ROOT}) == 4
    assert roots["c"] == roots["d"]
    salted = directory.hash_root(t["a"], "user-42")
    assert salted not in roots.values() and salted == directory.hash_root(t["a"], "user-42")
    assert directory.hash_root(t["b"], "user-42") != salted  # the same salt in another tenant: another scope
    tenants_file.write(path, Tenants(directory.tenants.tenants, b"other secret"))
    directory.reload()
    assert directory.hash_root(directory.tenants.tenants["a"]) != roots["a"]  # the secret is part of the name


def test_without_tenants_only_a_cache_salt_moves_a_request_out_of_the_default_scope():
    directory = TenantDirectory()
    tenant = directory.authenticate(None)
    assert directory.hash_root(tenant) == ROOT
    assert directory.hash_root(tenant, "s") == scope_root(b"cache_salt/s")


def test_a_request_may_carry_vllms_cache_salt():
    assert parse_completion_request({"model": "m", "prompt": "x", "cache_salt": "u1"}).cache_salt == "u1"
    assert parse_completion_request({"model": "m", "prompt": "x"}).cache_salt is None
    for bad in ("", 5):
        with pytest.raises(InvalidParameterError) as e:
            parse_completion_request({"model": "m", "prompt": "x", "cache_salt": bad})
        assert e.value.param == "cache_salt"


def test_a_traces_tenants_get_their_own_block_ids_in_the_simulator(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]},
            {"timestamp": 1, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2], "tenant": "a"},
            {"timestamp": 2, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2], "tenant": "b",
             "weight": 2},
            {"timestamp": 3, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2], "tenant": "c",
             "cache_scope": "pub"},
            {"timestamp": 4, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2], "tenant": "d",
             "cache_scope": "pub"}]  # fmt: skip
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    plain, a, b, c, d = load_trace(path)
    assert plain.hash_ids == (1, 2) and plain.tenant is None
    assert len({plain.hash_ids, a.hash_ids, b.hash_ids, c.hash_ids}) == 4
    assert c.hash_ids == d.hash_ids
    assert (b.tenant, b.weight) == ("b", 2.0)
