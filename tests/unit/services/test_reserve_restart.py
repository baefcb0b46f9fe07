"""A lease (or a hand-over) asked of a decode worker that dies before answering (the
message went to a process being killed) fails as soon as the worker's heartbeats say it
is gone, not at its timeout (15 s, 5 s); when it was restarted, the new process is the
one asked. Over a real nats-server, with a stand-in decode worker."""

import asyncio
from types import SimpleNamespace

import nats
import pytest

from libs.common.nats_flush import flush
from libs.common.nats_server import NatsServer
from libs.common.peers import PeerDirectory
from libs.common.service import Service
from libs.protocol import schema, subjects
from libs.protocol.sampling_params import SamplingParams
from libs.protocol.schema import ErrorReply, Heartbeat, KVContract, PrefillRequest, ReserveRequest
from libs.protocol.vocabulary import ErrorCode
from services.prefill import handoff as handoff_module
from services.prefill.handoff import Handoff, HandoffError

CONTRACT = KVContract(model_id="m", block_size=16, layout="l", hash_scheme="h")
REQUEST = PrefillRequest(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4),
                         decode_id="decode-0")  # fmt: skip
WAIT = 4.5  # a bound on every wait below, shorter than the lease's and the hand-over's own timeouts


@pytest.fixture(scope="module")
def nats_server():
    with NatsServer() as server:
        yield server


class Prefill:
    """What Handoff needs of its service: request/reply over NATS."""

    instance_id = "prefill-0"

    def __init__(self, nc) -> None:
        self.nc = nc

    request = Service.request


def beat(started_at: float) -> Heartbeat:
    return Heartbeat(instance_id="decode-0", role="decode", host_id="h", started_at=started_at)


def make_handoff(nc, decoders: PeerDirectory) -> Handoff:
    host = SimpleNamespace(engine=SimpleNamespace(pool=SimpleNamespace(layout=SimpleNamespace(block_nbytes=1,
                           layer_nbytes=1))), contract=CONTRACT, transfers=SimpleNamespace(writer_host_id="h"))  # fmt: skip
    return Handoff(Prefill(nc), host, decoders, heartbeat_interval=1.0)


async def test_a_lease_lost_in_a_dying_worker_is_asked_again_of_its_restart(nats_server, monkeypatch):
    monkeypatch.setattr(handoff_module, "LIVENESS_CHECK_S", 0.01)
    prefill_nc, old_nc, new_nc = [await nats.connect(nats_server.url) for _ in range(3)]
    try:
        decoders = PeerDirectory()
        decoders.observe(beat(started_at=1.0))
        swallowed = asyncio.Event()

        async def dying(msg):  # takes the reserve and never answers: the process is being killed
            swallowed.set()

        async def restarted(msg):
            request = schema.decode(msg.data, ReserveRequest)
            await msg.respond(schema.encode(ErrorReply(code=ErrorCode.NO_CAPACITY, message=f"new process: {request.request_id}")))

        await old_nc.subscribe(subjects.decode_reserve("decode-0"), cb=dying)
        await flush(old_nc)
        handoff = make_handoff(prefill_nc, decoders)
        asking = asyncio.create_task(handoff.reserve(REQUEST, "decode-0", 3))
        await asyncio.wait_for(swallowed.wait(), WAIT)
        await old_nc.close()  # the process is gone; its restart subscribes, then beats
        await new_nc.subscribe(subjects.decode_reserve("decode-0"), cb=restarted)
        await flush(new_nc)
        decoders.observe(beat(started_at=2.0))
        with pytest.raises(HandoffError) as lost:
            await asyncio.wait_for(asking, WAIT)
        assert lost.value.restarted and lost.value.code == ErrorCode.DECODE_UNAVAILABLE
        # the restarted process answers the lease asked again
        with pytest.raises(HandoffError, match="new process: r1") as answered:
            await asyncio.wait_for(handoff.reserve(REQUEST, "decode-0", 3), WAIT)
        assert answered.value.code == ErrorCode.NO_CAPACITY
    finally:
        for nc in (prefill_nc, new_nc):
            await nc.close()


def ask(handoff: Handoff, what: str):
    """A lease, or the hand-over of a request whose KV is written into one."""
    if what == "reserve":
        return handoff.reserve(REQUEST, "decode-0", 3)
    transfer = SimpleNamespace(request=REQUEST, decode_id="decode-0", lease=SimpleNamespace(block_ids=[7]))
    seq = SimpleNamespace(token_ids=[1, 2, 3, 9], num_prompt_tokens=3, num_cached_tokens=0, num_prior_output_tokens=0)
    return handoff._hand_over(transfer, seq, [])


@pytest.mark.parametrize("what", ["reserve", "hand_over"])
async def test_a_request_to_a_worker_that_goes_silent_fails_without_waiting_for_the_timeout(nats_server, what):
    prefill_nc, decode_nc = [await nats.connect(nats_server.url) for _ in range(2)]
    try:
        now = [100.0]
        decoders = PeerDirectory(clock=lambda: now[0])
        decoders.observe(beat(started_at=1.0))
        swallowed = asyncio.Event()

        async def dying(msg):
            swallowed.set()

        subject = subjects.decode_reserve("decode-0") if what == "reserve" else subjects.decode_admit("decode-0")
        await decode_nc.subscribe(subject, cb=dying)
        await flush(decode_nc)
        asking = asyncio.create_task(ask(make_handoff(prefill_nc, decoders), what))
        await asyncio.wait_for(swallowed.wait(), WAIT)
        now[0] += 2.5  # two and a half heartbeats without one
        with pytest.raises(HandoffError, match="decode worker decode-0 is gone") as lost:
            await asyncio.wait_for(asking, WAIT)
        assert not lost.value.restarted
    finally:
        for nc in (prefill_nc, decode_nc):
            await nc.close()


def test_a_transfer_knows_when_another_process_runs_under_its_decode_workers_id():
    """What lets a hand-off whose KV found the leased process gone (peer_gone) be leased
    again on the same worker id: the process the heartbeats now name is not the one that leased."""
    from services.prefill.handoff import Transfer

    decoders = PeerDirectory()
    decoders.observe(Heartbeat(instance_id="decode-0", role="decode", host_id="h", started_at=5.0))
    transfer = Transfer(REQUEST, "decode-0", lease=None, started_at=5.0)
    assert not transfer.restarted(decoders)
    decoders.observe(Heartbeat(instance_id="decode-0", role="decode", host_id="h", started_at=9.0))
    assert transfer.restarted(decoders)
    assert not Transfer(REQUEST, "decode-1", lease=None, started_at=5.0).restarted(decoders)  # never heard
    assert not Transfer(REQUEST, "decode-0", lease=None).restarted(decoders)  # leased before it was heard
