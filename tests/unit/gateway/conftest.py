"""Gateway fixtures: the tiny checkpoint served the way the gateway serves it."""

import pytest

from services.gateway.served_model import ServedModel
from services.gateway.settings import GatewaySettings


def gateway_settings(**overrides) -> GatewaySettings:
    fields = dict(role="gateway", nats_url="nats://127.0.0.1:1", instance_id="gateway-test", host_id="test", port=0)
    return GatewaySettings(**{**fields, **overrides})


@pytest.fixture(scope="session")
def served_model(tiny_checkpoint) -> ServedModel:
    return ServedModel.load(str(tiny_checkpoint), block_size=16)
