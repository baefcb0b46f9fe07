"""The roll call: a service that starts late sees the peers already running at once,
not one heartbeat interval later (a prefill worker would otherwise skip the store
for its first requests)."""

import asyncio

import nats
import pytest

from libs.common.nats_flush import flush
from libs.common.nats_server import NatsServer
from libs.common.service import Service
from libs.common.settings import ServiceSettings
from libs.protocol import schema, subjects
from libs.protocol.schema import Heartbeat

WAIT = 10.0  # seconds any single expected event may take
NEVER = 3600.0  # a heartbeat interval no test outlives: the only beats are the first and answers


@pytest.fixture(scope="module")
def nats_server():
    with NatsServer() as server:
        yield server


async def watch(url: str) -> tuple[nats.NATS, asyncio.Queue]:
    nc = await nats.connect(url)
    beats: asyncio.Queue[Heartbeat] = asyncio.Queue()

    async def on_beat(msg) -> None:
        beats.put_nowait(schema.decode(msg.data, Heartbeat))

    await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)
    await flush(nc)
    return nc, beats


async def next_beat_of(beats: asyncio.Queue, instance_id: str) -> Heartbeat:
    while True:
        beat = await asyncio.wait_for(beats.get(), WAIT)
        if beat.instance_id == instance_id:
            return beat


async def test_a_roll_call_is_answered_with_a_heartbeat_at_once(nats_server):
    settings = ServiceSettings(role="store", nats_url=nats_server.url, instance_id="store-r", host_id="h",
                               heartbeat_interval=NEVER)  # fmt: skip
    service = Service(settings)
    nc, beats = await watch(nats_server.url)
    running = asyncio.create_task(service.run())
    try:
        await next_beat_of(beats, "store-r")  # its first beat, sent on start
        await nc.publish(subjects.ROLL_CALL, schema.encode(schema.RollCall(instance_id="late")))
        beat = await next_beat_of(beats, "store-r")  # the answer: the next beat would be an hour away
        assert beat.role == "store"
    finally:
        service.stopping.set()
        await running
        await nc.close()


async def test_a_service_calls_the_roll_when_it_starts(nats_server):
    nc, _ = await watch(nats_server.url)
    calls: asyncio.Queue[schema.RollCall] = asyncio.Queue()

    async def on_call(msg) -> None:
        calls.put_nowait(schema.decode(msg.data, schema.RollCall))

    await nc.subscribe(subjects.ROLL_CALL, cb=on_call)
    await flush(nc)
    service = Service(ServiceSettings(role="prefill", nats_url=nats_server.url, instance_id="prefill-r", host_id="h",
                                      heartbeat_interval=NEVER))  # fmt: skip
    running = asyncio.create_task(service.run())
    try:
        call = await asyncio.wait_for(calls.get(), WAIT)
        assert call.instance_id == "prefill-r"
    finally:
        service.stopping.set()
        await running
        await nc.close()
