"""The HTTP edge without a cluster: every bad request gets its exact status and
OpenAI error body before anything reaches NATS; auth, models and health."""

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import Gateway
from services.gateway.errors import (
    RateLimitedError,
    RequestTimeoutError,
    ServiceUnavailableError,
    UpstreamError,
    to_http,
)
from services.gateway.routes import init_app
from tests.unit.gateway.conftest import gateway_settings

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture
async def client(served_model, request):
    gateway = Gateway(gateway_settings(**getattr(request, "param", {})), model=served_model)
    async with TestClient(TestServer(init_app(gateway, gateway.generations))) as client:
        yield client


async def error_of(response) -> tuple[int, str, str | None, str | None]:
    body = await response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return response.status, body["error"]["type"], body["error"]["param"], body["error"]["code"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": "tiny-llama"}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES}, "model"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": MESSAGES, "n": 129}, "n"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": MESSAGES, "temperature": "x"}, "temperature"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": MESSAGES, "temperature": 500}, "temperature"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "x" * 300}]},
     "messages"),
    ("/v1/chat/completions", {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 500}, "max_tokens"),
    ("/v1/completions", {"model": "tiny-llama"}, "prompt"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "tiny-llama", "prompt": [5, 1000]}, "prompt"),
])  # fmt: skip
async def test_bad_requests_are_400_naming_the_field(client, path, body, param):
    assert await error_of(await client.post(path, json=body)) == (400, "invalid_request_error", param, None)


@pytest.mark.parametrize("data", [b"{", b"", b"\xff", b"[1, 2]", b'"text"', b"null"])
async def test_a_body_that_is_not_a_json_object_is_400(client, data):
    response = await client.post("/v1/chat/completions", data=data, headers={"Content-Type": "application/json"})
    assert await error_of(response) == (400, "invalid_request_error", None, None)


async def test_an_unknown_model_is_404_model_not_found(client):
    response = await client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MESSAGES})
    status, type_, param, code = await error_of(response)
    assert (status, type_, code) == (404, "invalid_request_error", "model_not_found")
    assert (await client.get("/v1/models/gpt-9")).status == 404


async def test_models_lists_the_one_served_model(client):
    body = await (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"], m["max_model_len"]) for m in body["data"]] == [
        ("tiny-llama", "model", "kvserve", 256)
    ]
    assert (await (await client.get("/v1/models/tiny-llama")).json())["id"] == "tiny-llama"


async def test_health_live(client):
    response = await client.get("/health/live")
    body = await response.json()
    assert response.status == 200
    assert (body["status"], body["instance_id"], body["model"]) == ("ok", "gateway-test", "tiny-llama")
    assert body["in_flight"] == 0


async def test_unknown_routes_and_methods_get_openai_error_bodies(client):
    assert await error_of(await client.post("/v1/nope", json={})) == (404, "invalid_request_error", None, None)
    assert await error_of(await client.get("/v1/chat/completions")) == (405, "invalid_request_error", None, None)


@pytest.mark.parametrize("client", [{"api_key": "sekret"}], indirect=True)
async def test_the_api_key_guards_every_v1_route(client):
    for auth in (None, "Bearer wrong", "Basic sekret", "Bearer", "sekret"):
        headers = {"Authorization": auth} if auth else {}
        response = await client.get("/v1/models", headers=headers)
        assert await error_of(response) == (401, "invalid_request_error", None, "invalid_api_key")
        response = await client.post("/v1/chat/completions", json={}, headers=headers)
        assert response.status == 401
    good = {"Authorization": "Bearer sekret"}
    assert (await client.get("/v1/models", headers=good)).status == 200
    response = await client.post("/v1/chat/completions", json={"model": "tiny-llama"}, headers=good)
    assert await error_of(response) == (400, "invalid_request_error", "messages", None)  # past the guard
    assert (await client.get("/health/live")).status == 200  # probes need no key


def test_domain_errors_map_to_statuses():
    missing = to_http(ServiceUnavailableError("no prefill instance", "no_prefill"))
    assert (missing.status, missing.body["error"]["type"], missing.body["error"]["code"]) == (
        503, "server_error", "no_prefill"
    )  # fmt: skip
    limited = to_http(RateLimitedError("busy", retry_after=1.2))
    assert (limited.status, limited.headers) == (429, {"Retry-After": "2"})
    assert limited.body["error"]["type"] == "rate_limit_error"
    assert to_http(RateLimitedError("busy")).headers == {}
    assert to_http(RequestTimeoutError("slow")).status == 504
    assert to_http(UpstreamError("boom", "kv_lost")).status == 500
    hidden = to_http(RuntimeError("secret internals"))
    assert (hidden.status, hidden.body["error"]["message"]) == (500, "internal server error")


def test_a_request_no_wait_can_help_is_429_slo_unattainable_without_retry_after():
    unattainable = to_http(RateLimitedError("predicted TTFT 4.5 s even alone", None, {"predicted_ttft_s": 4.5},
                                            "slo_unattainable"))  # fmt: skip
    assert (unattainable.status, unattainable.headers) == (429, {})
    error = unattainable.body["error"]
    assert (error["type"], error["code"], error["reason"], error["predicted_ttft_s"]) == (
        "rate_limit_error", "slo_unattainable", "slo_unattainable", 4.5
    )  # fmt: skip
    busy = to_http(RateLimitedError("queue", 0.3, {}, "ttft_slo"))
    assert (busy.headers, busy.body["error"]["code"], busy.body["error"]["reason"]) == (
        {"Retry-After": "1"}, "rate_limit_exceeded", "ttft_slo"
    )  # fmt: skip


@pytest.mark.parametrize("value, best_effort", [("best-effort", True), ("Best-Effort", True)])
def test_x_kvserve_slo_best_effort_is_read_and_anything_else_is_400(value, best_effort):
    from aiohttp.test_utils import make_mocked_request

    from services.gateway.errors import InvalidParameterError
    from services.gateway.handlers import _slo_override

    assert _slo_override(make_mocked_request("POST", "/", headers={"x-kvserve-slo": value})).best_effort is best_effort
    assert _slo_override(make_mocked_request("POST", "/")).best_effort is False
    with pytest.raises(InvalidParameterError, match="x-kvserve-slo must be 'best-effort'"):
        _slo_override(make_mocked_request("POST", "/", headers={"x-kvserve-slo": "fast"}))
