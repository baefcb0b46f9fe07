"""libs/common/nats_flush.py: a flush is a barrier for what the connection sent before it.
nats-py's own flush writes its PING to the socket ahead of a SUB still queued for the
client's flusher task, so a request from another connection could find no responder
although the subscriber had flushed. Over a real nats-server, recording what the client
writes, in order."""

import nats
import pytest

from libs.common.nats_flush import flush
from libs.common.nats_server import NatsServer


@pytest.fixture(scope="module")
def nats_server():
    with NatsServer() as server:
        yield server


def record_writes(nc) -> list[bytes]:
    """Every byte the client writes to its socket, in order."""
    written: list[bytes] = []
    transport = nc._transport
    write, writelines = transport.write, transport.writelines

    def recording_write(data):
        written.append(bytes(data))
        write(data)

    def recording_writelines(chunks):
        chunks = [bytes(c) for c in chunks]
        written.extend(chunks)
        writelines(chunks)

    transport.write, transport.writelines = recording_write, recording_writelines
    return written


async def test_the_ping_goes_out_after_the_subscription_it_vouches_for(nats_server):
    nc = await nats.connect(nats_server.url)
    try:
        written = record_writes(nc)
        await nc.subscribe("kvserve.test.flushed")
        await flush(nc)
        wire = b"".join(written)
        assert wire.index(b"SUB kvserve.test.flushed") < wire.index(b"PING")
    finally:
        await nc.close()


async def test_a_request_right_after_another_connection_flushed_its_subscription_is_answered(nats_server):
    responder, requester = [await nats.connect(nats_server.url) for _ in range(2)]
    try:
        for i in range(20):
            subject = f"kvserve.test.answer.{i}"

            async def answer(msg):
                await msg.respond(b"here")

            await responder.subscribe(subject, cb=answer)
            await flush(responder)
            assert (await requester.request(subject, b"", timeout=5)).data == b"here"
    finally:
        for nc in (responder, requester):
            await nc.close()
