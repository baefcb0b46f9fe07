"""Gateway fixtures: the tiny checkpoint served the way the gateway serves it, and a
real nats-server (one per test module) with a client connected to it."""

import nats
import pytest

from libs.common.nats_server import NatsServer
from services.gateway.served_model import ServedModel
from services.gateway.settings import GatewaySettings


def gateway_settings(**overrides) -> GatewaySettings:
    fields = dict(role="gateway", nats_url="nats://127.0.0.1:1", instance_id="gateway-test", host_id="test", port=0)
    return GatewaySettings(**{**fields, **overrides})


@pytest.fixture(scope="session")
def served_model(tiny_checkpoint) -> ServedModel:
    return ServedModel.load(str(tiny_checkpoint), block_size=16)


@pytest.fixture(scope="module")
def nats_server():
    with NatsServer() as server:
        yield server


@pytest.fixture
async def nc(nats_server):
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()
