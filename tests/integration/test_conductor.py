"""The conductor live: calibrated workers, cache-aware routing by the KV index the
workers' events keep, early rejection with Retry-After, and prefill on a decode
worker. Clusters without a store (so a prefix lives in one worker's cache only),
each worker calibrating at start."""

import asyncio
import json
import urllib.error
import urllib.request

import nats
import pytest

from kvserve.cli.cluster import LocalCluster
from libs.engine.cost_model import CostModel
from libs.protocol import schema, subjects
from libs.protocol.schema import MetricsReply, MetricsRequest
from tests.integration.conftest import CALIBRATED, CLUSTER_ENV, metric_value, wait_until
from tests.integration.test_one_request import reference

MODEL = "SmolLM2-135M-Instruct"
PREFIX = "You are a careful assistant for a shipping company. " + "Parcels must be weighed twice and logged. " * 40


def start(prefill: int, policy: str) -> LocalCluster:
    env = {**CLUSTER_ENV, **CALIBRATED, "KVSERVE_NUM_BLOCKS": "512", "KVSERVE_POLICY": policy}
    c = LocalCluster(prefill=prefill, decode=1, store=False, gateway_port=0, dtype="float32", env=env, log=None)
    c.start(timeout=180)
    return c


@pytest.fixture(scope="module")
def cluster():
    c = start(2, "cache_aware+early_rejection")
    yield c
    c.stop()


def post(cluster, messages, max_tokens: int = 2, stream: bool = False, headers: dict | None = None):
    """Send a chat request; return the open response (its headers are in once this returns)."""
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": stream}).encode()  # fmt: skip
    request = urllib.request.Request(cluster.gateway_url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    return urllib.request.urlopen(request, timeout=120)


def with_prefix(question: str) -> list[dict]:
    return [{"role": "system", "content": PREFIX}, {"role": "user", "content": question}]


def test_workers_calibrate_and_report_their_cost_models(cluster):
    for worker in ("prefill-0", "prefill-1", "decode-0"):
        cost = cluster.instances[worker].cost
        assert cost is not None and cost.block_size == 16 and cost.transfer_per_block > 0
        assert any("cost model: prefill" in line for line in cluster.logs(worker))
    # the launcher heard the cost model first: the conductor logs it when its own copy of the heartbeat comes
    wait_until(lambda: any("prefill-0 cost model: prefill" in line for line in cluster.logs("conductor-0")), 30)


def test_a_shared_prefix_goes_to_the_worker_holding_it_until_its_queue_makes_the_other_faster(cluster):
    no_ttft_limit = {"x-kvserve-slo-ttft-ms": "600000", "x-kvserve-slo-tbt-ms": "600000"}  # routing, not rejection
    warm = post(cluster, with_prefix("Who are you?"), headers=no_ttft_limit)
    holder = warm.headers["x-kvserve-prefill-instance"]
    warm.read()
    other = {"prefill-0": "prefill-1", "prefill-1": "prefill-0"}[holder]
    opened, picks = [], []
    try:
        for i in range(60):  # streams stay open: the holder's queue grows with each
            response = post(cluster, with_prefix(f"Question {i}: what is {i} plus {i}?"), stream=True,
                            headers=no_ttft_limit)  # fmt: skip
            opened.append(response)
            picks.append((response.headers["x-kvserve-prefill-instance"], response.headers["x-kvserve-cached-tokens"]))
            if picks[-1][0] == other:
                break
    finally:
        for response in opened:
            response.read()
    where = [p for p, _ in picks]
    assert where[-1] == other, f"never routed away from {holder}: {where}"
    assert len(where) >= 3 and set(where[:-1]) == {holder}, where
    held = len(PREFIX) // 8  # the prefix is hundreds of tokens: most of it is cached on the holder
    assert all(int(cached.split(",")[0].removeprefix("device=")) > held for _, cached in picks[:-1])
    assert picks[-1][1].startswith("device=0,")  # the other computes it all


def test_an_overloaded_cluster_answers_429_with_retry_after_instead_of_queuing(cluster, smollm):
    def question(i: int) -> list[dict]:
        return [{"role": "user", "content": f"Request {i}: " + f"describe the number {i} in a long paragraph. " * 6}]

    # a TTFT target a little over what one request costs alone on the slowest worker, as each measured itself
    tokens = len(smollm.tokenizer.encode_chat(question(0)))
    alone = max(CostModel(hb.cost).prefill_time(tokens) for hb in cluster.instances.values() if hb.cost is not None)
    slo_ms = 2.5 * alone * 1e3
    slo = {"x-kvserve-slo-ttft-ms": f"{slo_ms:.0f}", "x-kvserve-slo-tbt-ms": "60000"}  # the TTFT target is the one to hit
    opened, rejected = [], []
    try:
        for i in range(60):
            try:
                opened.append(post(cluster, question(i), stream=True, headers=slo))
            except urllib.error.HTTPError as e:
                assert e.code == 429
                rejected.append((e.headers["Retry-After"], json.loads(e.read())["error"]))
                if len(rejected) == 3:
                    break
    finally:
        for response in opened:
            response.read()
    assert len(rejected) == 3, "the cluster queued 60 requests without rejecting one"
    for retry_after, error in rejected:
        assert int(retry_after) >= 1
        assert error["code"] == "rate_limit_exceeded" and error["retry_after_s"] > 0
        assert error["predicted_ttft_s"] * 1e3 > round(slo_ms) and error["message"].startswith("predicted TTFT")
    admitted = [(r.headers["x-kvserve-prefill-instance"], float(r.headers["x-kvserve-predicted-ttft-ms"])) for r in opened]
    assert len(admitted) >= 2 and all(ttft <= round(slo_ms) for _, ttft in admitted), (slo_ms, admitted)


def test_a_short_prompt_is_prefilled_on_the_decode_worker_while_the_prefill_worker_is_busy(smollm):
    cluster = start(1, "cache_aware+local_prefill")
    try:
        # long prompts keep the prefill worker busy; at the default TBT target they are too long to stall decode for
        busy = [post(cluster, [{"role": "user", "content": f"Story {i}: " + f"a tale about the number {i}. " * 60}],
                     stream=True) for i in range(3)]  # fmt: skip
        try:
            messages = [{"role": "user", "content": "Say hi."}]
            response = post(cluster, messages, max_tokens=8, headers={"x-kvserve-slo-tbt-ms": "60000"})
            body = json.loads(response.read())
        finally:
            for r in busy:
                r.read()
        assert [r.headers["x-kvserve-prefill-instance"] for r in busy] == ["prefill-0"] * 3
        assert response.headers["x-kvserve-prefill-on-decode"] == "1"
        assert response.headers["x-kvserve-prefill-instance"] == "decode-0"
        assert body["choices"][0]["message"]["content"] == reference(smollm, messages, 8)
    finally:
        cluster.stop()


def test_the_conductor_exports_its_ttft_prediction_error_and_index_size(cluster):
    async def fetch() -> str:
        nc = await nats.connect(cluster.nats_url)
        try:
            reply = await nc.request(subjects.metrics("conductor-0"), schema.encode(MetricsRequest()), timeout=10)
        finally:
            await nc.close()
        return schema.decode(reply.data, MetricsReply).text

    text = asyncio.run(fetch())
    assert metric_value(text, "kvserve_conductor_ttft_prediction_error_seconds_count") >= 3  # the requests above
    assert metric_value(text, "kvserve_requests_admitted_total") >= 3
    assert metric_value(text, "kvserve_requests_rejected_total", reason="ttft_slo") >= 3
    assert metric_value(text, "kvserve_conductor_kv_index_blocks") > len(PREFIX) // 8 // 16  # the shared prefix at least
