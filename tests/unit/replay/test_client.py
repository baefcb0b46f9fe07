"""The replayer against a fake server whose delays and answers are scripted:
what it measures must be what the server did."""

import asyncio

import pytest

from kvserve.replay.client import Endpoint, PlannedRequest, replay
from kvserve.replay.metrics import summarize
from kvserve.replay.records import RequestRecord
from libs.protocol.slo import SLO
from tests.unit.replay import fake_openai
from tests.unit.replay.fake_openai import FakeServer, Script

# The server's scheduled delays. Only what causality guarantees is asserted (a token
# cannot reach the client before the server sent it), never a wall-clock window.
SHORT, LONG = 0.02, 0.20


def planned(index: int, scheduled_s: float = 0.0, length: int = 4, max_tokens: int = 5) -> PlannedRequest:
    record = RequestRecord(index=index, scheduled_s=scheduled_s, input_tokens=length, max_tokens=max_tokens)
    return PlannedRequest([index] + [100 + i for i in range(length - 1)], record)


async def run_against(server: FakeServer, items: list[PlannedRequest], timeout_s: float = 30.0):
    runner, url = await fake_openai.start(server)
    try:
        return await replay(Endpoint(url, "fake-model", "k", timeout_s), items, label="fake", progress=False)
    finally:
        await runner.cleanup()


async def test_latencies_reflect_the_servers_scheduled_delays():
    itls = (SHORT, LONG, SHORT, LONG)
    server = FakeServer({0: Script(ttft_s=0.3, itl_s=itls, cached_tokens=3)})
    run = await run_against(server, [planned(0)])
    (record,) = run.records
    assert record.status == "ok" and record.error is None
    assert record.http_status == 200
    assert len(record.itl_s) == len(itls)  # one gap per token after the first
    # token k reaches the client no sooner than the server's delays up to it add up to
    scheduled = [0.3 + sum(itls[:k]) for k in range(len(itls) + 1)]
    measured = [record.ttft_s + sum(record.itl_s[:k]) for k in range(len(itls) + 1)]
    assert all(m >= s for m, s in zip(measured, scheduled)), (measured, scheduled)
    assert all(gap >= 0 for gap in record.itl_s)
    assert record.e2e_s >= measured[-1]
    assert record.output_tokens == 5 and record.prompt_tokens == 4 and record.cached_tokens == 3
    assert record.tpot_s == pytest.approx((record.e2e_s - record.ttft_s) / 4)


async def test_the_ttft_kvserve_predicted_is_kept_beside_the_one_measured():
    server = FakeServer({0: Script(predicted_ttft_ms="148.5"), 1: Script(), 2: Script(predicted_ttft_ms="soon")})
    run = await run_against(server, [planned(0), planned(1), planned(2)])
    assert [r.predicted_ttft_s for r in run.records] == [pytest.approx(0.1485), None, None]


async def test_request_body_is_a_token_array_with_greedy_ignore_eos_streaming():
    server = FakeServer({7: Script()})
    await run_against(server, [planned(7, length=6, max_tokens=9)])
    assert server.bodies == [
        {
            "model": "fake-model",
            "prompt": [7, 100, 101, 102, 103, 104],
            "max_tokens": 9,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ]


async def test_429_is_a_rejection_not_an_error():
    server = FakeServer({0: Script(status=429, retry_after="2"), 1: Script(status=500), 2: Script()})
    run = await run_against(server, [planned(0), planned(1), planned(2)])
    rejected, failed, ok = run.records
    assert (rejected.status, rejected.http_status, rejected.retry_after_s) == ("rejected", 429, 2.0)
    assert rejected.error == "HTTP 429: scripted 429"
    assert (failed.status, failed.http_status, failed.error) == ("error", 500, "HTTP 500: scripted 500")
    assert ok.status == "ok"
    # each answer's end is recorded, on the run's clock, after its send (and a stream's after its first token)
    assert rejected.start_s <= rejected.ended_s and failed.start_s <= failed.ended_s
    assert ok.first_token_at_s <= ok.ended_s
    summary = summarize(run, SLO.from_ms(60_000, 60_000))
    assert (summary.requests, summary.completed, summary.rejected, summary.errors, summary.good) == (3, 1, 1, 1, 1)
    assert summary.slo_attainment == pytest.approx(1 / 3)


async def test_error_event_mid_stream_is_an_error():
    server = FakeServer({0: Script(itl_s=(SHORT,), error_mid_stream=True)})
    (record,) = (await run_against(server, [planned(0)])).records
    assert record.status == "error"
    assert record.error == "error event mid-stream: scripted failure"


async def test_arrivals_are_open_loop():
    """Request 0 is held until request 1 has arrived: a client that waited for
    request 0 before sending request 1 would never finish."""
    request_1_arrived = asyncio.Event()
    server = FakeServer({0: Script(hold=request_1_arrived), 1: Script()})
    server.arrived[1] = request_1_arrived
    run = await run_against(server, [planned(0, scheduled_s=0.0), planned(1, scheduled_s=0.2)], timeout_s=20)
    assert [r.status for r in run.records] == ["ok", "ok"]
    assert server.arrivals[1] > server.arrivals[0]
    assert run.records[1].start_s >= 0.2  # sent on the trace's clock, not earlier
    assert run.records[0].e2e_s > run.records[1].start_s - run.records[0].start_s
