"""Tenants on a real cluster: each tenant's KV cache is its own (the same prompt from
another tenant is a cold prompt: no device, store or disk hit) unless both joined a
shared scope; a request's cache_salt narrows reuse within a tenant. Quotas, auth
errors and usage as the official client and a scraper read them."""

import json
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import openai
import pytest
from openai import OpenAI

from libs.common import tenants as tenants_file
from libs.common.tenants import Quotas, Tenant, Tenants
from tests.integration.conftest import metric_value, start_cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"
NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "gina", "hank", "ivy")
QUOTAS = {"erin": Quotas(requests_per_minute=2, tokens_per_minute=10_000), "frank": Quotas(max_prompt_tokens=8)}


@pytest.fixture(scope="module")
def keys():
    return {name: tenants_file.new_key() for name in NAMES}


@pytest.fixture(scope="module")
def tenant_cluster(tmp_path_factory, keys):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    scopes = {"carol": "pub", "dave": "pub"}
    tenants = {name: Tenant(name, (tenants_file.hash_key(keys[name]),), cache_scope=scopes.get(name),
                            quotas=QUOTAS.get(name, Quotas()), disabled=name == "gina", admin=name == "ivy")
               for name in NAMES}
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


def stream_lines(cluster, key: str, body: dict, lines: list[str], first: threading.Event) -> None:
    """POST a streamed completion and keep every SSE line it sends, until the server ends it."""
    request = urllib.request.Request(cluster.gateway_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            if line := raw.decode().strip():
                lines.append(line)
                first.set()


def status_of(cluster, path: str, key: str) -> tuple[int, dict]:
    try:
        return 200, json.loads(get(cluster, path, key))
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_a_key_rotated_by_the_cli_takes_effect_without_a_restart_and_the_stream_in_flight_finishes(
    tenant_cluster, keys
):
    cluster, path = tenant_cluster
    old = keys["hank"]
    prompt = "Write a long story about a lighthouse keeper who counts the ships passing by at night."
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 384, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0}
    lines: list[str] = []
    first = threading.Event()
    reader = threading.Thread(target=stream_lines, args=(cluster, old, body, lines, first), daemon=True)
    reader.start()
    assert first.wait(120), "the stream sent nothing"

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    rotated = subprocess.run([sys.executable, "-m", "kvserve.cli.main", "tenants", "rotate-key", "hank",
                              "--file", str(path)], env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.strip()
    assert new.startswith(tenants_file.KEY_PREFIX) and new != old

    wait_until(lambda: status_of(cluster, "/v1/models", old)[0] == 401, timeout=30)  # the gateway reloaded
    code, error = status_of(cluster, "/v1/models", old)
    assert code == 401 and error["error"]["code"] == "invalid_api_key" and error["error"]["type"]
    mine = json.loads(get(cluster, "/v1/usage", new))  # the new key works, as the same tenant
    assert mine["tenant"] == "hank"
    assert mine["in_flight"] == 1, "the stream ended before the reload: nothing was in flight across it"

    reader.join(timeout=300)
    assert not reader.is_alive()
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    usage = [c["usage"] for c in chunks if c.get("usage")][-1]
    assert usage["completion_tokens"] == 384
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    tokens = [t for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
              for t in c["choices"][0]["logprobs"]["tokens"]]  # fmt: skip
    # the stream's text is whole: every token, once, in order (the text leaves out the special tokens)
    assert len(tokens) == 384 and re.sub(r"<\|\w+\|>", "", "".join(tokens)) == text

    for instance_id in cluster.instance_ids:
        log = "\n".join(cluster.logs(instance_id))
        for key in (old, new):
            assert key not in log and tenants_file.hash_key(key) not in log


def test_the_console_and_status_show_an_admin_every_tenant_and_a_tenant_itself(tenant_cluster, keys):
    cluster, _ = tenant_cluster
    for name in ("alice", "bob"):
        client(cluster, keys[name]).completions.create(model=MODEL, prompt=f"Hello from {name}", max_tokens=2)
    admin = json.loads(get(cluster, "/console/api/state", keys["ivy"]))["tenants"]
    rows = {row["tenant"]: row for row in admin}
    assert {"alice", "bob"} <= set(rows) and rows["bob"]["requests"] >= 1
    assert rows["bob"]["slo_met"] + rows["bob"]["slo_missed"] >= 1
    own = json.loads(get(cluster, "/console/api/state", keys["alice"]))["tenants"]
    assert [row["tenant"] for row in own] == ["alice"] and own[0]["requests"] == rows["alice"]["requests"]

    def status(key: str) -> str:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "KVSERVE_API_KEY": key}
        done = subprocess.run([sys.executable, "-m", "kvserve.cli.main", "status", "--url", cluster.gateway_url],
                              env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert key not in done.stdout
        lines = done.stdout.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("TENANTS"))
        return [line.split()[0] for line in lines[at + 2:]]

    assert {"alice", "bob"} <= set(status(keys["ivy"]))
    assert status(keys["bob"]) == ["bob"]
