"""The gateway's side of admission, in-process against a real nats-server while
the test plays conductor and workers: SLO headers in, 429 + Retry-After out,
explanation headers, progress reports, and prefill on a decode worker."""

import asyncio

import openai
import pytest

from libs.common import tenants as tenants_file
from libs.common.nats_flush import flush
from libs.common.tenants import Tenant, Tenants
from libs.protocol import schema, subjects
from libs.protocol.hashing import ROOT
from libs.protocol.schema import Ack, AdmitReply, ErrorReply, PrefillRequest, RequestProgress
from tests.unit.gateway.conftest import nats_server, nc  # noqa: F401  (fixtures)
from tests.unit.gateway.test_gateway_nats import (  # noqa: F401  (fixtures)
    MESSAGES,
    WAIT,
    cluster,
    hello_world,
    openai_client,
    start_gateway,
)


async def test_slo_headers_reach_the_conductor(start_gateway, cluster):
    client = openai_client(await start_gateway())
    await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=16,
                                         extra_headers={"x-kvserve-slo-ttft-ms": "500", "x-kvserve-slo-tbt-ms": "80"})  # fmt: skip
    admit = await asyncio.wait_for(cluster.admits.get(), WAIT)
    assert (admit.slo_ttft_s, admit.slo_tbt_s) == (0.5, 0.08)
    await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=16)
    admit = await asyncio.wait_for(cluster.admits.get(), WAIT)
    assert (admit.slo_ttft_s, admit.slo_tbt_s) == (None, None)


async def test_the_session_header_or_the_user_field_reaches_the_conductor(start_gateway, cluster):
    client = openai_client(await start_gateway())
    await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=16, user="alice",
                                         extra_headers={"x-session-id": "chat-7"})  # fmt: skip
    assert (await asyncio.wait_for(cluster.admits.get(), WAIT)).session_id == "chat-7"  # the header first
    await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=16, user="alice")
    assert (await asyncio.wait_for(cluster.admits.get(), WAIT)).session_id == "alice"
    await client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=16)
    assert (await asyncio.wait_for(cluster.admits.get(), WAIT)).session_id is None
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                             extra_headers={"x-session-id": "x" * 257})  # fmt: skip
    assert "session id" in e.value.body["message"]


async def test_the_conductor_hears_how_many_tokens_a_request_produced(start_gateway, cluster, nc):
    progress = await nc.subscribe(subjects.CONDUCTOR_PROGRESS)
    client = openai_client(await start_gateway())
    reply = await client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=16)
    first = schema.decode((await progress.next_msg(timeout=WAIT)).data, RequestProgress)
    last = schema.decode((await progress.next_msg(timeout=WAIT)).data, RequestProgress)
    assert (first.kind, last.kind) == ("first_token", "finished")
    assert last.num_output_tokens == reply.usage.completion_tokens > 1


@pytest.mark.parametrize("value", ["fast", "0", "-5", "inf"])
async def test_a_bad_slo_header_is_400_naming_it(start_gateway, cluster, value):
    client = openai_client(await start_gateway())
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="tiny-llama", messages=MESSAGES,
                                             extra_headers={"x-kvserve-slo-ttft-ms": value})  # fmt: skip
    assert "x-kvserve-slo-ttft-ms must be a positive number of milliseconds" in e.value.body["message"]
    assert cluster.admits.empty()


async def test_a_rejection_is_429_with_retry_after_and_the_predicted_wait(start_gateway, cluster):
    cluster.admit_reply = ErrorReply(code="rejected", message="predicted TTFT 4.2 s exceeds 2 s",
                                     retry_after_s=2.2, predicted_ttft_s=4.2, predicted_tbt_s=0.05)  # fmt: skip
    client = openai_client(await start_gateway())
    with pytest.raises(openai.RateLimitError) as e:
        await client.chat.completions.create(model="tiny-llama", messages=MESSAGES)
    assert e.value.status_code == 429
    assert e.value.response.headers["retry-after"] == "3"
    assert e.value.body["code"] == "rate_limit_exceeded"
    assert (e.value.body["retry_after_s"], e.value.body["predicted_ttft_s"]) == (2.2, 4.2)
    assert cluster.submits.empty()


async def test_responses_explain_themselves_and_the_conductor_hears_how_it_went(start_gateway, cluster, nc):
    cluster.admit_reply = AdmitReply(prefill_id="prefill-a", decode_id="decode-b", predicted_ttft_s=0.123,
                                     cached_tokens={"device": 32, "dram": 16})  # fmt: skip
    progress = await nc.subscribe(subjects.CONDUCTOR_PROGRESS)
    client = openai_client(await start_gateway())
    raw = await client.chat.completions.with_raw_response.create(model="tiny-llama", messages=MESSAGES, max_tokens=16)
    assert raw.parse().choices[0].message.content == "Hello world"
    h = raw.headers
    assert (h["x-kvserve-prefill-instance"], h["x-kvserve-decode-instance"]) == ("prefill-a", "decode-b")
    assert h["x-kvserve-predicted-ttft-ms"] == "123.0"
    assert h["x-kvserve-cached-tokens"] == "device=32,peer=0,dram=16,disk=0"
    first = schema.decode((await progress.next_msg(timeout=WAIT)).data, RequestProgress)
    last = schema.decode((await progress.next_msg(timeout=WAIT)).data, RequestProgress)
    assert (first.kind, last.kind) == ("first_token", "finished")
    assert first.request_id == last.request_id == h["x-request-id"]
    assert h["x-kvserve-actual-ttft-ms"] == f"{first.ttft_s * 1e3:.1f}"


async def test_prefill_on_the_decode_worker_goes_to_its_prefill_subject(start_gateway, cluster, nc):
    cluster.admit_reply = AdmitReply(prefill_id="decode-b", decode_id="decode-b", prefill_on_decode=True)
    local: asyncio.Queue[PrefillRequest] = asyncio.Queue()

    async def on_local_prefill(msg) -> None:
        req = schema.decode(msg.data, PrefillRequest)
        local.put_nowait(req)
        await msg.respond(schema.encode(Ack()))
        for c in hello_world(req):
            await nc.publish(subjects.tokens(req.request_id, "decode-b"), schema.encode(c))  # it prefilled itself

    await nc.subscribe(subjects.decode_prefill("decode-b"), cb=on_local_prefill)
    await flush(nc)
    client = openai_client(await start_gateway())
    raw = await client.chat.completions.with_raw_response.create(model="tiny-llama", messages=MESSAGES, max_tokens=16)
    assert raw.parse().choices[0].message.content == "Hello world"
    assert raw.headers["x-kvserve-prefill-on-decode"] == "1"
    assert (await asyncio.wait_for(local.get(), WAIT)).decode_id == "decode-b"
    assert cluster.submits.empty()  # no prefill worker was asked


async def test_a_tenants_name_weight_and_cache_scope_reach_the_conductor_and_the_prefill_worker(
    start_gateway, cluster, tmp_path
):
    key = tenants_file.new_key()
    path = tmp_path / "tenants.toml"
    tenants_file.write(path, Tenants({"acme": Tenant("acme", (tenants_file.hash_key(key),), weight=3.0,
                                                     store_share=0.5)}, b"s"))  # fmt: skip
    url = await start_gateway(tenants_file=str(path))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=WAIT)
    await client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=16)
    admit = await asyncio.wait_for(cluster.admits.get(), WAIT)
    submitted = await asyncio.wait_for(cluster.submits.get(), WAIT)
    assert (admit.tenant, admit.tenant_weight) == ("acme", 3.0)
    assert submitted.hash_root is not None and submitted.hash_root != ROOT  # acme's own scope
    owner = submitted.cache_owner
    assert (owner.name, owner.share) == ("tenant/acme", 0.5)  # the stores count it as acme's
