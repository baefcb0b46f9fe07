"""Real clusters for integration tests: a real nats-server and one process per
service, started through the same LocalCluster that `kvserve up` runs."""

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.cli.cluster import LocalCluster
from libs.protocol import schema, subjects

T = TypeVar("T")

# float32 so outputs compare exactly with the one-process reference; small pools keep start-up quick
CLUSTER_ENV = {
    "KVSERVE_NUM_BLOCKS": "192",
    "KVSERVE_STORE_CAPACITY_BYTES": str(128 << 20),
    # routing without refusals: these clusters load a slow shared machine on purpose, and
    # admission is the conductor's tests' subject (test_conductor.py)
    "KVSERVE_POLICY": "cache_aware",
    # no timing of the engine at start (~2.5 s a worker here): with no refusals, the cost model
    # only breaks routing ties; tests of admission and cost models turn it back on (CALIBRATED)
    "KVSERVE_CALIBRATE": "0",
}
CALIBRATED = {"KVSERVE_CALIBRATE": "1"}


# Clusters a test may have used: a failing test's report carries their logs (tests/conftest.py).
STARTED: list[LocalCluster] = []


def start_cluster(prefill: int = 1, decode: int = 1, env: dict | None = None, store_dir=None,
                  api_key: str | None = None, tenants_file: str | None = None) -> LocalCluster:  # fmt: skip
    cluster = LocalCluster(
        prefill=prefill, decode=decode, gateway_port=0, dtype="float32", env={**CLUSTER_ENV, **(env or {})}, log=None,
        store_dir=store_dir or tempfile.mkdtemp(prefix="kvserve-stores-"),  # no test sees another's disk tier
        api_key=api_key, tenants_file=tenants_file,
    )
    STARTED.append(cluster)
    cluster.start(timeout=120)
    return cluster


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def openai_client(cluster):
    from openai import OpenAI

    return OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0)


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)  # polling with a deadline, not synchronising on a guess


def metric_value(exposition: str, sample: str, **labels: str) -> float:
    """The sum of ``sample`` over the series of a Prometheus exposition whose labels
    include ``labels`` (0 when there is none)."""
    return sum(s.value for family in text_string_to_metric_families(exposition) for s in family.samples
               if s.name == sample and labels.items() <= s.labels.items())  # fmt: skip


def metrics_of(cluster: LocalCluster, instance_id: str) -> str:
    """One instance's Prometheus exposition, asked for over NATS."""
    async def ask() -> str:
        nc = await nats.connect(cluster.nats_url)
        try:
            reply = await nc.request(subjects.metrics(instance_id), schema.encode(schema.MetricsRequest()), timeout=5)
            return schema.decode(reply.data, schema.MetricsReply).text
        finally:
            await nc.close()

    return asyncio.run(ask())


async def poll_until(probe: Callable[[], Awaitable[T]], holds: Callable[[T], bool], timeout: float, what: str,
                     interval: float = 0.05) -> T:  # fmt: skip
    """Await ``probe()`` until ``holds`` its result, without blocking the event loop; fail
    with ``what`` after ``timeout`` seconds. Returns the result that held."""
    deadline = time.monotonic() + timeout
    while not holds(result := await probe()):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(interval)  # polling with a deadline, not synchronising on a guess
    return result


async def wait_until_async(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """``wait_until`` for coroutines: poll without blocking the event loop; fail with ``what``."""

    async def probe() -> bool:
        return condition()

    await poll_until(probe, bool, timeout, what, interval)


async def repeat_until(stopped: asyncio.Event, period: float, action: Callable[[], Awaitable[object]]) -> None:
    """Await ``action()`` now and then every ``period`` seconds until ``stopped`` is set: the
    clock of a fake service's heartbeats (a worker is alive while it beats), which ends as
    soon as it is told to."""
    while True:
        await action()
        try:
            await asyncio.wait_for(stopped.wait(), period)
            return
        except asyncio.TimeoutError:
            pass
