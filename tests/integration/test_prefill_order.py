"""Deadline-aware prefill on real clusters: a short prompt does not wait behind a long
one, and bursts do not teach admission to refuse everyone."""

import asyncio
import random
import tempfile

import aiohttp
import pytest

from kvserve.cli.cluster import LocalCluster
from tests.conftest import make_tiny_checkpoint
from tests.integration.conftest import STARTED, wait_until_async


def start(env: dict[str, str], **kwargs) -> LocalCluster:
    cluster = LocalCluster(prefill=1, decode=1, gateway_port=0, log=None, env=env,
                           store_dir=tempfile.mkdtemp(prefix="kvserve-stores-"), **kwargs)  # fmt: skip
    STARTED.append(cluster)
    cluster.start(timeout=120)
    return cluster


async def complete(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int,
                   headers: dict[str, str] | None = None) -> tuple[int, str]:  # fmt: skip
    """Send a streamed completion of token ids; (status, the text streamed or the error body)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    async with session.post(url + "/v1/completions", json=body, headers=headers or {}) as response:
        return response.status, await response.text()


def progress(cluster: LocalCluster) -> dict[str, float]:
    """What the prefill worker's last heartbeat says is left of each request it holds."""
    beat = cluster.instances.get("prefill-0")
    return dict(beat.payload.progress) if beat is not None and beat.payload is not None else {}


@pytest.fixture(scope="module")
def chunked_cluster():
    # small steps, so the long prompt below takes many of them; the dtype `kvserve up` picks (bfloat16
    # only where this CPU runs it fast: elsewhere the long prompt would not fit its 120 s target)
    c = start({"KVSERVE_MAX_CHUNK_TOKENS": "64", "KVSERVE_NUM_BLOCKS": "384"}, dtype="auto")
    yield c
    c.stop()


def test_a_short_prompt_sent_during_a_long_prefill_is_answered_before_it(chunked_cluster):
    cluster, model = chunked_cluster, "SmolLM2-135M-Instruct"
    rng = random.Random(7)
    long_prompt = [rng.randrange(1000, 40000) for _ in range(2400)]
    short_prompt = [rng.randrange(1000, 40000) for _ in range(24)]
    done: list[str] = []

    async def run() -> tuple[tuple[int, str], tuple[int, str], dict[str, float]]:
        async with aiohttp.ClientSession() as session:
            # the long one may take its time (a TTFT target it can meet), the short one has the default
            slow = {"x-kvserve-slo-ttft-ms": "120000"}
            long_task = asyncio.create_task(complete(session, cluster.gateway_url, model, long_prompt, 1, slow))
            long_task.add_done_callback(lambda _: done.append("long"))
            # until the worker has computed part of the long prompt, not all of it
            await wait_until_async(lambda: any(0 < share < 1 for share in progress(cluster).values()), 120,
                                   "the long prompt never showed partial progress")  # fmt: skip
            started = progress(cluster)
            short = await complete(session, cluster.gateway_url, model, short_prompt, 1)
            done.append("short")
            return await long_task, short, started

    (long_status, _), (short_status, short_body), started = asyncio.run(run())
    assert (long_status, short_status) == (200, 200), short_body
    assert any(0 < share < 1 for share in started.values())
    # the long prompt was partly computed when the short one came, and the short one finished first:
    # it waited for the step in progress and its own, not for the rest of the long prompt
    assert done == ["short", "long"]


def test_bursts_of_short_streams_then_long_prompts_are_all_admitted_at_lax_slos(tmp_path):
    """At targets of 60 s TTFT / 10 s TBT, two bursts of 40 short streams, then 40 distinct
    ~1,000-token prompts at once: the learned slack must not turn into refusals."""
    folder = make_tiny_checkpoint(tmp_path / "tiny", max_position_embeddings=2048)  # fast: the margins are the subject
    env = {"KVSERVE_SLO_TTFT_MS": "60000", "KVSERVE_SLO_TBT_MS": "10000", "KVSERVE_NUM_BLOCKS": "4096",
           "KVSERVE_STORE_CAPACITY_BYTES": str(64 << 20)}  # fmt: skip
    cluster = start(env, model=str(folder), dtype="float32")
    try:
        model = cluster.model_id
        rng = random.Random(3)

        async def run() -> list[list[int]]:
            async with aiohttp.ClientSession() as session:
                statuses = []
                for burst in range(2):
                    shorts = [[rng.randrange(0, 256) for _ in range(rng.randrange(4, 40))] for _ in range(40)]
                    results = await asyncio.gather(*(complete(session, cluster.gateway_url, model, p, 16)
                                                     for p in shorts))  # fmt: skip
                    statuses.append([status for status, _ in results])
                longs = [[rng.randrange(0, 256) for _ in range(rng.randrange(950, 1050))] for _ in range(40)]
                results = await asyncio.gather(*(complete(session, cluster.gateway_url, model, p, 4) for p in longs))
                statuses.append([status for status, _ in results])
                return statuses

        statuses = asyncio.run(run())
        assert statuses == [[200] * 40] * 3
    finally:
        cluster.stop()
