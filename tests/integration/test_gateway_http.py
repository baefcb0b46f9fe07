"""The gateway's HTTP edge on a real cluster: readiness follows the workers'
heartbeats, inputs that once gave 500 get 400 without reaching a worker, and
requests still stream through the connection guard."""

import json
import signal
import urllib.error
import urllib.request

from tests.integration.conftest import wait_until

WAIT = 30.0


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=WAIT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_ready_follows_the_decode_workers_heartbeats(cluster):
    base = cluster.gateway_url
    wait_until(lambda: get(base + "/health/ready")[0] == 200, WAIT)
    assert get(base + "/health")[0] == 200 and get(base + "/health/live")[0] == 200
    decode_id = next(i for i, beat in cluster.instances.items() if beat.role == "decode")
    cluster.kill(decode_id, signal.SIGSTOP)  # alive but silent: its heartbeats stop
    try:
        wait_until(lambda: get(base + "/health/ready")[1].get("reasons") == ["no live decode instance"], WAIT)
        status, body = get(base + "/health")
        assert (status, body["status"]) == (503, "unavailable")
        assert get(base + "/health/live")[0] == 200
    finally:
        cluster.kill(decode_id, signal.SIGCONT)
    wait_until(lambda: get(base + "/health/ready")[0] == 200, WAIT)


def test_inputs_that_were_500_are_400_naming_the_field(cluster):
    model = get(cluster.gateway_url + "/v1/models")[1]["data"][0]["id"]
    chat = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi"}}]'
    cases = [
        (chat + ', "seed": 18446744073709551616}', "seed"),
        (chat + ', "seed": 1000000000000000000000000000000}', "seed"),
        (chat + ', "seed": -9223372036854775809}', "seed"),
        (chat + ', "top_k": 18446744073709551616}', "top_k"),
        (chat + ', "stop_token_ids": [18446744073709551616]}', "stop_token_ids[0]"),
        (chat + ', "tool_choice": "auto"}', "tool_choice"),
        ("[" * 2000 + "]" * 2000, None),
    ]
    for body, param in cases:
        status, error = post(cluster.gateway_url + "/v1/chat/completions", body.encode())
        assert (status, error["error"]["type"], error["error"]["param"]) == (400, "invalid_request_error", param)


def test_a_request_streams_through_the_guarded_listener(cluster, openai_client):
    model = openai_client.models.list().data[0].id
    stream = openai_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert get(cluster.gateway_url + "/openapi.json")[1]["paths"]["/v1/models/{model}"]["get"]["parameters"][0][
        "schema"] == {"enum": [model]}  # fmt: skip
