"""A NATS cluster (`kvserve up --nats-cluster 3`): three nats-servers routed to one
another, every service given every server's URL. Killing one under load loses no
request: its clients move to another server, the streams go on (resent or moved),
and the supervisor starts the dead one again, which rejoins the cluster.
Bounded: 16 streams of at most 32 tokens, every wait has a deadline.
"""

import asyncio
import os
import signal
import tempfile
import time

import pytest

from kvserve.cli.cluster import LocalCluster
from kvserve.replay.streams import ChatLoad, streams_with_a_fault, tally
from tests.integration.conftest import CLUSTER_ENV, STARTED

MODEL = "SmolLM2-135M-Instruct"
NUM_STREAMS = 16
MAX_TOKENS = 32
RESTART_DELAY_S = 15.0
PROMPTS = [f"Write one sentence about the number {i}." for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def nats_cluster():
    cluster = LocalCluster(
        prefill=1, decode=1, gateway_port=0, dtype="auto", env=CLUSTER_ENV, log=None, supervise=True,
        store_dir=tempfile.mkdtemp(prefix="kvserve-nats-cluster-"), nats_servers=3, standby=False,
        restart_delays=(RESTART_DELAY_S, RESTART_DELAY_S),  # the streams must not wait for the killed server
    )  # fmt: skip
    STARTED.append(cluster)
    cluster.start(timeout=180)
    yield cluster
    cluster.stop()


def _servers_of(cluster: LocalCluster) -> list[str]:
    """The URL each service instance was given (every server of the NATS cluster)."""
    return [cluster._instance(i).env["KVSERVE_NATS_URL"] for i in cluster.instance_ids]


def test_every_service_is_given_every_server_and_no_credential(nats_cluster):
    urls = _servers_of(nats_cluster)
    assert len(set(urls)) == 1
    servers = urls[0].split(",")
    assert len(servers) == 3 and len(set(servers)) == 3
    assert all("@" not in server for server in servers)  # the password is in each instance's credentials file
    assert len(set(nats_cluster.nats_pids)) == 3


def test_killing_one_nats_server_under_load_loses_no_request(nats_cluster):
    # the first: the one every URL list starts with (test_several_hosts.py kills the second, across hosts)
    cluster, victim = nats_cluster, 0
    old_pid = cluster.nats_pids[victim]
    load = ChatLoad(cluster.gateway_url, MODEL, PROMPTS, max_tokens=MAX_TOKENS)

    outcomes = asyncio.run(streams_with_a_fault(load, lambda: os.kill(old_pid, signal.SIGKILL), NUM_STREAMS // 2))
    result = tally(outcomes)
    assert result.completed == NUM_STREAMS, f"nats-server-{victim}: {result.line()}"
    assert cluster.nats_pids[victim] == old_pid, "the streams waited for the killed server's restart"
    cluster.wait_for(lambda hbs: cluster.nats_pids[victim] not in (None, old_pid), timeout=RESTART_DELAY_S + 30)
    # every service is heard from again, whichever server it now uses
    after = time.monotonic()
    cluster.wait_for(lambda hbs: all(cluster.last_seen.get(i, 0.0) > after for i in cluster.instance_ids), timeout=30)
