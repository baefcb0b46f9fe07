"""A prefill worker passes over a store that failed to answer (dead, restarting) until it
is heard from again, instead of waiting out the call's timeout once per request."""

import asyncio
import logging
from types import SimpleNamespace

from libs.common import store_client
from libs.common.peers import PeerDirectory
from libs.protocol.schema import Heartbeat
from services.prefill.store_client import StoreClient


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(instance_id: str) -> Heartbeat:
    return Heartbeat(instance_id=instance_id, role="store", host_id="h", started_at=1.0)


def client(clock: Clock) -> StoreClient:
    service = SimpleNamespace(log=logging.getLogger("test"), heard_views=[])
    host = SimpleNamespace(engine=SimpleNamespace(cache=SimpleNamespace(block_size=16)))
    c = StoreClient(service, host)
    c.stores = PeerDirectory(clock=clock)
    return c


def test_a_store_that_failed_is_out_of_the_ring_until_its_next_heartbeat():
    clock = Clock()
    c = client(clock)
    c.stores.observe(beat("store-0"))
    c.stores.observe(beat("store-1"))
    assert c.ring().members == ["store-0", "store-1"]

    async def failing():
        raise store_client.StoreError("store-0", "exists", store_client.UNAVAILABLE, "nats: timeout")

    clock.now += 0.5
    assert asyncio.run(c._call("store-0", failing())) is None
    assert c.ring().members == ["store-1"]  # passed over, though its last heartbeat is recent
    clock.now += 0.5
    assert c.ring().members == ["store-1"]
    c.stores.observe(beat("store-0"))  # heard from after the failure: back
    assert c.ring().members == ["store-0", "store-1"]


def test_a_store_that_answered_no_stays_in_the_ring():
    clock = Clock()
    c = client(clock)
    c.stores.observe(beat("store-0"))

    async def refused():
        raise store_client.StoreError("store-0", "commit", "unknown_put", "no such put")

    assert asyncio.run(c._call("store-0", refused())) is None
    assert c.ring().members == ["store-0"]
