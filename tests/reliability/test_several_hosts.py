"""Three hosts on one machine, joined as the README's "Several machines" says. This host
(A) runs `kvserve up --listen ADDR --nats-cluster 3 --write-join-bundle PATH`: three
nats-servers, the conductor, the store, the gateway and a prefill worker, no decode
worker. Host B, a network namespace on a bridge with this one, runs `kvserve join ADDR
--bundle PATH --decode 1`; host C, another, joins later with `--prefill 1 --decode 1`.
A's prompts' KV crosses the TCP data plane to B's or C's decode worker; NATS and the data
plane between hosts speak mutual TLS.

The answers must be the one-process engine's, token for token; no credential may be on a
command line. Cutting B's link in the middle of a hand-off must end the request within
the lease (a migration or a clear error, then [DONE]), never a hang, and restoring it must
restore service; killing a nats-server under load must lose no stream; cutting C's link
mid-stream under load must end every stream with [DONE] (C's moved to B or ended with a
clear error), and restoring it must bring C back. Bounded: at most 8 streams of 24
tokens at once, every wait with a deadline. Skipped, with the reason, where network
namespaces cannot be made.
"""

import asyncio
import json
import os
import re
import signal
import socket
import ssl
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from kvserve.cli.cluster import LocalCluster
from kvserve.replay.streams import ChatLoad, run_streams, streams_with_a_fault, tally
from tests.integration.conftest import CLUSTER_ENV, STARTED, metric_value, wait_until
from tests.integration.test_one_request import reference
from tests.reliability import netns

MODEL = "SmolLM2-135M-Instruct"
LEASE_SECONDS = 8
CLIENT_LIMIT_S = 90  # a stream still open after this is a hang
NATS_RESTART_DELAY_S = 15.0  # the streams must not wait for a killed nats-server's restart
B, C = "host-b", "host-c"
DECODE_B, DECODE_C, PREFILL_C = "decode-host-b-0", "decode-host-c-0", "prefill-host-c-0"  # ids name their hosts
FAULT_ENV = {
    "KVSERVE_LEASE_SECONDS": str(LEASE_SECONDS),
    "KVSERVE_TRANSFER_TIMEOUT": "4",
    "KVSERVE_FAILPOINTS": f"{DECODE_B}:transfer.stall_first_receive",
}
NUM_STREAMS, MAX_TOKENS = 8, 24
PROMPTS = [f"Write one sentence about the number {i}." for i in range(NUM_STREAMS)]


class JoinedHost(netns.HostProcess):
    """`kvserve join` running in another network namespace, its output beside the bundle."""

    def __init__(self, netns_name: str, first_host: str, bundle: Path, host_id: str, workers: list[str]) -> None:
        super().__init__(netns_name, ["join", first_host, "--bundle", str(bundle), *workers, "--host-id", host_id,
                                      "--no-standby"],
                         bundle.with_name(f"join-{host_id}.log"), {**CLUSTER_ENV, **FAULT_ENV})  # fmt: skip


def _join(cluster: LocalCluster, joined: JoinedHost, *instance_ids: str) -> JoinedHost:
    try:
        cluster.wait_for(lambda beats: set(instance_ids) <= set(beats), timeout=180)
    except TimeoutError:
        pytest.fail(f"{instance_ids} never reported to the cluster; kvserve join said:\n{joined.output()[-3000:]}")
    return joined


@pytest.fixture(scope="module")
def hosts():
    """A, with B joined."""
    if (why := netns.available()) is not None:
        pytest.skip(why)
    net = netns.Network.create(2)
    directory = Path(tempfile.mkdtemp(prefix="kvserve-hosts-"))
    bundle = directory / "join.json"
    cluster = LocalCluster(
        prefill=1, decode=0, gateway_port=0, dtype="float32", log=None, supervise=True, standby=False,
        listen=net.address, join_bundle=bundle, host_id="host-a", nats_servers=3, store_dir=directory / "stores",
        restart_delays=(NATS_RESTART_DELAY_S, NATS_RESTART_DELAY_S), env={**CLUSTER_ENV, **FAULT_ENV},
    )  # fmt: skip
    STARTED.append(cluster)
    joined: list[JoinedHost] = []
    try:
        cluster.start(timeout=180)
        joined.append(JoinedHost(net.hosts[0], net.address, bundle, B, ["--decode", "1"]))
        _join(cluster, joined[0], DECODE_B)
        yield cluster, net, joined, bundle
    finally:
        for host in joined:
            host.stop()
        cluster.stop()
        net.remove()


@pytest.fixture(scope="module")
def three_hosts(hosts):
    """A and B, with C joined (after the first test: B's first hand-off is the one that stalls)."""
    cluster, net, joined, bundle = hosts
    if len(joined) == 1:
        joined.append(JoinedHost(net.hosts[1], net.address, bundle, C, ["--prefill", "1", "--decode", "1"]))
        _join(cluster, joined[1], DECODE_C, PREFILL_C)
    return hosts


def stream(cluster: LocalCluster, prompt: str, max_tokens: int = 16):
    load = ChatLoad(cluster.gateway_url, MODEL, [prompt], max_tokens=max_tokens, timeout_s=CLIENT_LIMIT_S)
    return asyncio.run(run_streams(load))[0]


def test_a_decode_worker_on_a_joined_host_gets_its_kv_over_tcp_and_a_cut_link_ends_in_an_error_not_a_hang(hosts):
    cluster, net, joined, _ = hosts
    assert cluster.instances[DECODE_B].host_id == B
    assert cluster.instances["prefill-0"].host_id == "host-a"

    # 1. The first hand-off stalls on B's worker (failpoint); B's link is cut while it hangs.
    stalled = lambda: "not reading" in joined[0].output()  # noqa: E731
    result = {}

    async def cut_mid_handoff():
        task = asyncio.create_task(asyncio.to_thread(stream, cluster, "Tell me about the sea."))
        await asyncio.to_thread(wait_until, stalled, 60)
        net.cut(0)
        result["outcome"] = await task

    asyncio.run(cut_mid_handoff())
    outcome = result["outcome"]
    assert outcome.done, f"the stream did not end with [DONE]: {outcome}"
    assert outcome.error is not None or outcome.completed, outcome
    assert outcome.ended_at - outcome.started_at < CLIENT_LIMIT_S

    # 2. Restoring the link restores service: B's worker reports in again and serves over TCP.
    net.restore(0)
    _heard_again(cluster, DECODE_B)

    def serves() -> bool:
        again = stream(cluster, "Name a color.", max_tokens=8)
        return again.completed and (again.served_by or {}).get("decode_instances") == [DECODE_B]

    wait_until(serves, timeout=60)
    metrics = asyncio.run(_metrics(cluster.gateway_url))
    tcp_bytes = metric_value(metrics, "kvserve_transfer_bytes_total", transport="tcp", instance="prefill-0")
    assert tcp_bytes > 0, "no KV crossed the TCP data plane"


def test_joined_hosts_answer_as_one_process_does_over_tls_with_no_credential_on_a_command_line(three_hosts, smollm):
    cluster, _, joined, bundle = three_hosts
    assert {cluster.instances[i].host_id for i in (PREFILL_C, DECODE_C)} == {C}
    served = set()
    for prompt in ("Name three things that are red.", "What is the capital of France?", "Count to five."):
        messages = [{"role": "user", "content": prompt}]
        answer = _chat(cluster, messages, 24)
        assert answer["choices"][0]["message"]["content"] == reference(smollm, messages, 24), prompt
        served.update(answer["kvserve"]["decode_instances"])
    assert served <= {DECODE_B, DECODE_C}  # host A runs no decode worker: every answer came from another host

    # a joined worker's data plane speaks mutual TLS: a client with the bundle's leaf gets in, one without is refused
    listening = re.search(r"transfer listener on (\S+):(\d+) \(TLS\)", joined[0].output())
    assert listening is not None, "the joined worker's data plane is not TLS"
    address = (listening[1], int(listening[2]))
    tls = json.loads(bundle.read_text())["tls"]
    files = {name: bundle.with_name(f"probe-{name}.pem") for name in tls}
    for name, path in files.items():
        path.write_text(tls[name])
    member = _client_context(files["ca"], files["cert"], files["key"])
    with socket.create_connection(address, timeout=10) as raw, member.wrap_socket(raw) as session:
        assert session.version() == "TLSv1.3"
    stranger = _client_context(files["ca"])
    try:
        with socket.create_connection(address, timeout=10) as raw, stranger.wrap_socket(raw) as session:
            refused = session.recv(1) == b""  # TLS 1.3: the server's refusal comes after the handshake
    except (ssl.SSLError, ConnectionError):
        refused = True
    assert refused, "a client with no certificate got a data-plane session"

    secrets_ = list(json.loads(bundle.read_text())["nats"]["passwords"].values())
    secrets_.append(tls["key"].splitlines()[1])  # a line of the key itself
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        assert not any(secret in text for secret in secrets_), f"a credential on the command line of {cmdline.parent}"
    assert not any(secret in host.output() for host in joined for secret in secrets_)
    assert oct(bundle.stat().st_mode & 0o777) == "0o600"


def test_killing_a_nats_server_under_load_loses_no_stream_on_any_host(three_hosts):
    cluster, _, _, _ = three_hosts
    old_pid = cluster.nats_pids[1]
    load = ChatLoad(cluster.gateway_url, MODEL, PROMPTS, max_tokens=MAX_TOKENS, timeout_s=CLIENT_LIMIT_S)

    outcomes = asyncio.run(streams_with_a_fault(load, lambda: os.kill(old_pid, signal.SIGKILL), NUM_STREAMS // 2))
    result = tally(outcomes)
    assert result.completed == NUM_STREAMS, result.line()
    assert cluster.nats_pids[1] == old_pid, "the streams waited for the killed server's restart"


def test_cutting_a_hosts_link_mid_stream_ends_every_stream_and_restoring_it_brings_the_host_back(three_hosts):
    cluster, net, _, _ = three_hosts
    load = ChatLoad(cluster.gateway_url, MODEL, PROMPTS, max_tokens=MAX_TOKENS, timeout_s=CLIENT_LIMIT_S)

    # host C: its prefill and decode workers drop off mid-stream
    outcomes = asyncio.run(streams_with_a_fault(load, lambda: net.cut(1), NUM_STREAMS // 2))
    for outcome in outcomes:
        assert outcome.done or outcome.errored_cleanly, f"stream {outcome.index} did not end: {outcome}"
        assert outcome.completed or outcome.error is not None, outcome
        assert outcome.ended_at - outcome.started_at < CLIENT_LIMIT_S
    assert tally(outcomes).completed >= 1  # B and A kept serving

    net.restore(1)
    _heard_again(cluster, DECODE_C)
    _heard_again(cluster, PREFILL_C)
    wait_until(lambda: stream(cluster, "Name a color.", max_tokens=8).completed, timeout=60)


def _heard_again(cluster: LocalCluster, instance_id: str) -> None:
    after = time.monotonic()
    cluster.wait_for(lambda beats: cluster.last_seen.get(instance_id, 0.0) > after, timeout=60)


def _chat(cluster: LocalCluster, messages: list[dict], max_tokens: int) -> dict:
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(cluster.gateway_url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=CLIENT_LIMIT_S) as response:
        return json.load(response)


def _client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # peers are addresses (libs/common/tls.py)
    context.load_verify_locations(cafile=ca)
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


async def _metrics(base_url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(base_url + "/metrics") as response:
            assert response.status == 200
            return await response.text()
