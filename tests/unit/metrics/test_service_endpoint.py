"""Every service's own /metrics and /healthz: served on KVSERVE_METRICS_PORT before it
reaches NATS, healthy only while connected, and gone when the service stops."""

import asyncio
import socket

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from libs.common.nats_server import NatsServer
from libs.common.service import Service
from libs.common.settings import ServiceSettings
from tests.integration.conftest import wait_until_async

WAIT = 10.0  # seconds any single expected event may take
NEVER = 3600.0


@pytest.fixture(scope="module")
def nats_server():
    with NatsServer() as server:
        yield server


def unused_nats_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"nats://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


def settings(url: str, instance_id: str, port: int | None = 0) -> ServiceSettings:
    return ServiceSettings(role="store", nats_url=url, instance_id=instance_id, host_id="h", heartbeat_interval=NEVER,
                           model_spec="/models/tiny-llama", metrics_port=port)  # fmt: skip


async def test_healthy_while_connected_to_nats_with_the_service_s_metrics(nats_server):
    service = Service(settings(nats_server.url, "store-m"))
    running = asyncio.create_task(service.run())
    try:
        await wait_until_async(lambda: service.metrics_address and service.nc and service.nc.is_connected, WAIT,
                               "never connected")
        status, body = await get(service.metrics_address + "/healthz")
        assert status == 200 and '"ok"' in body
        status, text = await get(service.metrics_address + "/metrics")
        (started,) = [s for f in text_string_to_metric_families(text) for s in f.samples
                      if s.name == "kvserve_start_time_seconds"]  # fmt: skip
        assert started.labels == {"instance": "store-m", "role": "store", "model_name": "tiny-llama"}
        assert started.value == service.started_at
    finally:
        service.stopping.set()
        await running
    with pytest.raises(aiohttp.ClientConnectionError):  # closed with the service
        await get(service.metrics_address + "/healthz")


async def test_unhealthy_while_nats_is_unreachable():
    service = Service(settings(unused_nats_url(), "store-n"))
    running = asyncio.create_task(service.run())
    try:
        await wait_until_async(lambda: service.metrics_address is not None, WAIT, "no metrics endpoint")
        status, body = await get(service.metrics_address + "/healthz")
        assert status == 503 and "not connected to NATS" in body
    finally:
        running.cancel()  # (stopping before NATS was ever reached exits the process)
        with pytest.raises(asyncio.CancelledError):
            await running
    with pytest.raises(aiohttp.ClientConnectionError):  # closed on the way out
        await get(service.metrics_address + "/healthz")


async def test_no_port_no_endpoint(nats_server):
    service = Service(settings(nats_server.url, "store-o", port=None))
    running = asyncio.create_task(service.run())
    try:
        await wait_until_async(lambda: service.nc is not None and service.nc.is_connected, WAIT, "never connected")
        assert service.metrics_address is None
    finally:
        service.stopping.set()
        await running
