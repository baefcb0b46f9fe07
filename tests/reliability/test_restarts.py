"""A restart is not an absence: with one worker per role (what `kvserve up` runs),
SIGKILL of the only prefill or the only decode worker under 40 streams costs no
stream, and a request sent at the kill waits for the restarted worker instead of
being refused (429) or failed (503). The streams moved off the dead worker can only
finish on its restart under the same id, so finishing says it was not excluded. The
restart is the role's warm spare (its process, already loaded, becomes the worker).
In float32 every moved stream's greedy text equals an undisturbed run's (bfloat16's
rounding depends on the batch: the README gives its measured rate).
Bounded: 40 streams of at most 24 tokens per fault, every wait has a deadline.
"""

import asyncio
import tempfile
import time

import pytest

from kvserve.cli.cluster import LocalCluster
from kvserve.replay.streams import ChatLoad, run_streams, tally
from tests.integration.conftest import CALIBRATED, CLUSTER_ENV, STARTED

MODEL = "SmolLM2-135M-Instruct"
NUM_STREAMS = 40
MAX_TOKENS = 24
PROMPTS = [f"Write one sentence about the number {i}." for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def one_per_role():
    cluster = LocalCluster(
        prefill=1, decode=1, gateway_port=0, dtype="float32", env=CLUSTER_ENV, log=None, supervise=True,
        store_dir=tempfile.mkdtemp(prefix="kvserve-restarts-"),
    )  # fmt: skip
    STARTED.append(cluster)
    cluster.start(timeout=180)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def undisturbed(one_per_role) -> list[str]:
    """Each prompt's greedy text with nothing killed."""
    one_per_role.wait_for(_idle(one_per_role), timeout=60)
    outcomes = asyncio.run(run_streams(ChatLoad(one_per_role.gateway_url, MODEL, PROMPTS, max_tokens=MAX_TOKENS)))
    assert all(o.completed for o in outcomes), tally(outcomes).line()
    return [o.text for o in outcomes]


def _idle(cluster: LocalCluster):
    def idle(hbs) -> bool:
        workers = [hb for hb in hbs.values() if hb.role in ("prefill", "decode")]
        return set(cluster.instance_ids) <= hbs.keys() and all(hb.load == 0 for hb in workers)

    return idle


@pytest.mark.parametrize(
    ("victim", "kill_after_first_tokens"),
    [
        ("prefill-0", 8),  # most prompts are still queued on it: they move, and wait for its restart
        ("decode-0", NUM_STREAMS),  # every stream is decoding on it
    ],
)
def test_the_only_worker_of_a_role_killed_costs_no_stream_and_a_new_request_waits_for_its_restart(
    one_per_role, undisturbed, victim, kill_after_first_tokens
):
    cluster = one_per_role
    cluster.wait_for(_idle(cluster), timeout=60)
    cluster.wait_for_spares(timeout=120)
    spare = cluster.spare_pids[cluster.instances[victim].role]
    killed_at = {}

    async def scenario():
        started = asyncio.Event()
        load = ChatLoad(cluster.gateway_url, MODEL, PROMPTS, max_tokens=MAX_TOKENS)
        streams = asyncio.create_task(run_streams(load, started, started_after=kill_after_first_tokens))
        await asyncio.wait_for(started.wait(), timeout=120)
        killed_at["wall"] = time.time()
        await asyncio.to_thread(cluster.kill, victim)
        sent_at_kill = ChatLoad(cluster.gateway_url, MODEL, ["Name a color."], max_tokens=4)
        (new,) = await run_streams(sent_at_kill)
        return await streams, new

    outcomes, new = asyncio.run(scenario())
    result = tally(outcomes)
    assert result.completed == NUM_STREAMS, f"{victim}: {result.line()}"
    assert result.migrated > 0, f"no stream moved off {victim}: {result.line()}"
    assert [o.text for o in outcomes] == undisturbed  # the moved ones included
    assert new.status == 200 and new.completed, f"the request sent at the kill: {new.status} {new.error}"
    # served after the restart: the only instance of its role is the restarted process
    assert cluster.instances[victim].started_at > killed_at["wall"]
    assert cluster.pids[victim] == spare, "the restart did not take the warm spare"
    assert new.served_by is not None and victim in new.served_by["prefill_instances"] + new.served_by["decode_instances"]


def test_a_decode_kill_under_load_leaves_admissions_learned_corrections_within_their_bounds():
    """With admission on (the default policy): the streams a decode kill delayed teach the
    conductor nothing (a fault touched them), its learned TTFT slack and TBT margins stay
    inside their bounds, and a short request right after is admitted, not refused."""
    import json
    import urllib.request

    from services.conductor.margin import TBT_MARGIN, TTFT_SLACK_S

    env = {k: v for k, v in {**CLUSTER_ENV, **CALIBRATED}.items() if k != "KVSERVE_POLICY"}  # the default: admission on
    cluster = LocalCluster(prefill=1, decode=1, gateway_port=0, dtype="auto", env=env, log=None, supervise=True,
                           store_dir=tempfile.mkdtemp(prefix="kvserve-restarts-"))  # fmt: skip
    STARTED.append(cluster)
    cluster.start(timeout=180)
    cluster.wait_for_spares(timeout=120)  # the restart is the spare's, not a load racing the first one's
    try:
        async def scenario():
            started = asyncio.Event()
            load = ChatLoad(cluster.gateway_url, MODEL, PROMPTS[:16], max_tokens=MAX_TOKENS)
            streams = asyncio.create_task(run_streams(load, started, started_after=8))
            await asyncio.wait_for(started.wait(), timeout=120)
            await asyncio.to_thread(cluster.kill, "decode-0")
            return await streams

        outcomes = asyncio.run(scenario())
        failed = {(o.status, o.error) for o in outcomes if not (o.completed or o.status == 429)}
        assert not failed, (tally(outcomes).line(), failed)
        cluster.wait_for(_idle(cluster), timeout=60)
        (after,) = asyncio.run(run_streams(ChatLoad(cluster.gateway_url, MODEL, ["Name a color."], max_tokens=4)))
        assert after.status == 200 and after.completed, f"refused after the kill: {after.status} {after.error}"
        with urllib.request.urlopen(cluster.gateway_url + "/console/api/state", timeout=10) as response:
            learned = json.load(response)["conductors"][0]["learned"]
        assert set(learned["ttft_slack_s"]) == {"<128", "128-511", "512-1023", ">=1024"}
        assert all(TTFT_SLACK_S[0] <= v <= TTFT_SLACK_S[1] for v in learned["ttft_slack_s"].values()), learned
        assert all(TBT_MARGIN[0] <= v <= TBT_MARGIN[1] for v in learned["tbt_margins"].values()), learned
    finally:
        cluster.stop()
