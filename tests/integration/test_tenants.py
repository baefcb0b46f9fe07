"""Tenants on a real cluster: each tenant's KV cache is its own (the same prompt from
another tenant is a cold prompt: no device, store or disk hit) unless both joined a
shared scope; a request's cache_salt narrows reuse within a tenant. Quotas, auth
errors and usage as the official client and a scraper read them."""

import json
import urllib.request

import openai
import pytest
from openai import OpenAI

from libs.common import tenants as tenants_file
from libs.common.tenants import Quotas, Tenant, Tenants
from tests.integration.conftest import metric_value, start_cluster

MODEL = "SmolLM2-135M-Instruct"
NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "gina")
QUOTAS = {"erin": Quotas(requests_per_minute=2, tokens_per_minute=10_000), "frank": Quotas(max_prompt_tokens=8)}


@pytest.fixture(scope="module")
def keys():
    return {name: tenants_file.new_key() for name in NAMES}


@pytest.fixture(scope="module")
def tenant_cluster(tmp_path_factory, keys):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    scopes = {"carol": "pub", "dave": "pub"}
    tenants = {name: Tenant(name, (tenants_file.hash_key(keys[name]),), cache_scope=scopes.get(name),
                            quotas=QUOTAS.get(name, Quotas()), disabled=name == "gina") for name in NAMES}
    tenants_file.write(path, Tenants(tenants, tenants_file.new_secret()))
    cluster = start_cluster(tenants_file=str(path))
    yield cluster, path
    cluster.stop()


def get(cluster, path: str, key: str) -> str:
    request = urllib.request.Request(cluster.gateway_url + path, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


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


def test_quotas_refuse_with_openais_rate_limit_error_and_headers(tenant_cluster, keys):
    cluster, _ = tenant_cluster
    erin = client(cluster, keys["erin"])
    ok = erin.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert ok.headers["x-ratelimit-limit-requests"] == "2"
    assert ok.headers["x-ratelimit-remaining-requests"] == "1"
    assert ok.headers["x-ratelimit-limit-tokens"] == "10000"
    erin.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    with pytest.raises(openai.RateLimitError) as e:
        erin.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    error, headers = e.value.body, e.value.response.headers
    assert (error["type"], error["code"], error["reason"]) == ("rate_limit_error", "rate_limit_exceeded",
                                                               "requests_per_minute")  # fmt: skip
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s") and int(headers["Retry-After"]) >= 1
    assert "x-ratelimit-remaining-tokens" in headers
    alice = client(cluster, keys["alice"])  # another tenant is not held back by erin's quota
    alice.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)

    with pytest.raises(openai.RateLimitError) as e:
        client(cluster, keys["frank"]).completions.create(model=MODEL, prompt="one two three four five six seven "
                                                          "eight nine ten", max_tokens=2)  # fmt: skip
    assert e.value.body["reason"] == "max_prompt_tokens"


def test_an_unknown_key_and_a_disabled_tenant(tenant_cluster, keys):
    cluster, _ = tenant_cluster
    with pytest.raises(openai.AuthenticationError):
        client(cluster, "kvs-not-a-key").models.list()
    with pytest.raises(openai.PermissionDeniedError) as e:
        client(cluster, keys["gina"]).models.list()
    assert keys["gina"] not in str(e.value.body)


def test_usage_is_the_callers_own_and_the_metrics_count_per_tenant_without_secrets(tenant_cluster, keys):
    cluster, path = tenant_cluster
    bob = client(cluster, keys["bob"])
    before = json.loads(get(cluster, "/v1/usage", keys["bob"]))
    out = bob.completions.create(model=MODEL, prompt="Counting tokens for bob", max_tokens=3, temperature=0)
    mine = json.loads(get(cluster, "/v1/usage", keys["bob"]))
    assert mine["tenant"] == "bob"
    assert mine["requests"] == before["requests"] + 1
    assert mine["prompt_tokens"] == before["prompt_tokens"] + out.usage.prompt_tokens
    assert mine["completion_tokens"] == before["completion_tokens"] + out.usage.completion_tokens
    erins = json.loads(get(cluster, "/v1/usage", keys["erin"]))
    assert erins["tenant"] == "erin" and erins["limits"]["requests_per_minute"] == 2
    metrics = get(cluster, "/metrics", keys["bob"])
    assert metric_value(metrics, "kvserve_tenant_requests_total", tenant="bob") == mine["requests"]
    assert metric_value(metrics, "kvserve_tenant_prompt_tokens_total", tenant="bob") == mine["prompt_tokens"]
    secret = tenants_file.read(path).scope_secret.decode()
    for text in (metrics, str(mine), str(erins)):
        assert secret not in text
        assert not any(key in text or tenants_file.hash_key(key) in text for key in keys.values())
