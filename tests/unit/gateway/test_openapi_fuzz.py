"""Schemathesis against the gateway's own /openapi.json: valid and invalid requests
generated from the description, for every operation, never get a 5xx, and every
answer has a status, content type and body the description documents. The gateway
runs in-process against a real nats-server with the test playing the cluster."""

import asyncio

import hypothesis
import pytest
import requests
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from libs.protocol import schema, subjects
from libs.protocol.schema import Heartbeat
from tests.integration.conftest import repeat_until, wait_until
from tests.unit.gateway.test_gateway_nats import cluster, start_gateway  # noqa: F401 (fixtures)

MAX_EXAMPLES = 30  # per operation and generation mode
WAIT = 20.0


async def beat(nc) -> None:  # noqa: F811 (the fixture's client)
    """A live conductor, prefill and decode instance, as the gateway's readiness sees them."""
    for role in ("conductor", "prefill", "decode"):
        beat = Heartbeat(instance_id=f"{role}-fake", role=role, host_id="test")
        await nc.publish(subjects.heartbeat(role, beat.instance_id), schema.encode(beat))


def fuzz(base_url: str) -> None:
    """Every operation of the description, positive then negative cases; raises on the first failure."""
    wait_until(lambda: requests.get(base_url + "/health/ready", timeout=WAIT).status_code == 200, WAIT)
    api = schemathesis.openapi.from_url(base_url + "/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    settings = hypothesis.settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,  # the same cases every run: a failure here reproduces
        database=None,
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    with requests.Session() as session:
        for result in api.get_all_operations():
            operation = result.ok()
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

                @settings
                @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
                def check(case: schemathesis.Case) -> None:
                    response = case.call(base_url=base_url, session=session, timeout=WAIT)
                    case.validate_response(response, checks=checks)

                try:
                    check()
                except hypothesis.errors.Unsatisfiable:
                    assert mode == schemathesis.GenerationMode.NEGATIVE, operation.label  # no input to get wrong


@pytest.mark.timeout(600)
async def test_no_generated_request_gets_a_5xx(start_gateway, cluster, nc):  # noqa: F811 (fixtures)
    stopped = asyncio.Event()
    beats = asyncio.create_task(repeat_until(stopped, 0.5, lambda: beat(nc)))
    try:
        url = await start_gateway()
        await asyncio.to_thread(fuzz, url)
    finally:
        stopped.set()
        await beats
