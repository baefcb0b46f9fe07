"""Two hosts on one machine: nats-server, the conductor, the store, the gateway and a
prefill worker on this host, the decode worker in another network namespace with its
own host id, joined by a veth pair — so the prompt's KV crosses the TCP data plane.

Cutting the link in the middle of a hand-off must end the request within the lease
(a migration or a clear error, then [DONE]), never a hang; restoring the link must
restore service. Skipped, with the reason, where network namespaces cannot be made.
"""

import asyncio
import json
import tempfile

import pytest

from kvserve.cli.cluster import LocalCluster
from kvserve.replay.streams import ChatLoad, run_streams
from tests.integration.conftest import CLUSTER_ENV, STARTED, metric_value, wait_until
from tests.reliability import netns

MODEL = "SmolLM2-135M-Instruct"
LEASE_SECONDS = 8
CLIENT_LIMIT_S = 90  # a stream still open after this is a hang


@pytest.fixture(scope="module")
def two_hosts():
    if (why := netns.available()) is not None:
        pytest.skip(why)
    host = netns.SecondHost.create()
    plan = {"decode-0": {"netns": host.netns, "host_id": "host-b", "transfer_host": host.remote_address}}
    cluster = LocalCluster(
        prefill=1, decode=1, gateway_port=0, dtype="auto", log=None, supervise=True,
        standby=False,  # a spare runs where the launcher does: it cannot replace decode-0 on the other "host"
        nats_host=host.local_address, store_dir=tempfile.mkdtemp(prefix="kvserve-two-hosts-"),
        modules={"decode": "tests.reliability.in_netns"},
        env={
            **CLUSTER_ENV,
            "KVSERVE_HOST_ID": "host-a",
            "KVSERVE_TRANSFER_HOST": host.local_address,
            "KVSERVE_TEST_NETNS_PLAN": json.dumps(plan),
            "KVSERVE_LEASE_SECONDS": str(LEASE_SECONDS),
            "KVSERVE_TRANSFER_TIMEOUT": "4",
            "KVSERVE_FAILPOINTS": "decode-0:transfer.stall_first_receive",
        },
    )  # fmt: skip
    STARTED.append(cluster)
    try:
        cluster.start(timeout=180)
        yield cluster, host
    finally:
        cluster.stop()
        host.remove()


def stream(cluster: LocalCluster, prompt: str, max_tokens: int = 16):
    load = ChatLoad(cluster.gateway_url, MODEL, [prompt], max_tokens=max_tokens, timeout_s=CLIENT_LIMIT_S)
    return asyncio.run(run_streams(load))[0]


def test_the_decode_worker_on_another_host_gets_its_kv_over_tcp_and_a_cut_link_ends_in_an_error_not_a_hang(
    two_hosts,
):
    cluster, host = two_hosts
    assert cluster.instances["decode-0"].host_id == "host-b"
    assert cluster.instances["prefill-0"].host_id == "host-a"

    # 1. The first hand-off stalls on decode-0 (failpoint); the link is cut while it hangs.
    stalled = lambda: any("not reading" in line for line in cluster.logs("decode-0"))  # noqa: E731
    result = {}

    async def cut_mid_handoff():
        task = asyncio.create_task(asyncio.to_thread(stream, cluster, "Tell me about the sea."))
        await asyncio.to_thread(wait_until, stalled, 60)
        host.cut()
        result["outcome"] = await task

    asyncio.run(cut_mid_handoff())
    outcome = result["outcome"]
    assert outcome.done, f"the stream did not end with [DONE]: {outcome}"
    assert outcome.error is not None or outcome.completed, outcome
    assert outcome.ended_at - outcome.started_at < CLIENT_LIMIT_S

    # 2. Restoring the link restores service: decode-0 reports in again and serves over TCP.
    host.restore()
    cut_over = cluster.last_seen.get("decode-0", 0.0)
    cluster.wait_for(lambda hbs: cluster.last_seen.get("decode-0", 0.0) > cut_over, timeout=60)

    def serves() -> bool:
        again = stream(cluster, "Name a color.", max_tokens=8)
        return again.completed and (again.served_by or {}).get("decode_instances") == ["decode-0"]

    wait_until(serves, timeout=60)
    metrics = asyncio.run(_metrics(cluster.gateway_url))
    tcp_bytes = metric_value(metrics, "kvserve_transfer_bytes_total", transport="tcp", instance="prefill-0")
    assert tcp_bytes > 0, "no KV crossed the TCP data plane"


async def _metrics(base_url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(base_url + "/metrics") as response:
            assert response.status == 200
            return await response.text()
