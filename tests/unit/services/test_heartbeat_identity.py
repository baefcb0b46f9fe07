"""A heartbeat is believed only on its sender's own subject: one sent in another
instance's name (which a role's NATS user could do) never reaches a service's view."""

import asyncio
from contextlib import AsyncExitStack

import nats
import pytest

from libs.common.nats_flush import flush
from libs.common.nats_server import NatsServer
from libs.common.service import Service
from libs.common.settings import ServiceSettings
from libs.protocol import schema, subjects
from libs.protocol.schema import Heartbeat

WAIT = 10.0  # seconds any single expected event may take
NEVER = 3600.0  # a heartbeat interval no test outlives


@pytest.fixture(scope="module")
def nats_server():
    with NatsServer() as server:
        yield server


class Listener(Service):
    """Hears decode workers' heartbeats, as a prefill worker does."""

    def __init__(self, settings: ServiceSettings) -> None:
        super().__init__(settings)
        self.heard: asyncio.Queue[Heartbeat] = asyncio.Queue()
        self.listening = asyncio.Event()

    async def start(self, stack: AsyncExitStack) -> None:
        await self.subscribe_heartbeats("decode", self.on_heartbeat)
        await flush(self.nc)
        self.listening.set()

    async def on_heartbeat(self, beat: Heartbeat, msg) -> None:
        self.heard.put_nowait(beat)


async def test_a_heartbeat_in_another_instances_name_is_dropped(nats_server):
    service = Listener(ServiceSettings(role="prefill", nats_url=nats_server.url, instance_id="prefill-h",
                                       host_id="h", heartbeat_interval=NEVER))  # fmt: skip
    running = asyncio.create_task(service.run())
    nc = await nats.connect(nats_server.url)
    try:
        await asyncio.wait_for(service.listening.wait(), WAIT)
        forged = Heartbeat(instance_id="decode-0", role="decode", host_id="elsewhere")
        await nc.publish(subjects.heartbeat("decode", "decode-1"), schema.encode(forged))
        genuine = Heartbeat(instance_id="decode-1", role="decode", host_id="h")
        await nc.publish(subjects.heartbeat("decode", "decode-1"), schema.encode(genuine))
        # one connection's messages arrive in order: the forged one came first, and was dropped
        assert (await asyncio.wait_for(service.heard.get(), WAIT)).instance_id == "decode-1"
        assert service.heard.empty()
    finally:
        service.stopping.set()
        await running
        await nc.close()
