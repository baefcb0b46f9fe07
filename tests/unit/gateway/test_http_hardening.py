"""The gateway's HTTP edge under hostile or broken clients: inputs that once gave
500 get 400 naming the field, /metrics needs the key, readiness tells the truth,
and the listener closes slow, idle and surplus connections."""

import asyncio
import gzip
import json
import os
import zlib
from contextlib import asynccontextmanager

import pytest
from aiohttp.test_utils import TestClient, TestServer

from libs.protocol.schema import Heartbeat
from services.gateway import request_limits
from services.gateway.app import Gateway
from services.gateway.errors import BodyTooLargeError
from services.gateway.handlers import INLINE_DECODE_BYTES
from services.gateway.listener import ConnectionGuard, serve
from services.gateway.routes import GATEWAY, init_app
from tests.integration.conftest import wait_until_async
from tests.unit.gateway.conftest import gateway_settings

MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT = {"model": "tiny-llama", "messages": MESSAGES}
WAIT = 20.0  # seconds any single expected event may take


@pytest.fixture
async def client(served_model, request):
    gateway = Gateway(gateway_settings(**getattr(request, "param", {})), model=served_model)
    async with TestClient(TestServer(init_app(gateway, gateway.generations))) as client:
        yield client


async def error_of(response) -> tuple[int, str, str | None]:
    body = await response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return response.status, body["error"]["type"], body["error"]["param"]


def raw_json(body: dict) -> dict:
    return {"data": json.dumps(body), "headers": {"Content-Type": "application/json"}}


# --- inputs that were 500 --------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {**CHAT, "seed": 10**30}, "seed"),
    ("/v1/chat/completions", {**CHAT, "seed": -(2**63) - 1}, "seed"),
    ("/v1/chat/completions", {**CHAT, "top_k": 2**64}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [2**64]}, "stop_token_ids[0]"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "Hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": "Hi", "top_k": 2**64}, "top_k"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": [2**64]}, "prompt[0]"),
    ("/v1/chat/completions", {**CHAT, "temperature": 10**400}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**30}, "max_tokens"),
])  # fmt: skip
async def test_numbers_too_large_for_the_cluster_are_400_naming_the_field(client, path, body, param):
    assert await error_of(await client.post(path, **raw_json(body))) == (400, "invalid_request_error", param)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_json_nested_2000_deep_is_400(client, path):
    response = await client.post(path, data="[" * 2000 + "]" * 2000, headers={"Content-Type": "application/json"})
    assert await error_of(response) == (400, "invalid_request_error", None)
    assert "nests deeper than" in (await response.json())["error"]["message"]


@pytest.mark.parametrize("field, value", [
    ("tool_choice", "auto"), ("tools", "f"), ("response_format", "json"),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("best_of", 2), ("not_a_field", 1),
])  # fmt: skip
async def test_unsupported_fields_are_400_naming_the_field(client, field, value):
    response = await client.post("/v1/chat/completions", json={**CHAT, field: value})
    assert await error_of(response) == (400, "invalid_request_error", field)


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -2.01}, "frequency_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/chat/completions", {"min_tokens": 11, "max_tokens": 10}, "min_tokens"),
    ("/v1/chat/completions", {"logit_bias": {"5": 100.5}}, "logit_bias.5"),
    ("/v1/chat/completions", {"logit_bias": {"5": "up"}}, "logit_bias.5"),
    ("/v1/chat/completions", {"logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),  # outside the tiny vocabulary
    ("/v1/chat/completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": [5]}, "logit_bias"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),  # chat's is a switch
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),  # the completions API's is a count
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),  # a chat field
])  # fmt: skip
async def test_sampling_controls_out_of_range_are_400_naming_the_field(client, path, fields, param):
    body = {**(CHAT if path == "/v1/chat/completions" else {"model": "tiny-llama", "prompt": "Hi"}), **fields}
    assert await error_of(await client.post(path, json=body)) == (400, "invalid_request_error", param)


async def test_a_large_body_is_decoded_and_checked_too(client):
    body = {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}], "seed": 2**64}
    assert await error_of(await client.post("/v1/chat/completions", **raw_json(body))) == (
        400, "invalid_request_error", "seed"
    )  # fmt: skip


async def test_a_body_over_a_mebibyte_is_413_with_an_openai_body(client):
    response = await client.post("/v1/completions", data=b" " * (1024**2 + 1),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    assert await error_of(response) == (413, "invalid_request_error", None)


@pytest.mark.parametrize("field, value", [
    ("header_timeout", 0), ("body_timeout", -1.0), ("keepalive_timeout", float("inf")), ("max_connections", 0),
])  # fmt: skip
def test_listener_settings_are_validated(field, value):
    with pytest.raises(ValueError, match="must be"):
        gateway_settings(**{field: value})


# --- keys, probes, the API description -----------------------------------------------
@pytest.mark.parametrize("client", [{"api_key": "sekret"}], indirect=True)
async def test_metrics_need_the_api_key_and_probes_do_not(client):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = await client.get("/metrics", headers=headers)
        assert (response.status, (await response.json())["error"]["code"]) == (401, "invalid_api_key")
    response = await client.get("/metrics", headers={"Authorization": "Bearer sekret"})
    assert response.status == 200 and response.content_type == "text/plain"
    for path in ("/health/live", "/health/ready", "/health", "/openapi.json"):
        assert (await client.get(path)).status != 401, path


class FakeNATS:
    def __init__(self, is_connected: bool) -> None:
        self.is_connected = is_connected


def beat(role: str) -> Heartbeat:
    return Heartbeat(instance_id=f"{role}-1", role=role, host_id="test")


async def test_ready_only_with_nats_and_a_live_instance_of_every_role(client):
    gateway = client.server.app[GATEWAY]

    async def ready() -> tuple[int, list[str]]:
        answers = []
        for path in ("/health", "/health/ready"):
            response = await client.get(path)
            answers.append((response.status, (await response.json()).get("reasons", [])))
        assert answers[0] == answers[1]
        assert (await client.get("/health/live")).status == 200  # live all along
        return answers[0]

    assert await ready() == (503, ["not connected to NATS", "no live conductor instance", "no live prefill instance",
                                   "no live decode instance"])  # fmt: skip
    gateway.nc = FakeNATS(is_connected=True)
    for role in ("conductor", "prefill"):
        gateway.peers.observe(beat(role))
    assert await ready() == (503, ["no live decode instance"])
    gateway.peers.observe(beat("decode"))
    assert await ready() == (200, [])
    gateway.nc.is_connected = False
    assert await ready() == (503, ["not connected to NATS"])


async def test_openapi_describes_every_route(client):
    response = await client.get("/openapi.json")
    doc = await response.json()
    assert response.status == 200 and doc["openapi"].startswith("3.")
    routes = {(r.method, r.resource.canonical) for r in client.server.app.router.routes() if r.method != "HEAD"}
    described = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    assert described == routes
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["properties"]["seed"]["anyOf"][0] == {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
    assert chat["additionalProperties"] is False and chat["properties"]["functions"]["enum"] == [None, []]
    errors = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "404", "408", "429", "503", "504"} <= set(errors)
    assert errors["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}


# --- the listener: slow, idle and surplus connections ----------------------------------
@asynccontextmanager
async def listening(served_model, **limits):
    """A real listener behind the connection guard; yields (port, guard)."""
    settings = gateway_settings(**{"header_timeout": 60.0, "body_timeout": 60.0, "keepalive_timeout": 60.0, **limits})
    gateway = Gateway(settings, model=served_model)
    guard = ConnectionGuard(settings.header_timeout, settings.keepalive_timeout, settings.max_connections)
    runner = await serve(init_app(gateway, gateway.generations, guard), "127.0.0.1", 0, guard, shutdown_timeout=1.0)
    try:
        yield runner.addresses[0][1], guard
    finally:
        await runner.cleanup()


async def dribble_until_closed(writer: asyncio.StreamWriter, reader: asyncio.StreamReader, byte: bytes) -> bytes:
    """Send ``byte`` over and over, slowly, until the server closes; return what it sent."""
    received = b""
    deadline = asyncio.get_running_loop().time() + WAIT
    while asyncio.get_running_loop().time() < deadline:
        try:
            writer.write(byte)
            await writer.drain()
            data = await asyncio.wait_for(reader.read(1024), 0.1)  # the pace of the dribble
        except asyncio.TimeoutError:
            continue
        except ConnectionError:
            return received
        if not data:
            return received
        received += data
    raise AssertionError(f"the server kept the connection open for {WAIT}s")


async def test_a_slowloris_head_is_closed_by_the_header_timeout(served_model):
    async with listening(served_model, header_timeout=0.5) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        assert await dribble_until_closed(writer, reader, b"a") == b""  # EOF, no answer
        writer.close()


async def test_a_slowloris_head_after_a_good_request_is_closed_too(served_model):
    async with listening(served_model, header_timeout=0.5) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        assert head.startswith(b"HTTP/1.1 200")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
        await asyncio.wait_for(reader.readexactly(length), WAIT)
        writer.write(b"GET /health/live HTTP/1.1\r\nX-Slow: ")  # keep-alive: the next head, slowly
        assert await dribble_until_closed(writer, reader, b"a") == b""
        writer.close()


async def test_a_slow_body_is_408_and_the_connection_closed(served_model):
    async with listening(served_model, body_timeout=0.5) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{")  # fmt: skip
        received = await dribble_until_closed(writer, reader, b" ")
        assert received.startswith(b"HTTP/1.1 408")
        assert json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
        writer.close()


async def test_an_idle_keepalive_connection_is_closed(served_model):
    async with listening(served_model, keepalive_timeout=0.3) as (port, guard):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        response = await asyncio.wait_for(reader.read(), WAIT)  # read() returns at EOF only
        assert response.startswith(b"HTTP/1.1 200") and b"connection: close" not in response.lower()  # kept alive
        await wait_until_async(lambda: guard.num_open == 0, WAIT, "the idle connection is still counted")
        writer.close()


async def test_the_connection_cap_answers_503_and_frees_slots_as_connections_close(served_model):
    async with listening(served_model, max_connections=2) as (port, guard):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await wait_until_async(lambda: guard.num_open == 2, WAIT, "the first two connections were not accepted")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        refused = await asyncio.wait_for(reader.read(), WAIT)  # the whole answer, then EOF
        assert refused.startswith(b"HTTP/1.1 503")
        assert json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
        assert (guard.num_open, guard.num_refused) == (2, 1)
        writer.close()

        r0, w0 = held[0]
        w0.write(b"GET /health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(r0.read(), WAIT)).startswith(b"HTTP/1.1 200")  # held ones are served
        await wait_until_async(lambda: guard.num_open == 1, WAIT, "a closed connection still holds its slot")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), WAIT)).startswith(b"HTTP/1.1 200")
        for _, w in held + [(reader, writer)]:
            w.close()


# --- header bytes and Content-Encoding, through the real listener ----------------------
async def raw_post(port: int, body: bytes, headers: bytes = b"",
                   path: bytes = b"/v1/chat/completions") -> tuple[int, dict]:  # fmt: skip
    """POST ``body`` with ``headers`` (raw lines) byte for byte; the status and JSON body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n%s"
                 b"Content-Length: %d\r\n\r\n%s" % (path, headers, len(body), body))  # fmt: skip
    response = await asyncio.wait_for(reader.read(), WAIT)  # the whole answer, then EOF
    writer.close()
    head, _, payload = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def openai_error(status: int, body: dict) -> tuple[int, str, str | None]:
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return status, body["error"]["type"], body["error"]["param"]


BAD_SEED = json.dumps({**CHAT, "seed": 2**64}).encode()  # a body that is 400 naming "seed" once read


@pytest.mark.parametrize("header", [
    b"X-Session-Id: caf\xe9\r\n", b"x-kvserve-slo-ttft-ms: 1\xff\r\n", b"Authorization: Bearer \xff\xfe\r\n",
])  # fmt: skip
async def test_a_header_that_is_not_utf8_is_400(served_model, header):
    async with listening(served_model, api_key="sekret") as (port, _):
        key = b"" if header.startswith(b"Authorization") else b"Authorization: Bearer sekret\r\n"
        status, body = await raw_post(port, json.dumps(CHAT).encode(), key + header)
        assert openai_error(status, body) == (400, "invalid_request_error", None)
        assert "not valid UTF-8" in body["error"]["message"]


def gzip_members(data: bytes, copies: int) -> bytes:
    return gzip.compress(data) * copies  # gzip allows members one after another


@pytest.mark.parametrize("encoding, encode", [
    (b"gzip", gzip.compress),
    (b"deflate", zlib.compress),  # zlib's header, as HTTP's deflate says
    (b"deflate", lambda d: zlib.compress(d, wbits=-zlib.MAX_WBITS)),  # bare deflate, as some clients send
    (b"GZIP, identity", gzip.compress),
    (b"gzip, gzip", lambda d: gzip.compress(gzip.compress(d))),
    (b"gzip", lambda d: gzip_members(d[:10], 1) + gzip_members(d[10:], 1)),
])  # fmt: skip
async def test_a_compressed_body_is_decoded(served_model, encoding, encode):
    async with listening(served_model) as (port, _):
        status, body = await raw_post(port, encode(BAD_SEED), b"Content-Encoding: %s\r\n" % encoding)
        assert openai_error(status, body) == (400, "invalid_request_error", "seed")  # read as JSON: decoded


async def test_a_large_compressed_body_is_decoded_off_the_event_loop_and_checked(served_model):
    noise = os.urandom(150_000).hex()  # incompressible: the gzip body is larger than what is decoded inline
    body = gzip.compress(json.dumps({**CHAT, "messages": [{"role": "user", "content": noise}], "seed": 2**64}).encode())
    assert len(body) > INLINE_DECODE_BYTES
    async with listening(served_model) as (port, _):
        status, answer = await raw_post(port, body, b"Content-Encoding: gzip\r\n")
        assert openai_error(status, answer) == (400, "invalid_request_error", "seed")


@pytest.mark.parametrize("encoding, data", [
    (b"gzip", BAD_SEED), (b"deflate", BAD_SEED), (b"gzip", gzip.compress(BAD_SEED)[:-9]),
    (b"gzip", gzip.compress(BAD_SEED) + b"junk"), (b"deflate", b""),
], ids=["plain-as-gzip", "plain-as-deflate", "truncated", "trailing-junk", "empty"])  # fmt: skip
async def test_a_body_that_is_not_what_its_encoding_says_is_400(served_model, encoding, data):
    async with listening(served_model) as (port, _):
        status, body = await raw_post(port, data, b"Content-Encoding: %s\r\n" % encoding)
        assert openai_error(status, body) == (400, "invalid_request_error", None)
        assert f"not valid {encoding.decode()} data" in body["error"]["message"]


@pytest.mark.parametrize("encoding", [b"br", b"zstd", b"compress", b"gzip, br", b"x-gzip"])
async def test_another_encoding_is_415(served_model, encoding):
    async with listening(served_model) as (port, _):
        status, body = await raw_post(port, BAD_SEED, b"Content-Encoding: %s\r\n" % encoding)
        assert openai_error(status, body) == (415, "invalid_request_error", None)


@pytest.mark.parametrize("data", [
    gzip.compress(b" " * (256 * 1024**2)),  # 256 MiB of spaces in ~250 KiB
    gzip_members(b" " * 1024**2, 400),  # 400 MiB in 400 members
    gzip.compress(b" " * 1024**2 + b"{}"),  # one byte past the limit is enough
], ids=["one-member", "many-members", "just-past"])  # fmt: skip
async def test_the_body_limit_applies_to_the_decoded_body(served_model, data):
    async with listening(served_model) as (port, _):
        status, body = await raw_post(port, data, b"Content-Encoding: gzip\r\n")
        assert openai_error(status, body) == (413, "invalid_request_error", None)


def test_inflating_stops_just_past_the_limit(monkeypatch):
    inflated = []
    real = zlib.decompressobj

    class Counting:
        def __init__(self, *args):
            self.inflater = real(*args)

        def decompress(self, data, max_length):
            out = self.inflater.decompress(data, max_length)
            inflated.append(len(out))
            return out

        def __getattr__(self, name):
            return getattr(self.inflater, name)

    monkeypatch.setattr(request_limits.zlib, "decompressobj", Counting)
    with pytest.raises(BodyTooLargeError):
        request_limits.decode_content(gzip_members(b" " * 1024**2, 400), ["gzip"])
    assert sum(inflated) == request_limits.MAX_BODY_BYTES + 1
