"""The gateway in-process against a real nats-server, driven by the official
openai client, while the test plays conductor, prefill and decode on NATS."""

import asyncio
import json
from collections.abc import Callable

import aiohttp
import openai
import pytest

from libs.common.nats_flush import flush
from libs.protocol import schema, subjects
from libs.protocol.schema import (
    Ack,
    AdmitReply,
    AdmitRequest,
    Cancel,
    ErrorInfo,
    ErrorReply,
    Heartbeat,
    PrefillRequest,
    TokenChunk,
)
from services.gateway.app import Gateway
from tests.unit.gateway.conftest import gateway_settings

EOS = 257  # the tiny checkpoint's </s>
MESSAGES = [{"role": "user", "content": "Say hello"}]
WAIT = 10.0  # seconds any single expected event may take


def ids(text: str) -> list[int]:
    return list(text.encode())  # the byte tokenizer: id = byte


def chunk(req: PrefillRequest, index: int, tokens: list[int], finish: str | None = None, **fields) -> TokenChunk:
    return TokenChunk(request_id=req.request_id, index=index, token_ids=tokens, finish_reason=finish, **fields)


def hello_world(req: PrefillRequest) -> list[TokenChunk]:
    """Prefill's token 0 and decode's tokens, published decode-first and out of order
    (for each of the request's n sequences)."""
    return [c for choice in range(req.sampling.n) for c in [
        chunk(req, 5, ids(" world"), instance_id="decode-b", choice=choice),
        chunk(req, 1, ids("ello"), instance_id="decode-b", choice=choice),
        chunk(req, 11, [EOS], "stop", instance_id="decode-b", choice=choice),
        chunk(req, 0, ids("H"), num_prompt_tokens=len(req.prompt_token_ids), num_cached_tokens=16,
              instance_id="prefill-a", choice=choice),
    ]]  # fmt: skip


class FakeCluster:
    """A conductor that admits to (prefill-a, decode-b) and workers that publish
    a scripted list of chunks; records what the gateway sends."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.admit_reply = AdmitReply(prefill_id="prefill-a", decode_id="decode-b")
        self.submit_ack = Ack()
        self.script: Callable[[PrefillRequest], list[TokenChunk]] = hello_world
        self.admits: asyncio.Queue[AdmitRequest] = asyncio.Queue()
        self.submits: asyncio.Queue[PrefillRequest] = asyncio.Queue()
        self.cancels: asyncio.Queue[Cancel] = asyncio.Queue()

    async def start(self, conductor: bool = True) -> None:
        async def on_admit(msg) -> None:
            self.admits.put_nowait(schema.decode(msg.data, AdmitRequest))
            await msg.respond(schema.encode(self.admit_reply))

        async def on_submit(msg) -> None:
            req = schema.decode(msg.data, PrefillRequest)
            self.submits.put_nowait(req)
            await msg.respond(schema.encode(self.submit_ack))
            if isinstance(self.submit_ack, Ack):
                for c in self.script(req):  # a chunk, or (the instance publishing it, the chunk)
                    publisher, c = c if isinstance(c, tuple) else (c.instance_id or "prefill-a", c)
                    await self.nc.publish(subjects.tokens(req.request_id, publisher), schema.encode(c))

        async def on_cancel(msg) -> None:
            self.cancels.put_nowait(schema.decode(msg.data, Cancel))

        if conductor:
            await self.nc.subscribe(subjects.CONDUCTOR_ADMIT, queue=subjects.CONDUCTOR_QUEUE, cb=on_admit)
        await self.nc.subscribe(subjects.prefill_submit("prefill-a"), cb=on_submit)
        await self.nc.subscribe(subjects.CANCEL, cb=on_cancel)
        await flush(self.nc)

    async def next_cancel(self) -> Cancel:
        return await asyncio.wait_for(self.cancels.get(), WAIT)


@pytest.fixture
async def start_gateway(nats_server, nc, tiny_checkpoint):
    """Start a Gateway.run() task; return its base URL once its heartbeat reports it."""
    running: list[tuple[Gateway, asyncio.Task]] = []

    async def start(**overrides) -> str:
        beats = await nc.subscribe(subjects.heartbeats("gateway"))
        settings = gateway_settings(nats_url=nats_server.url, model=str(tiny_checkpoint), **overrides)
        gateway = Gateway(settings)
        running.append((gateway, asyncio.create_task(gateway.run())))
        start.gateways.append(gateway)  # for a test to reach into
        while True:
            beat = schema.decode((await beats.next_msg(timeout=60)).data, Heartbeat)
            if beat.instance_id == settings.instance_id and beat.address:
                await beats.unsubscribe()
                assert beat.address == gateway.address and beat.address.startswith("http://127.0.0.1:")
                return beat.address

    start.gateways = []
    yield start
    for gateway, task in running:
        gateway.stopping.set()
        await asyncio.wait_for(task, 30)


@pytest.fixture
async def cluster(nc):
    fake = FakeCluster(nc)
    await fake.start()
    return fake


def openai_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=WAIT)


async def test_streams_a_chat_completion_reassembled_in_order(start_gateway, cluster, served_model):
    url = await start_gateway()
    client = openai_client(url)
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=MESSAGES, stream=True, stream_options={"include_usage": True}, seed=7
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.headers["x-kvserve-prefill-instance"] == "prefill-a"
    assert raw.headers["x-kvserve-decode-instance"] == "decode-b"
    chunks = [c async for c in raw.parse()]

    num_prompt = len(served_model.tokenizer.encode_chat(MESSAGES))
    admit, submit = cluster.admits.get_nowait(), cluster.submits.get_nowait()
    assert admit.request_id == submit.request_id == chunks[0].id and chunks[0].id.startswith("chatcmpl-")
    assert admit.num_prompt_tokens == num_prompt and admit.max_tokens == 256 - num_prompt
    assert submit.decode_id == "decode-b" and submit.sampling.seed == 7
    assert {c.id for c in chunks} == {admit.request_id}
    assert [c.object for c in chunks] == ["chat.completion.chunk"] * len(chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].delta.content for c in chunks[:-1]] == ["", "H", "ello", " world", ""]
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None, None, None, None, "stop"]
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (num_prompt, 12, num_prompt + 12)
    assert usage.prompt_tokens_details.cached_tokens == 16

    # The workers finished it, so no Cancel went out: the next Cancel is the next request's.
    cluster.script = lambda req: [chunk(req, 0, ids("H")), chunk(req, 1, ids("ello world, and on"))]  # no finish yet
    stopped = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, stop=["wor"])
    assert (stopped.choices[0].message.content, stopped.choices[0].finish_reason) == ("Hello ", "stop")
    assert stopped.usage.completion_tokens == 9  # up to the token that completed the stop string
    cancel = await cluster.next_cancel()
    assert (cancel.request_id, cancel.reason) == (stopped.id, "stop")


@pytest.mark.parametrize("token, text", [(EOS, ""), (ord("H"), "H")], ids=["no-text", "text"])
async def test_a_one_token_answer_always_has_a_content_chunk_matching_its_usage(start_gateway, cluster, token, text):
    """max_tokens 1 and ignore_eos: the prefill worker's first token ends the answer. An
    end-of-sequence token has no text (as in vLLM: counted, shown as "")."""
    cluster.script = lambda req: [chunk(req, 0, [token], "length", num_prompt_tokens=len(req.prompt_token_ids))]
    url = await start_gateway()
    client = openai_client(url)
    request = dict(model="tiny-llama", max_tokens=1, extra_body={"ignore_eos": True})
    chunks = [c async for c in await client.chat.completions.create(
        messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **request)]  # fmt: skip
    assert [(c.choices[0].delta.content, c.choices[0].finish_reason) for c in chunks[:-1]] == [
        ("", None), (text, "length")]  # fmt: skip
    assert chunks[-1].usage.completion_tokens == 1

    body = {"model": "tiny-llama", "prompt": "Say", "max_tokens": 1, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body) as response:
        events = (await response.read()).split(b"\n\n")
    last = json.loads(events[-3].removeprefix(b"data: "))
    assert (last["choices"][0]["text"], last["choices"][0]["finish_reason"]) == (text, "length")

    answer = await client.chat.completions.create(messages=MESSAGES, **request)
    assert (answer.choices[0].message.content, answer.usage.completion_tokens) == (text, 1)


async def test_a_text_completion_without_streaming(start_gateway, cluster):
    client = openai_client(await start_gateway())
    raw = await client.completions.with_raw_response.create(model="tiny-llama", prompt="Say", max_tokens=12)
    completion = raw.parse()
    assert raw.headers["x-request-id"] == completion.id and completion.id.startswith("cmpl-")
    assert completion.object == "text_completion"
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == ("Hello world", "stop")
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 12)
    assert cluster.submits.get_nowait().prompt_token_ids == ids("Say")


async def test_a_chunk_from_an_instance_the_request_is_not_placed_on_is_ignored(start_gateway, cluster):
    """Admitted to (prefill-a, decode-b): another decode worker's chunk, even one that
    names decode-b inside, never reaches the answer."""
    cluster.script = lambda req: [
        chunk(req, 1, ids("PWNED!"), "stop", instance_id="decode-x"),
        ("decode-x", chunk(req, 1, ids("PWNED!"), "stop", instance_id="decode-b")),  # its subject is its own
    ] + hello_world(req)
    client = openai_client(await start_gateway())
    answer = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES)
    assert (answer.choices[0].message.content, answer.usage.completion_tokens) == ("Hello world", 12)


async def test_tokens_come_from_the_decode_worker_the_prefill_worker_names(start_gateway, cluster):
    """The prefill worker leased on decode-b, then retried the hand-off on decode-c: from
    then on decode-c's tokens are the answer's and decode-b's are not."""
    cluster.script = lambda req: [
        chunk(req, 0, ids("H"), instance_id="prefill-a", decode_id="decode-b"),
        TokenChunk(request_id=req.request_id, index=1, instance_id="prefill-a", decode_id="decode-c"),
        chunk(req, 1, ids("PWNED!"), "stop", instance_id="decode-b"),
        chunk(req, 1, ids("ello world"), instance_id="decode-c"),
        chunk(req, 11, [EOS], "stop", instance_id="decode-c"),
    ]
    client = openai_client(await start_gateway())
    chunks = [c async for c in await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, stream=True)]
    assert [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content] == ["H", "ello world"]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_a_stream_cut_by_a_nats_outage_is_sent_again_by_its_decode_worker(start_gateway, cluster, nc):
    """After a reconnect the stream is silent where tokens were lost: the gateway asks the
    decode worker it is on to send them again from the first one missing, and does not move it."""
    resends: asyncio.Queue = asyncio.Queue()

    async def on_resend(msg) -> None:
        ask = schema.decode(msg.data, schema.ResendRequest)
        resends.put_nowait(ask)
        await msg.respond(schema.encode(Ack()))
        tokens = ids("Hello world")[ask.from_index:] + [EOS]
        again = TokenChunk(request_id=ask.request_id, index=ask.from_index, token_ids=tokens, finish_reason="stop",
                           instance_id="decode-b")  # fmt: skip
        await nc.publish(subjects.tokens(ask.request_id, "decode-b"), schema.encode(again))

    await nc.subscribe(subjects.decode_resend("decode-b"), cb=on_resend)
    url = await start_gateway()
    (gateway,) = start_gateway.gateways
    lost = asyncio.Event()

    def script(req):  # tokens 0-4, then the outage: everything after is lost
        gateway.reconnects += 1
        lost.set()
        return [chunk(req, 0, ids("H"), instance_id="prefill-a"), chunk(req, 1, ids("ello"), instance_id="decode-b")]

    cluster.script = script
    client = openai_client(url)
    answer = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES)
    assert lost.is_set()
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == ("Hello world", "stop")
    ask = resends.get_nowait()
    assert ask.from_index == 5  # "Hello" arrived: sent again from " world"
    assert cluster.admits.qsize() == 1  # not admitted again: no migration


async def test_a_client_that_disconnects_mid_stream_cancels_the_request(start_gateway, cluster):
    cluster.script = lambda req: [chunk(req, 0, ids("H"))]  # ... and the decode worker keeps going
    url = await start_gateway()
    client = openai_client(url)
    stream = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, stream=True)
    seen = []
    async for c in stream:
        seen.append(c.choices[0].delta.content)
        if seen == ["", "H"]:
            break
    async with aiohttp.ClientSession() as http, http.get(url + "/health") as health:
        assert (await health.json())["in_flight"] == 1
    await stream.close()
    cancel = await cluster.next_cancel()
    submit = cluster.submits.get_nowait()
    assert (cancel.request_id, cancel.reason) == (submit.request_id, "client disconnected")


async def test_the_event_stream_is_framed_exactly_as_openai_frames_it(start_gateway, cluster):
    url = await start_gateway()
    body = {"model": "tiny-llama", "prompt": "Say", "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body) as response:
        raw = await response.read()
    events = raw.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    payloads = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(e.startswith(b"data: {") for e in events[:-2])
    assert [p["choices"][0]["text"] for p in payloads[:-1]] == ["H", "ello", " world", ""]
    assert [p["choices"][0]["finish_reason"] for p in payloads[:-1]] == [None, None, None, "stop"]
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 12
    assert {p["object"] for p in payloads} == {"text_completion"}


async def test_without_a_conductor_the_answer_is_503_at_once(start_gateway, nc):
    fake = FakeCluster(nc)
    await fake.start(conductor=False)
    client = openai_client(await start_gateway())
    with pytest.raises(openai.InternalServerError) as e:
        await client.chat.completions.create(model="tiny-llama", messages=MESSAGES)
    assert e.value.status_code == 503
    assert e.value.body["code"] == "no_conductor"
    assert "no conductor is running" in e.value.body["message"]  # NATS "no responders", not a timeout


@pytest.mark.parametrize("error, status, exception", [
    (ErrorReply(code="no_decode", message="no decode instance is running"), 503, openai.InternalServerError),
    (ErrorReply(code="rejected", message="TTFT target cannot be met"), 429, openai.RateLimitError),
])  # fmt: skip
async def test_conductor_errors_map_to_statuses(start_gateway, cluster, error, status, exception):
    cluster.admit_reply = error
    client = openai_client(await start_gateway())
    with pytest.raises(exception) as e:
        await client.chat.completions.create(model="tiny-llama", messages=MESSAGES)
    assert e.value.status_code == status
    assert e.value.body["message"] == error.message
    assert cluster.submits.empty()


async def test_a_prefill_worker_without_capacity_is_503_and_cancelled(start_gateway, cluster):
    cluster.submit_ack = ErrorReply(code="no_capacity", message="queue full")
    client = openai_client(await start_gateway())
    with pytest.raises(openai.InternalServerError) as e:
        await client.chat.completions.create(model="tiny-llama", messages=MESSAGES)
    assert e.value.status_code == 503 and "queue full" in e.value.body["message"]
    assert (await cluster.next_cancel()).reason == "error"


async def test_a_worker_error_mid_stream_becomes_an_error_event(start_gateway, cluster):
    cluster.script = lambda req: [
        chunk(req, 0, ids("H")),
        chunk(req, 1, [], "abort", error=ErrorInfo(code="internal", message="decode instance died")),
    ]
    client = openai_client(await start_gateway())
    stream = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, stream=True)
    seen = []
    with pytest.raises(openai.APIError, match="decode instance died"):
        async for c in stream:
            seen.append(c.choices[0].delta.content)
    assert seen == ["", "H"]
    assert (await cluster.next_cancel()).reason == "error: internal"


async def test_no_token_within_the_request_timeout_is_504_and_cancelled(start_gateway, cluster):
    cluster.script = lambda req: []  # admitted and acknowledged, then silence
    client = openai_client(await start_gateway(request_timeout=0.3))
    with pytest.raises(openai.APIStatusError) as e:
        await client.chat.completions.create(model="tiny-llama", messages=MESSAGES)
    assert e.value.status_code == 504
    assert (await cluster.next_cancel()).reason == "timeout"


async def test_n_choices_stream_with_their_index_and_usage_counts_the_prompt_once(start_gateway, cluster,
                                                                                  served_model):  # fmt: skip
    client = openai_client(await start_gateway())
    words = {0: "Hello", 1: "Howdy", 2: "Hi"}
    cluster.script = lambda req: [  # the choices interleaved, one stopped by a stop string the workers know nothing of
        chunk(req, 0, ids(words[c][0]), choice=c, num_prompt_tokens=len(req.prompt_token_ids)) for c in words
    ] + [chunk(req, 1, ids(words[c][1:] + " there"), "length", choice=c) for c in words]  # fmt: skip
    stream = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, n=3, stop=["wdy"],
                                                  stream=True, stream_options={"include_usage": True})  # fmt: skip
    texts, finishes, roles = {}, {}, set()
    async for c in stream:
        for choice in c.choices:
            roles |= {choice.index} if choice.delta.role else set()
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        usage = c.usage or None
    assert (cluster.submits.get_nowait().sampling.n, roles) == (3, {0, 1, 2})
    assert texts == {0: "Hello there", 1: "Ho", 2: "Hi there"}
    assert finishes == {0: "length", 1: "stop", 2: "length"}
    num_prompt = len(served_model.tokenizer.encode_chat(MESSAGES))
    assert (usage.prompt_tokens, usage.completion_tokens) == (num_prompt, 11 + 5 + 8)  # "Howdy": up to the stop
