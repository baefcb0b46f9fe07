"""A control request that gets no valid answer becomes the gateway's domain error:
the conductor's silence is a 503 no_conductor, a worker's absence or silence a
WorkerLostError (so the request can move), NATS failing otherwise a 503, and a
reply that is no valid message an upstream error. Whom nobody heard is not cancelled."""

import types

import nats.errors
import pytest

from libs.protocol import subjects
from libs.protocol.sampling_params import SamplingParams
from libs.protocol.schema import Ack, AdmitReply, BadMessageError, Cancel, ErrorReply
from services.gateway.dispatch import RequestRun
from services.gateway.errors import ServiceUnavailableError, UpstreamError
from services.gateway.served_model import PreparedRequest
from services.gateway.upstream_errors import WorkerLostError

PREPARED = PreparedRequest("req", [1, 2, 3], SamplingParams(max_tokens=4), [])


class FakeSubscription:
    async def unsubscribe(self) -> None:
        pass


class FakeNATS:
    async def subscribe(self, subject: str) -> FakeSubscription:
        return FakeSubscription()


class FakeService:
    """The conductor admits to p0 and d0 unless ``admit_error``; the worker fails with ``submit_error``."""

    def __init__(self, admit_error: Exception | ErrorReply | None = None,
                 submit_error: Exception | ErrorReply | None = None, on_decode: bool = False) -> None:  # fmt: skip
        self.nc = FakeNATS()
        self.admit_error, self.submit_error = admit_error, submit_error
        self.on_decode = on_decode  # the conductor has d0 prefill the request itself
        self.published: list[object] = []

    async def request(self, subject: str, message: object, kind: type, timeout: float = 5.0) -> object:
        error = self.admit_error if kind is AdmitReply else self.submit_error
        if isinstance(error, ErrorReply):
            return error
        if error is not None:
            raise error
        if kind is not AdmitReply:
            return Ack()
        if self.on_decode:
            return AdmitReply(prefill_id="d0", decode_id="d0", prefill_on_decode=True)
        return AdmitReply(prefill_id="p0", decode_id="d0")

    async def publish(self, subject: str, message: object) -> None:
        self.published.append(message)


async def enter(service: FakeService) -> None:
    async with RequestRun(service, PREPARED, token_timeout=1.0, control_timeout=2.5):
        pass


@pytest.mark.parametrize("error, kind, code, message", [
    (nats.errors.NoRespondersError(), ServiceUnavailableError, "no_conductor",
     "conductor unavailable: no conductor is running"),
    (nats.errors.TimeoutError(), ServiceUnavailableError, "no_conductor",
     "conductor unavailable: no answer within 2.5s"),
    (nats.errors.ConnectionClosedError(), ServiceUnavailableError, "no_conductor",
     "conductor unavailable: nats: connection closed"),
    (BadMessageError("not an AdmitReply"), UpstreamError, "internal_error",
     "the conductor failed to admit the request: not an AdmitReply"),
    (ErrorReply(code="internal", message="KeyError: 'p0'"), UpstreamError, "internal_error",
     "the conductor failed to admit the request: KeyError: 'p0'"),
])  # fmt: skip
async def test_a_conductor_that_gives_no_valid_answer(error, kind, code, message):
    service = FakeService(admit_error=error)
    with pytest.raises(kind) as raised:
        await enter(service)
    assert type(raised.value) is kind and (raised.value.code, str(raised.value)) == (code, message)
    no_one_heard = isinstance(error, nats.errors.NoRespondersError)
    assert [c.reason for c in service.published if isinstance(c, Cancel)] == ([] if no_one_heard else ["error"])


@pytest.mark.parametrize("error, kind, code, message", [
    (nats.errors.NoRespondersError(), WorkerLostError, "worker_lost", "prefill instance p0 is unavailable"),
    (nats.errors.TimeoutError(), WorkerLostError, "worker_lost", "prefill instance p0 did not answer within 2.5s"),
    (nats.errors.ConnectionClosedError(), ServiceUnavailableError, "no_prefill",
     "prefill instance p0 is unreachable: nats: connection closed"),
    (BadMessageError("not an Ack"), UpstreamError, "internal_error", "prefill instance p0 failed: not an Ack"),
])  # fmt: skip
async def test_a_worker_that_gives_no_valid_answer(error, kind, code, message):
    service = FakeService(submit_error=error)
    with pytest.raises(kind) as raised:
        await enter(service)
    assert type(raised.value) is kind and (raised.value.code, str(raised.value)) == (code, message)
    if kind is WorkerLostError:
        assert (raised.value.instance_id, raised.value.role) == ("p0", "prefill")
    assert [c.reason for c in service.published if isinstance(c, Cancel)] == ["error"]


async def test_an_unreachable_decode_worker_prefilling_the_request_is_no_decode():
    service = FakeService(submit_error=nats.errors.ConnectionClosedError(), on_decode=True)
    with pytest.raises(ServiceUnavailableError) as raised:
        await enter(service)
    message = "decode instance d0 is unreachable: nats: connection closed"
    assert (raised.value.code, str(raised.value)) == ("no_decode", message)


async def resolved(value):
    """An awaitable that gives ``value`` (what nc.subscribe's coroutine gives)."""
    return value


class OneMessage(FakeSubscription):
    def __init__(self, data: bytes, publisher: str = "p0") -> None:
        self.data = data
        self.publisher = publisher

    async def next_msg(self, timeout: float) -> object:
        return types.SimpleNamespace(data=self.data, subject=subjects.tokens("req", self.publisher))


@pytest.mark.parametrize("code", ["decode_unavailable", "no_decode", "no_lease", "peer_gone"])
async def test_a_hand_off_that_found_no_decode_worker_names_the_chosen_one_as_suspect_only(code):
    # the prefill worker's lease or hand-over to d0 went unanswered: d0 is passed over by the
    # next attempt until heard from again (or restarted), as the process seen then
    from libs.common.peers import PeerDirectory
    from libs.engine.token_chunks import error_chunk
    from libs.protocol import schema
    from libs.protocol.schema import Heartbeat
    from libs.protocol.vocabulary import ErrorCode
    from services.gateway.worker_watch import WorkerWatch

    peers = PeerDirectory()
    for instance_id, role in (("p0", "prefill"), ("d0", "decode")):
        peers.observe(Heartbeat(instance_id=instance_id, role=role, host_id="h", started_at=5.0))
    service = FakeService()
    lost = error_chunk("req", 0, ErrorCode(code), "decode worker d0 did not answer", "p0")
    service.nc.subscribe = lambda subject: resolved(OneMessage(schema.encode(lost)))
    with pytest.raises(WorkerLostError) as e:
        async with RequestRun(service, PREPARED, token_timeout=1.0, watch=WorkerWatch(peers, 2.5)) as run:
            await run.next_chunks()
    assert (e.value.instance_id, e.value.role, e.value.started_at, e.value.until_heard) == ("d0", "decode", 5.0, True)


class NoMessage(FakeSubscription):
    async def next_msg(self, timeout: float) -> object:
        raise nats.errors.TimeoutError


@pytest.mark.parametrize("restarted", [False, True])
async def test_a_silent_worker_is_suspect_only_and_a_restarted_one_gone_until_its_restart(restarted):
    # silence may be a stalled process (a CPU-starved machine, a NATS hiccup): the next attempt
    # passes it over only until it is heard from again; a restart is a death
    from libs.common.peers import PeerDirectory
    from libs.protocol.schema import Heartbeat
    from services.gateway.worker_watch import WorkerWatch

    now = [100.0]
    peers = PeerDirectory(clock=lambda: now[0])
    for instance_id, role in (("p0", "prefill"), ("d0", "decode")):
        peers.observe(Heartbeat(instance_id=instance_id, role=role, host_id="h", started_at=5.0))
    service = FakeService()
    service.nc.subscribe = lambda subject: resolved(NoMessage())
    with pytest.raises(WorkerLostError) as e:
        async with RequestRun(service, PREPARED, token_timeout=30.0, watch=WorkerWatch(peers, 2.5)) as run:
            if restarted:
                peers.observe(Heartbeat(instance_id="d0", role="decode", host_id="h", started_at=9.0))
            else:
                now[0] += 3.0  # silent for longer than 2.5 s
            await run.next_chunks()
    assert (e.value.instance_id, e.value.started_at, e.value.until_heard) == ("d0", 5.0, not restarted)
