"""The gateway in-process against a real nats-server while the test plays the
conductor and the workers, heartbeats included: a worker that falls silent under
a request moves it (within a few heartbeats, not the token timeout), the client
sees one stream, and a stream that cannot go on still ends with [DONE], a gateway
that stops included."""

import asyncio
import json
from collections.abc import Callable

import aiohttp
import pytest

from libs.common.nats_flush import flush
from libs.protocol import schema, subjects
from libs.protocol.schema import Ack, AdmitReply, AdmitRequest, Cancel, Heartbeat, PrefillRequest, TokenChunk
from services.gateway.app import Gateway
from tests.integration.conftest import repeat_until, wait_until_async
from tests.unit.gateway.conftest import gateway_settings

EOS = 257  # the tiny checkpoint's </s>
MESSAGES = [{"role": "user", "content": "Say hello"}]
WAIT = 20.0  # seconds any single expected event may take
BEAT = 0.05  # seconds between the fake workers' heartbeats; the gateway counts 2.5 of its own 0.4 s as gone


def ids(text: str) -> list[int]:
    return list(text.encode())  # the byte tokenizer: id = byte


def chunk(req: PrefillRequest, index: int, text: str, instance: str, finish: str | None = None,
          extra: list[int] = ()) -> TokenChunk:  # fmt: skip
    return TokenChunk(request_id=req.request_id, index=index, token_ids=ids(text) + list(extra), finish_reason=finish,
                      instance_id=instance, num_cached_tokens=16 if index == 0 else 0)  # fmt: skip


class FakeCluster:
    """A conductor that admits to the next scripted route, prefill workers that run
    the next scripted attempt, and heartbeats for every instance not killed."""

    def __init__(self, nc, routes: list[tuple[str, str]], attempts: list[Callable], prefills=("p0", "p1"),
                 decodes=("d0", "d1", "d2")) -> None:  # fmt: skip
        self.nc = nc
        self.routes, self.attempts = list(routes), list(attempts)
        self.alive = {**{p: "prefill" for p in prefills}, **{d: "decode" for d in decodes}}
        self.admits: list[AdmitRequest] = []
        self.submits: list[PrefillRequest] = []
        self.cancels: asyncio.Queue[Cancel] = asyncio.Queue()
        self.gateway: Gateway | None = None  # the gateway `start` ran against it
        self._beats: asyncio.Task | None = None

    def kill(self, instance_id: str) -> None:
        """It sends no heartbeat any more (its subscriptions stay: a hung process)."""
        self.alive.pop(instance_id, None)

    async def start(self) -> None:
        async def on_admit(msg) -> None:
            self.admits.append(schema.decode(msg.data, AdmitRequest))
            prefill_id, decode_id = self.routes.pop(0)
            await msg.respond(schema.encode(AdmitReply(prefill_id=prefill_id, decode_id=decode_id)))

        async def on_submit(msg) -> None:
            req = schema.decode(msg.data, PrefillRequest)
            self.submits.append(req)
            await msg.respond(schema.encode(Ack()))
            for c in self.attempts.pop(0)(req, self):
                await self.nc.publish(subjects.tokens(req.request_id, c.instance_id), schema.encode(c))

        async def on_cancel(msg) -> None:
            self.cancels.put_nowait(schema.decode(msg.data, Cancel))

        await self.nc.subscribe(subjects.CONDUCTOR_ADMIT, queue=subjects.CONDUCTOR_QUEUE, cb=on_admit)
        for p in [i for i, role in self.alive.items() if role == "prefill"]:
            await self.nc.subscribe(subjects.prefill_submit(p), cb=on_submit)
        await self.nc.subscribe(subjects.CANCEL, cb=on_cancel)
        await flush(self.nc)
        self._stopped = asyncio.Event()
        self._beats = asyncio.create_task(repeat_until(self._stopped, BEAT, self._heartbeats))

    async def _heartbeats(self) -> None:
        """One beat of every fake worker still alive, as a real worker's heartbeat loop sends."""
        for instance_id, role in list(self.alive.items()):
            beat = Heartbeat(instance_id=instance_id, role=role, host_id="test", started_at=1.0)
            await self.nc.publish(subjects.heartbeat(role, instance_id), schema.encode(beat))

    async def stop(self) -> None:
        self._stopped.set()
        await self._beats

    async def next_cancel(self) -> Cancel:
        return await asyncio.wait_for(self.cancels.get(), WAIT)


@pytest.fixture
async def start(nats_server, nc, tiny_checkpoint):
    """Start the fake cluster and a gateway that has heard every fake worker; return the gateway's URL."""
    running: list[tuple[Gateway, asyncio.Task, FakeCluster]] = []

    async def start_(cluster: FakeCluster, **overrides) -> str:
        await cluster.start()
        settings = gateway_settings(nats_url=nats_server.url, model=str(tiny_checkpoint), heartbeat_interval=0.4,
                                    **overrides)  # fmt: skip
        gateway = cluster.gateway = Gateway(settings)
        running.append((gateway, asyncio.create_task(gateway.run()), cluster))
        heard = lambda: gateway.address and all(gateway.peers.last_heard(i) for i in cluster.alive)  # noqa: E731
        await wait_until_async(heard, WAIT, "the gateway did not come up and hear the workers")
        return gateway.address

    yield start_
    for gateway, task, cluster in running:
        await cluster.stop()
        gateway.stopping.set()
        await asyncio.wait_for(task, 30)


async def post(url: str, body: dict) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(WAIT)) as r:
            return r.status, await r.read()


def events(raw: bytes) -> list:
    """The SSE events of a raw stream body: decoded JSON, or the string "[DONE]"."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    out = []
    for event in raw.decode().split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        data = event[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def streamed_text(evs: list) -> str:
    chunks = [e for e in evs if isinstance(e, dict) and e.get("choices")]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)


def request(stream: bool = True, max_tokens: int = 20) -> dict:
    body = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    return body | ({"stream_options": {"include_usage": True}} if stream else {})


def decode_dies_after_hel(req: PrefillRequest, cluster: FakeCluster) -> list[TokenChunk]:
    cluster.kill("d0")
    return [chunk(req, 0, "H", "p0"), chunk(req, 1, "el", "d0")]


def resumes_with_lo_world(req: PrefillRequest, cluster: FakeCluster) -> list[TokenChunk]:
    return [chunk(req, 0, "l", "p0"), chunk(req, 1, "o world", "d1"), chunk(req, 8, "", "d1", "stop", [EOS])]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_decode_worker_that_dies_mid_stream_moves_the_request_and_no_token_is_lost(start, nc, stream):
    cluster = FakeCluster(nc, [("p0", "d0"), ("p0", "d1")], [decode_dies_after_hel, resumes_with_lo_world])
    url = await start(cluster)  # the token timeout stays 120 s: only the heartbeats can wake the request up
    status, raw = await post(url, request(stream))
    assert status == 200
    first, again = cluster.submits
    assert again.request_id == first.request_id + "-m1"
    assert again.prompt_token_ids == first.prompt_token_ids + ids("Hel")
    assert again.sampling.max_tokens == 20 - 3 and again.sampling.temperature == 0.0
    assert [a.exclude for a in cluster.admits] == [[], ["d0"]]
    assert cluster.admits[1].num_prompt_tokens == len(first.prompt_token_ids) + 3
    cancel = await cluster.next_cancel()
    assert cancel.request_id == first.request_id and "d0 is gone" in cancel.reason
    served = {"prefill_instances": ["p0"], "decode_instances": ["d0", "d1"], "migrations": 1}
    prompt_tokens = len(first.prompt_token_ids)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 3 + 9, "total_tokens": prompt_tokens + 12,
             "prompt_tokens_details": {"cached_tokens": 16}}  # fmt: skip
    if not stream:
        body = json.loads(raw)
        assert body["choices"][0]["message"]["content"] == "Hello world"
        assert (body["kvserve"], body["usage"]) == (served, usage)
        return
    evs = events(raw)
    assert streamed_text(evs) == "Hello world"
    finish, usage_chunk, done = evs[-3:]
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["kvserve"] == served
    assert usage_chunk["usage"] == usage and done == "[DONE]"


async def test_a_prefill_worker_that_dies_before_its_first_token_gets_the_request_admitted_again(start, nc):
    def prefill_dies(req, cluster):
        cluster.kill("p0")
        return []

    def hello(req, cluster):
        return [chunk(req, 0, "H", "p1"), chunk(req, 1, "i", "d0", "length")]

    cluster = FakeCluster(nc, [("p0", "d0"), ("p1", "d0")], [prefill_dies, hello])
    status, raw = await post(await start(cluster), request(max_tokens=2))
    evs = events(raw)
    assert status == 200 and streamed_text(evs) == "Hi"
    first, again = cluster.submits
    assert (again.request_id, again.prompt_token_ids, again.sampling) == (
        first.request_id + "-m1", first.prompt_token_ids, first.sampling)  # fmt: skip
    assert cluster.admits[1].exclude == ["p0"]
    assert evs[-3]["kvserve"] == {"prefill_instances": ["p0", "p1"], "decode_instances": ["d0"], "migrations": 1}


async def test_when_attempts_run_out_the_stream_ends_with_an_error_event_an_error_finish_and_done(start, nc):
    def decode_dies(name: str, text: str):
        def attempt(req, cluster):
            cluster.kill(name)
            return [chunk(req, 0, text, "p0")]

        return attempt

    cluster = FakeCluster(nc, [("p0", "d0"), ("p0", "d1")], [decode_dies("d0", "H"), decode_dies("d1", "i")])
    status, raw = await post(await start(cluster, max_attempts=2), request())
    evs = events(raw)
    assert status == 200 and streamed_text(evs) == "Hi"
    error, finish, usage, done = evs[-4:]
    assert error["error"]["code"] == "worker_lost" and error["error"]["type"] == "server_error"
    assert "decode instance d1 is gone" in error["error"]["message"] and "after 2 attempts" in error["error"]["message"]
    assert finish["choices"][0]["finish_reason"] == "error"
    assert finish["kvserve"] == {"prefill_instances": ["p0"], "decode_instances": ["d0", "d1"], "migrations": 1}
    assert usage["usage"]["completion_tokens"] == 2 and done == "[DONE]"
    reasons = {(await cluster.next_cancel()).request_id for _ in range(2)}
    assert reasons == {cluster.submits[0].request_id, cluster.submits[1].request_id}


async def test_a_token_timeout_mid_stream_releases_held_back_text_and_still_ends_with_done(start, nc):
    def stalls(req, cluster):
        return [chunk(req, 0, "abcx", "p0")]  # then nothing, from workers that stay alive

    cluster = FakeCluster(nc, [("p0", "d0")], [stalls])
    status, raw = await post(await start(cluster, request_timeout=0.5), request() | {"stop": ["xyz"]})
    evs = events(raw)
    assert status == 200 and streamed_text(evs) == "abcx"  # "cx" was held back for the stop string
    error, finish = evs[-4:-2]
    assert error["error"]["code"] == "timeout" and finish["choices"][0]["finish_reason"] == "error"


def stalls_after_h(req: PrefillRequest, cluster: FakeCluster) -> list[TokenChunk]:
    return [chunk(req, 0, "H", "p0")]  # then nothing, from workers that stay alive


async def started_stream(cluster: FakeCluster, url: str, body: dict) -> asyncio.Task:
    """``body`` posted in the background, once the gateway runs it on the fake workers."""
    posted = asyncio.create_task(post(url, body))
    await wait_until_async(lambda: cluster.submits and cluster.gateway.num_in_flight == 1, WAIT, "no request ran")
    return posted


async def test_a_stopping_gateway_refuses_new_requests_and_lets_those_in_flight_finish(start, nc):
    cluster = FakeCluster(nc, [("p0", "d0")], [stalls_after_h])
    url = await start(cluster)  # the drain waits up to its default 10 s
    posted = await started_stream(cluster, url, request(max_tokens=2))
    cluster.gateway.stopping.set()  # as SIGTERM does
    await wait_until_async(lambda: cluster.gateway.generations.draining, WAIT, "the gateway did not start draining")
    status, raw = await post(url, request())
    assert status == 503 and json.loads(raw)["error"]["code"] == "shutting_down"
    assert len(cluster.submits) == 1  # the refused one never reached the cluster
    req = cluster.submits[0]
    await nc.publish(subjects.tokens(req.request_id, "d0"), schema.encode(chunk(req, 1, "i", "d0", "length")))
    status, raw = await posted
    evs = events(raw)
    assert status == 200 and streamed_text(evs) == "Hi"
    assert evs[-3]["choices"][0]["finish_reason"] == "length" and evs[-1] == "[DONE]"


@pytest.mark.parametrize("stream", [True, False])
async def test_a_request_still_running_when_the_drain_runs_out_ends_with_a_shutting_down_error(start, nc, stream):
    cluster = FakeCluster(nc, [("p0", "d0")], [stalls_after_h])
    url = await start(cluster, drain_timeout=0.2)  # the token timeout stays 120 s
    posted = await started_stream(cluster, url, request(stream))
    cluster.gateway.stopping.set()
    status, raw = await posted
    cancel = await cluster.next_cancel()  # the workers are told to drop it
    assert cancel.request_id == cluster.submits[0].request_id
    if not stream:
        assert status == 503 and json.loads(raw)["error"]["code"] == "shutting_down"
        return
    evs = events(raw)
    assert status == 200 and streamed_text(evs) == "H"
    error, finish, usage, done = evs[-4:]
    assert error["error"]["code"] == "shutting_down" and error["error"]["type"] == "server_error"
    assert finish["choices"][0]["finish_reason"] == "error"
    assert usage["usage"]["completion_tokens"] == 1 and done == "[DONE]"
