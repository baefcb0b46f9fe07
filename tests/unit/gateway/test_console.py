"""The console's data routes: which need the API key, the JSON they answer (built
from the heartbeats the gateway heard, a conductor's view and the requests it
served), the live feed, and the arithmetic of SLO attainment, TTFT/TPOT and the
charts' buckets."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from libs.common import tenants as tenants_file
from libs.common.tenants import Tenant, Tenants
from libs.protocol import subjects
from libs.protocol.schema import (
    CandidateView,
    ConductorViewReply,
    ConductorViewRequest,
    CostCoefficients,
    DecisionView,
    Heartbeat,
    PrefillBeat,
    PrefixView,
    StoreBeat,
)
from libs.protocol.slo import SLOOverride
from services.gateway.app import Gateway
from services.gateway.console import INLINE_STATE_REQUESTS
from services.gateway.console_data import BUCKET_S, RequestLog, Served, console_state, for_caller, tenant_rows
from services.gateway.response_bodies import Usage
from services.gateway.routes import init_app
from services.gateway.tenant_usage import UsageTotals
from tests.unit.gateway.conftest import gateway_settings

KEY = "console-test-key"
WAIT = 20.0  # seconds any expected event may take
NOW = 10_000.0  # a multiple of BUCKET_S: bucket edges fall on round numbers
COST = CostCoefficients(block_size=16, prefill_base=0.0, prefill_per_token=0.001, prefill_per_token_context=0.0,
                        decode_base=0.05, decode_per_seq=0.001, decode_per_context_token=0.0, transfer_per_block=0.0)


def view(**overrides) -> ConductorViewReply:
    decision = DecisionView(
        request_id="req-1", at=NOW - 5, policy="cache_aware", prefill_id="prefill-0", decode_id="decode-0",
        predicted_ttft_s=0.2, predicted_tbt_s=0.06, cached_tokens={"device": 32},
        candidates=[CandidateView(instance_id="prefill-0", role="prefill", predicted_ttft_s=0.2, cached_tokens=32),
                    CandidateView(instance_id="decode-0", role="decode", predicted_tbt_s=0.06, batch_size=1)],
    )  # fmt: skip
    fields = dict(
        instance_id="conductor-0", policy="cache_aware", slo_ttft_s=1.0, slo_tbt_s=0.1,
        blocks={"prefill-0": {"device": 12}, "store-0": {"dram": 40, "disk": 90}},
        hot_prefixes=[PrefixView(block_hash="ab" * 16, num_blocks=2, hits=3, holders={"prefill-0": "device"})],
        decisions=[decision],
    )  # fmt: skip
    return ConductorViewReply(**{**fields, **overrides})


def served(request_id: str, at: float, ttft: float | None, tpot: float | None, finish: str | None = "stop",
           cached: int = 0, **fields) -> Served:  # fmt: skip
    return Served(request_id=request_id, at=at, prefill_id="prefill-0", decode_id="decode-0", num_prompt_tokens=64,
                  num_cached_tokens=cached, num_completion_tokens=8, ttft_s=ttft, tpot_s=tpot, finish_reason=finish,
                  **fields)  # fmt: skip


# --- the state, as a pure function ------------------------------------------------------
def test_state_lists_instances_with_their_kv_tiers_and_cost_and_annotates_decisions():
    beats = [
        (Heartbeat(instance_id="store-0", role="store", host_id="h", started_at=NOW - 50,
                   payload=StoreBeat(capacity=100, free_blocks=60)), 0.5),
        (Heartbeat(instance_id="prefill-0", role="prefill", host_id="h", started_at=NOW - 60,
                   payload=PrefillBeat(load=2, capacity=64, free_blocks=16, queued_tokens=300, cost=COST)), 0.2),
        (Heartbeat(instance_id="conductor-0", role="conductor", host_id="h"), 0.1),
    ]  # fmt: skip
    log = [served("req-1", NOW - 3, 0.25, 0.05, cached=32)]
    state = console_state({"instance_id": "gateway-0"}, beats, [view()], ["conductor-1"], log, NOW)
    assert [i["instance_id"] for i in state["instances"]] == ["conductor-0", "prefill-0", "store-0"]
    prefill = state["instances"][1]
    assert (prefill["load"], prefill["kv_usage"], prefill["queued_tokens"], prefill["tiers"]) == (2, 0.75, 300, {"device": 12})
    assert prefill["cost"]["decode_base"] == 0.05 and prefill["uptime_s"] == 60.0 and prefill["last_heard_s"] == 0.2
    assert state["instances"][2]["tiers"] == {"dram": 40, "disk": 90} and state["instances"][2]["kv_usage"] == 0.4
    assert state["instances"][0]["kv_usage"] is None  # no KV pool
    assert state["conductors"] == [
        {"instance_id": "conductor-0", "policy": "cache_aware", "slo_ttft_s": 1.0, "slo_tbt_s": 0.1,
         "learned": {"ttft_slack_s": {}, "tbt_margins": {}, "prefill_speeds": {}}},
        {"instance_id": "conductor-1", "error": "did not answer"}]  # fmt: skip
    (decision,) = state["decisions"]
    assert (decision["request_id"], decision["prefill_id"], decision["decode_id"]) == ("req-1", "prefill-0", "decode-0")
    assert decision["actual"] == {"ttft_s": 0.25, "tpot_s": 0.05, "cached_tokens": 32, "prompt_tokens": 64,
                                  "finish_reason": "stop"}  # fmt: skip
    assert [c["instance_id"] for c in decision["candidates"]] == ["prefill-0", "decode-0"]
    assert state["kv_map"]["hot_prefixes"] == [{"block_hash": "ab" * 16, "num_blocks": 2, "hits": 3,
                                                "holders": {"prefill-0": "device"}}]  # fmt: skip
    assert state["requests"][0]["slo_met"] is True and state["slo"]["cache_hit"] == 0.5
    json.dumps(state)  # JSON-ready as it is


def test_slo_attainment_counts_completed_requests_within_both_targets_or_their_own():
    log = [  # oldest first
        served("too-old", NOW - 400, 0.1, 0.01),  # outside the five-minute window
        served("one-token", NOW - 6, 0.5, None, finish="length"),
        served("own-target", NOW - 5, 1.5, 0.05, slo_ttft_s=2.0),
        served("failed", NOW - 4, 0.5, 0.05, finish=None),
        served("slow-tokens", NOW - 3, 0.5, 0.2),
        served("slow-first-token", NOW - 2, 1.5, 0.05),
        served("ok", NOW - 1, 0.5, 0.05),
    ]
    state = console_state({}, [], [view()], [], log, NOW)
    assert [(r["request_id"], r["slo_missed"]) for r in state["requests"][:6]] == [  # newest first
        ("ok", None), ("slow-first-token", "ttft"), ("slow-tokens", "tpot"), ("failed", "failed"),
        ("own-target", None), ("one-token", None)]  # fmt: skip
    slo = state["slo"]
    assert (slo["requests"], slo["met"], slo["attainment"]) == (6, 3, 0.5)
    assert (slo["ttft_p50_s"], slo["ttft_p90_s"]) == (0.5, 1.5)
    assert (slo["tpot_p50_s"], slo["tpot_p90_s"]) == (0.05, 0.2)
    assert console_state({}, [], [], [], log, NOW)["slo"]["attainment"] is None  # no conductor: no targets known


def test_series_put_each_request_in_its_bucket():
    now = NOW + BUCKET_S / 2  # half-way through the last bucket, [NOW, NOW + BUCKET_S)
    log = [served("a", now - 1, 0.2, 0.04), served("b", now - 2, 0.4, 0.08), served("c", NOW - 1, 2.0, 0.02)]
    series = console_state({}, [], [view()], [], log, now)["series"]
    n = len(series["t"])
    assert series["t"][-1] == NOW and series["t"][-2] == NOW - BUCKET_S  # each point starts its bucket
    assert series["requests"][-1] == 2 and series["requests"][-2] == 1 and sum(series["requests"]) == 3
    assert series["ttft_p90_s"][-1] == 0.4 and series["ttft_p50_s"][-1] == 0.2 and series["ttft_p50_s"][-2] == 2.0
    assert series["attainment"][-1] == 1.0 and series["attainment"][-2] == 0.0
    assert series["attainment"][: n - 2] == [None] * (n - 2)  # no request there: a gap, not 0%


def test_the_request_log_measures_tpot_after_the_first_token_and_forgets_old_requests():
    now = [NOW]
    log = RequestLog(horizon_s=60.0, clock=lambda: now[0])
    run = SimpleNamespace(request_id="req-9", ttft_s=0.5, migrations=1,
                          served_by=lambda: {"prefill_instances": ["p0", "p1"], "decode_instances": ["d0", "d1"]})
    text = SimpleNamespace(num_prompt_tokens=40, num_cached_tokens=32, num_completion_tokens=11, finish_reason="stop")
    log.observe(SimpleNamespace(run=run, text=text, slo=SLOOverride(ttft_s=3.0), started_at=100.0, ended_at=102.5,
                                tenant=Tenant("alice")))  # fmt: skip
    (entry,) = log.recent()
    assert entry.tenant == "alice"
    assert entry.tpot_s == pytest.approx((2.5 - 0.5) / 10)  # ten tokens after the first
    assert (entry.prefill_id, entry.decode_id, entry.migrations) == ("p0", "d1", 1)  # where it started, where it ended
    assert (entry.num_cached_tokens, entry.slo_ttft_s, entry.slo_tbt_s) == (32, 3.0, None)
    now[0] += 61
    assert log.recent() == []


# --- tenants -------------------------------------------------------------------------------
def usage_totals() -> dict[str, UsageTotals]:
    return {
        "alice": UsageTotals(2, 128, 48, 16, {"requests_per_minute": 1}),
        "bob": UsageTotals(1, 64, 0, 8, {"fair_share": 2, "requests_per_minute": 1}),
        "carol": UsageTotals(1, 64, 32, 8, {}),
    }


def tenants_log() -> list[Served]:
    return [served("old", NOW - 400, 3.0, 0.05, tenant="alice"),  # outside the window: not in the SLO counts
            served("a1", NOW - 3, 0.5, 0.05, tenant="alice"), served("a2", NOW - 2, 1.5, 0.05, tenant="alice"),
            served("b1", NOW - 2, 0.5, 0.05, tenant="bob"), served("c1", NOW - 1, 0.5, 0.05, finish=None,
                                                                   tenant="carol"),
            served("untenanted", NOW - 1, 0.5, 0.05)]  # fmt: skip


def test_each_tenant_has_a_row_of_its_usage_refusals_and_slos_over_the_window():
    rows = console_state({}, [], [view()], [], tenants_log(), NOW, usage=usage_totals())["tenants"]
    assert rows == [
        {"tenant": "alice", "requests": 2, "prompt_tokens": 128, "cached_tokens": 48, "completion_tokens": 16,
         "refusals": {"requests_per_minute": 1}, "slo_met": 1, "slo_missed": 1},
        {"tenant": "bob", "requests": 1, "prompt_tokens": 64, "cached_tokens": 0, "completion_tokens": 8,
         "refusals": {"fair_share": 2, "requests_per_minute": 1}, "slo_met": 1, "slo_missed": 0},
        {"tenant": "carol", "requests": 1, "prompt_tokens": 64, "cached_tokens": 32, "completion_tokens": 8,
         "refusals": {}, "slo_met": 0, "slo_missed": 1},
    ]  # fmt: skip
    no_targets = console_state({}, [], [], [], tenants_log(), NOW, usage=usage_totals())["tenants"]
    assert {(r["slo_met"], r["slo_missed"]) for r in no_targets} == {(None, None)}  # no conductor: unknown


def test_the_tenant_rows_use_the_bounded_label_and_other_comes_last():
    label = {"bob": "bob"}.get
    window = tenants_log()[1:]
    rows = tenant_rows(usage_totals(), window, 1.0, 0.1, lambda name: label(name, "other"))
    assert [r["tenant"] for r in rows] == ["bob", "other"]  # alice and carol add up under "other"
    other = rows[1]
    assert (other["requests"], other["prompt_tokens"], other["cached_tokens"]) == (3, 192, 80)
    assert (other["refusals"], other["slo_met"], other["slo_missed"]) == ({"requests_per_minute": 1}, 1, 2)


def test_an_admin_sees_every_tenant_and_any_other_tenant_only_itself():
    log = tenants_log()
    state = console_state({}, [], [view()], [], log, NOW, usage=usage_totals(), tenant_label=lambda name: "other")
    assert for_caller(state, Tenant("root", admin=True), usage_totals(), log) is state
    assert for_caller(state, None, usage_totals(), log) is state  # no tenants at all: nothing to hide
    mine = for_caller(state, Tenant("alice"), usage_totals(), log)
    assert mine["tenants"] == [  # its own name and counts, though its label is "other"
        {"tenant": "alice", "requests": 2, "prompt_tokens": 128, "cached_tokens": 48, "completion_tokens": 16,
         "refusals": {"requests_per_minute": 1}, "slo_met": 1, "slo_missed": 1}]  # fmt: skip
    assert mine["slo"] == state["slo"] and len(state["tenants"]) == 1
    assert for_caller(state, Tenant("dave"), usage_totals(), log)["tenants"][0]["requests"] == 0  # nothing yet


def test_a_tenant_sees_its_own_requests_and_no_routing_decisions_or_hot_prefixes():
    log = tenants_log()
    state = console_state({}, [], [view()], [], log, NOW, usage=usage_totals())
    assert state["decisions"] and state["kv_map"]["hot_prefixes"] and len(state["requests"]) == len(log)
    mine = for_caller(state, Tenant("alice"), usage_totals(), log)
    assert [r["request_id"] for r in mine["requests"]] == ["a2", "a1", "old"]  # newest first, as the admin's
    assert mine["requests"] == [r for r in state["requests"] if r["tenant"] == "alice"]
    # which prefixes are hot, and what each routing decision found cached, is about everyone's prompts
    assert mine["decisions"] == [] and mine["kv_map"]["hot_prefixes"] == []
    assert mine["kv_map"]["blocks"] == state["kv_map"]["blocks"]  # block counts per instance say nothing of whose


@pytest.fixture
async def tenant_console(served_model, tmp_path):
    keys = {name: tenants_file.new_key() for name in ("root", "alice", "bob")}
    path = tmp_path / "tenants.toml"
    tenants = {name: Tenant(name, (tenants_file.hash_key(key),), admin=name == "root") for name, key in keys.items()}
    tenants_file.write(path, Tenants(tenants, b"secret"))
    gateway = Gateway(gateway_settings(tenants_file=str(path)), model=served_model)
    for name in ("alice", "bob"):
        gateway.generations.usage.observe(tenants[name], Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=0))
    async with TestClient(TestServer(init_app(gateway, gateway.generations))) as client:
        yield client, keys


async def test_the_console_shows_an_admins_key_every_tenant_and_a_tenants_key_its_own(tenant_console):
    client, keys = tenant_console

    async def tenants_seen(key: str, path: str = "/console/api/state") -> list[str]:
        response = await client.get(path, headers={"Authorization": f"Bearer {key}", "Accept": "text/event-stream"})
        state = await (response.json() if path.endswith("state") else next_event(response))
        response.close()
        return [row["tenant"] for row in state["tenants"]]

    for path in ("/console/api/state", "/console/api/events"):
        assert await tenants_seen(keys["root"], path) == ["alice", "bob"], path
        assert await tenants_seen(keys["alice"], path) == ["alice"], path
        assert await tenants_seen(keys["bob"], path) == ["bob"], path


# --- the routes ----------------------------------------------------------------------------
@pytest.fixture
async def console(served_model):
    gateway = Gateway(gateway_settings(api_key=KEY), model=served_model)
    asked = []

    async def request(subject, message, kind, timeout):  # the conductor, as NATS would bring its answer
        asked.append((subject, message))
        return view()

    gateway.request = request
    gateway.peers.observe(Heartbeat(instance_id="conductor-0", role="conductor", host_id="h"))
    gateway.peers.observe(Heartbeat(instance_id="prefill-0", role="prefill", host_id="h",
                                    payload=PrefillBeat(capacity=64, free_blocks=48)))  # fmt: skip
    async with TestClient(TestServer(init_app(gateway, gateway.generations))) as client:
        yield client, gateway, asked


AUTH = {"Authorization": f"Bearer {KEY}"}


async def test_the_page_and_its_files_are_public_and_the_data_needs_the_key(console):
    client, _, _ = console
    page = await client.get("/console")
    assert page.status == 200 and page.content_type == "text/html" and "console.js" in await page.text()
    for name in ("console.js", "console.css", "vendor/uplot/uPlot.iife.min.js", "vendor/uplot/LICENSE"):
        assert (await client.get(f"/console/static/{name}")).status == 200, name
    assert (await client.get("/console/static/nope.js")).status == 401  # only the files there are public
    missing = await client.get("/console/static/nope.js", headers=AUTH)
    assert missing.status == 404 and "error" in await missing.json()
    for path in ("/console/api/state", "/console/api/events"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = await client.get(path, headers={"Accept": "text/event-stream", **headers})
            body = await response.json()
            assert response.status == 401 and body["error"]["code"] == "invalid_api_key", (path, headers)


async def test_state_asks_each_live_conductor_and_answers_json(console):
    client, _, asked = console
    response = await client.get("/console/api/state", headers=AUTH)
    state = await response.json()
    assert response.status == 200 and response.headers["Cache-Control"] == "no-store"
    assert [(s, m) for s, m in asked] == [(subjects.conductor_view("conductor-0"), ConductorViewRequest(max_decisions=20))]
    assert set(state) == {"time", "gateway", "instances", "conductors", "kv_map", "decisions", "requests", "slo",
                          "series", "tenants"}  # fmt: skip
    assert state["gateway"]["instance_id"] == "gateway-test" and state["gateway"]["model"] == "tiny-llama"
    assert {i["instance_id"]: i["kv_usage"] for i in state["instances"]} == {"conductor-0": None, "prefill-0": 0.25}
    assert state["decisions"][0]["request_id"] == "req-1" and state["slo"]["ttft_s"] == 1.0
    await client.get("/console/api/state", headers=AUTH)
    assert len(asked) == 1  # asked again at most once every VIEW_MAX_AGE, however many pages watch


async def test_the_feed_is_server_sent_events_and_ends_when_the_gateway_stops(console):
    client, gateway, _ = console
    refused = await client.get("/console/api/events", headers=AUTH)  # no Accept: no endless body
    assert refused.status == 406 and (await refused.json())["error"]["code"] == "not_acceptable"
    response = await client.get("/console/api/events", headers={**AUTH, "Accept": "text/event-stream"})
    assert response.status == 200 and response.content_type == "text/event-stream"
    assert (await next_event(response))["requests"] == []
    console_log = gateway.generations.observers[0].__self__  # the RequestLog the console keeps
    console_log.add(served("req-1", console_log.clock(), 0.3, 0.05))
    async with asyncio.timeout(WAIT):
        while not (event := await next_event(response))["requests"]:
            pass  # an event built before the request was logged
        assert [r["request_id"] for r in event["requests"]] == ["req-1"]
        gateway.stopping.set()
        await response.content.read()  # returns at the end of the stream
    assert response.content.at_eof()


async def next_event(response) -> dict:
    return json.loads((await response.content.readuntil(b"\n\n")).removeprefix(b"data: "))


async def test_a_long_log_is_summed_up_off_the_event_loop_and_a_new_request_shows_at_once(console):
    client, gateway, _ = console
    log = gateway.generations.observers[0].__self__
    for i in range(INLINE_STATE_REQUESTS + 1):
        log.add(served(f"r{i}", log.clock(), 0.3, 0.05))
    state = await (await client.get("/console/api/state", headers=AUTH)).json()
    assert state["slo"]["requests"] == INLINE_STATE_REQUESTS + 1 and state["slo"]["attainment"] == 1.0
    log.add(served("one-more", log.clock(), 5.0, 0.05))  # within FEED_MIN_GAP of the last build
    state = await (await client.get("/console/api/state", headers=AUTH)).json()
    assert state["requests"][0]["request_id"] == "one-more" and state["slo"]["requests"] == INLINE_STATE_REQUESTS + 2
