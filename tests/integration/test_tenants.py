"""Tenants on a real cluster: each tenant's KV cache is its own (the same prompt from
another tenant is a cold prompt: no device, store or disk hit) unless both joined a
shared scope; a request's cache_salt narrows reuse within a tenant."""

import pytest
from openai import OpenAI

from libs.common import tenants as tenants_file
from libs.common.tenants import Tenant, Tenants
from tests.integration.conftest import start_cluster

MODEL = "SmolLM2-135M-Instruct"
NAMES = ("alice", "bob", "carol", "dave")


@pytest.fixture(scope="module")
def keys():
    return {name: tenants_file.new_key() for name in NAMES}


@pytest.fixture(scope="module")
def tenant_cluster(tmp_path_factory, keys):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    scopes = {"carol": "pub", "dave": "pub"}
    tenants = {name: Tenant(name, (tenants_file.hash_key(keys[name]),), cache_scope=scopes.get(name)) for name in NAMES}
    tenants_file.write(path, Tenants(tenants, tenants_file.new_secret()))
    cluster = start_cluster(tenants_file=str(path))
    yield cluster, path
    cluster.stop()


def client(cluster, key: str) -> OpenAI:
    return OpenAI(base_url=cluster.gateway_url + "/v1", api_key=key, max_retries=0)


def cached(openai: OpenAI, prompt: str, **extra) -> int:
    out = openai.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra or None)
    return out.usage.prompt_tokens_details.cached_tokens


def test_another_tenant_sending_the_same_prompt_gets_no_cache_hit(tenant_cluster, keys):
    cluster, _ = tenant_cluster
    prompt = "Tenant isolation: the quick brown fox jumps over the lazy dog near the river bank. " * 6
    alice, bob = client(cluster, keys["alice"]), client(cluster, keys["bob"])
    assert cached(alice, prompt) == 0
    assert cached(bob, prompt) == 0  # alice's blocks are in the prefill worker and the store: bob cannot name them
    assert cached(alice, prompt) >= 16 * 4  # alice's own second request is a hit
    assert cached(bob, prompt) >= 16 * 4  # and bob's own too


def test_tenants_in_a_shared_scope_share_their_cache(tenant_cluster, keys):
    cluster, _ = tenant_cluster
    prompt = "A public system prompt library entry: always answer politely and briefly, in English. " * 6
    assert cached(client(cluster, keys["carol"]), prompt) == 0
    assert cached(client(cluster, keys["dave"]), prompt) >= 16 * 4
    assert cached(client(cluster, keys["alice"]), prompt) == 0  # not in the scope


def test_a_cache_salt_narrows_reuse_within_a_tenant(tenant_cluster, keys):
    cluster, _ = tenant_cluster
    prompt = "Per-user salts keep one user's conversation from being probed by another user. " * 6
    alice = client(cluster, keys["alice"])
    assert cached(alice, prompt, cache_salt="user-1") == 0
    assert cached(alice, prompt, cache_salt="user-2") == 0
    assert cached(alice, prompt) == 0
    assert cached(alice, prompt, cache_salt="user-1") >= 16 * 4
