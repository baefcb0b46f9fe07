"""Metrics of a live cluster, as Prometheus and the Grafana dashboard read them: after a
few requests (one prompt twice, so the prefix cache hits), the gateway's /metrics is one
valid exposition with every instance's samples, holds every metric the dashboard
queries, and each service answers its own /metrics and /healthz."""

import json
import random
import re
import socket
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kvserve.cli.cluster import LocalCluster
from tests.integration.conftest import CLUSTER_ENV, STARTED, metric_value, wait_until

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
NUM_SERVICES = 5  # conductor, store, prefill-0, decode-0, gateway
# several full KV blocks of 16 tokens, so the second time it is a prefix-cache hit
PROMPT = "Here are the rules of the game, read them carefully before you answer. " * 4 + "Now name a colour."


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 now."""
    for _ in range(100):
        base = random.randrange(20_000, 60_000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(prefill=1, decode=1, gateway_port=0, dtype="float32", env=CLUSTER_ENV, log=None,
                     store_dir=tempfile.mkdtemp(prefix="kvserve-stores-"), metrics_port=free_port_run(NUM_SERVICES))
    STARTED.append(c)
    c.start(timeout=120)
    client = OpenAI(base_url=c.gateway_url + "/v1", api_key="unused", max_retries=0)
    for _ in range(2):  # the same prompt twice: the second reuses the first's KV blocks
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                            temperature=0, stream=True)  # fmt: skip
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    yield c
    c.stop()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(cluster) -> str:
    status, text = get(cluster.gateway_url + "/metrics")
    assert status == 200
    return text


def settled(cluster) -> str:
    """The gateway's scrape once the three requests are all counted (the gateway counts a
    request as its handler ends, the prefill worker as it attaches the prompt)."""
    texts = []

    def counted() -> bool:
        texts.append(scrape(cluster))
        return (metric_value(texts[-1], "kvserve_request_success_total") >= 3
                and metric_value(texts[-1], "kvserve_prefix_cache_hits_total", tier="device") > 0)  # fmt: skip

    wait_until(counted, timeout=30, interval=0.5)
    return texts[-1]


def dashboard_metrics() -> set[str]:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "kvserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    return {name for expr in exprs for name in re.findall(r"\bkvserve_[a-z0-9_]+\b", expr)}


def resolves(name: str, families: dict) -> bool:
    """Whether ``name``, as a PromQL query names it, is a series of the scrape: a gauge by
    its name, a counter's ``_total``, a histogram's ``_bucket``/``_sum``/``_count``."""
    for suffix, kind in (("_bucket", "histogram"), ("_sum", "histogram"), ("_count", "histogram"), ("_total", "counter")):
        family = families.get(name.removesuffix(suffix)) if name.endswith(suffix) else None
        if family is not None and family.type == kind:
            return any(s.name == name for s in family.samples)
    family = families.get(name)
    return family is not None and family.type == "gauge" and bool(family.samples)


def test_the_gateway_scrape_is_one_valid_exposition_of_every_instance(cluster):
    text = settled(cluster)
    families = {f.name: f for f in text_string_to_metric_families(text)}  # raises if it does not parse
    for name in families:
        assert len(re.findall(rf"^# TYPE {re.escape(name)}(_total)? ", text, re.M)) == 1, f"{name}: TYPE twice"
    samples = [s for f in families.values() for s in f.samples]
    assert all({"instance", "role", "model_name"} <= s.labels.keys() for s in samples)
    assert {s.labels["instance"] for s in samples} == set(cluster.instance_ids)
    assert {s.labels["model_name"] for s in samples} == {MODEL}
    assert metric_value(text, "kvserve_prefix_cache_queries_total") >= 3 * 16
    assert metric_value(text, "kvserve_time_to_first_token_seconds_count", role="gateway") >= 3
    assert metric_value(text, "kvserve_inter_token_latency_seconds_count") > 0
    assert metric_value(text, "kvserve_transfers_total", transport="shm") > 0  # the hand-offs


def test_every_metric_the_dashboard_queries_is_in_the_scrape(cluster):
    families = {f.name: f for f in text_string_to_metric_families(settled(cluster))}
    queried = dashboard_metrics()
    assert len(queried) > 20 and "kvserve_time_to_first_token_seconds_bucket" in queried
    missing = sorted(name for name in queried if not resolves(name, families))
    assert not missing, f"the dashboard queries series no cluster exports: {missing}"


def test_each_service_serves_its_own_metrics_and_health(cluster):
    ports = cluster.metrics_ports()
    assert set(ports) == set(cluster.instance_ids) and len(set(ports.values())) == NUM_SERVICES
    for instance_id, port in ports.items():
        status, body = get(f"http://127.0.0.1:{port}/healthz")
        assert status == 200 and json.loads(body) == {"status": "ok", "instance_id": instance_id}
        status, text = get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        instances = {s.labels["instance"] for f in text_string_to_metric_families(text) for s in f.samples}
        assert instances == {instance_id}  # its own metrics only
        assert metric_value(text, "kvserve_start_time_seconds") > 0
