"""A service's own /metrics and /healthz."""

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from libs.common import metrics_server
from libs.common.metrics import Metrics


@pytest.fixture
def state():
    m = Metrics("store-0", "store", "M")
    m.counter("kvserve_things_total", "Things").inc(4)
    return {"metrics": m, "problems": []}


@pytest.fixture
async def client(state):
    app = metrics_server.init_app(state["metrics"], lambda: state["problems"], "store-0")
    async with TestClient(TestServer(app)) as client:
        yield client


async def test_metrics_are_the_process_s_exposition(client):
    response = await client.get("/metrics")
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(await response.text())}
    assert families["kvserve_things"].samples[0].value == 4
    assert families["kvserve_things"].samples[0].labels["instance"] == "store-0"


async def test_healthz_follows_the_service_s_health(client, state):
    response = await client.get("/healthz")
    assert response.status == 200 and await response.json() == {"status": "ok", "instance_id": "store-0"}
    state["problems"].append("not connected to NATS")
    response = await client.get("/healthz")
    assert response.status == 503
    assert await response.json() == {"status": "unavailable", "instance_id": "store-0", "reasons": ["not connected to NATS"]}


async def test_serve_binds_the_host_asked_on_a_free_port(state):
    app = metrics_server.init_app(state["metrics"], lambda: [], "store-0")
    runner, url = await metrics_server.serve(app, "127.0.0.1", 0)
    try:
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/metrics") as response:
                assert response.status == 200 and "kvserve_things_total" in await response.text()
            async with session.get(url + "/v1/models") as response:
                assert response.status == 404  # nothing but metrics and health here
    finally:
        await runner.cleanup()
