"""A conductor killed and started again learns what every instance holds from the KV
history in JetStream (libs/common/kv_history.py): the same KV map as before, without
asking any instance for a snapshot."""

import asyncio
import signal

import nats

from libs.protocol import schema, subjects
from libs.protocol.schema import ConductorViewReply, ConductorViewRequest, KVSnapshotReply, KVSnapshotRequest
from tests.integration.conftest import start_cluster, wait_until

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["Name three rivers in Europe.", "What is a prime number?"]


def kv_map(cluster) -> dict:
    """conductor-0's KV index, counted by instance and tier."""

    async def ask() -> dict:
        nc = await nats.connect(cluster.nats_url)
        try:
            msg = await nc.request(subjects.conductor_view("conductor-0"), schema.encode(ConductorViewRequest()), 10)
        finally:
            await nc.close()
        return schema.decode(msg.data, ConductorViewReply).blocks

    return asyncio.run(ask())


def held(cluster) -> dict:
    """What prefill-0 and store-0 hold, by their own account (their snapshots), counted as kv_map counts."""

    async def ask() -> dict:
        nc = await nats.connect(cluster.nats_url)
        counts = {}
        try:
            for instance_id in ("prefill-0", "store-0"):
                request = schema.encode(KVSnapshotRequest(instance_id=instance_id))
                msg = await nc.request(subjects.kv_snapshot(instance_id), request, 10)
                reply = schema.decode(msg.data, KVSnapshotReply)
                counts[instance_id] = {tier: len(hashes) for tier, hashes in reply.tiers.items() if hashes}
        finally:
            await nc.close()
        return counts

    return asyncio.run(ask())


def test_a_restarted_conductor_catches_up_from_the_kv_history_without_a_snapshot():
    from openai import OpenAI

    cluster = start_cluster()
    try:
        client = OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt in PROMPTS:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4)
        before = kv_map(cluster)
        assert before.get("prefill-0") and before.get("store-0"), before  # the requests left KV behind

        cluster.kill("conductor-0", signal.SIGKILL)
        cluster.restart("conductor-0")

        def catch_ups() -> list[int]:  # where each run of conductor-0 said it had read the history
            return [i for i, line in enumerate(cluster.logs("conductor-0")) if "caught up from the KV history" in line]

        wait_until(lambda: len(catch_ups()) == 2, timeout=60)  # the first run's (an empty history) and the new one's
        caught_up = cluster.logs("conductor-0")[catch_ups()[-1]]
        assert " 0 checkpoints" not in caught_up, caught_up  # prefill-0's and store-0's, at least
        wait_until(lambda: kv_map(cluster) == held(cluster), timeout=30)  # the store may still be writing to disk
        since = cluster.logs("conductor-0")[catch_ups()[-1]:]
        assert not any("fetching its snapshot" in line for line in since), since
    finally:
        cluster.stop()
