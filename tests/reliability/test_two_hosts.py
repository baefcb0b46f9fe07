"""Two hosts on one machine, joined as the README's "Several machines" says: this host
runs `kvserve up --listen ADDR --write-join-bundle PATH` (nats-server, the conductor, the
store, the gateway and a prefill worker, no decode worker), the other — a network
namespace joined to this one by a veth pair — runs `kvserve join ADDR --bundle PATH
--decode 1` with the bundle's credentials. Every prompt's KV crosses the TCP data plane,
over mutual TLS, to a decode worker on the other host.

The answer must be the one-process engine's, token for token; no credential may be on a
command line; cutting the link in the middle of a hand-off must end the request within
the lease (a migration or a clear error, then [DONE]), never a hang; restoring the link
must restore service. Skipped, with the reason, where network namespaces cannot be made.
"""

import asyncio
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from kvserve.cli.cluster import LocalCluster
from kvserve.cli.supervisor import die_with_launcher
from kvserve.replay.streams import ChatLoad, run_streams
from tests.integration.conftest import CLUSTER_ENV, STARTED, metric_value, wait_until
from tests.integration.test_one_request import reference
from tests.reliability import netns

MODEL = "SmolLM2-135M-Instruct"
LEASE_SECONDS = 8
CLIENT_LIMIT_S = 90  # a stream still open after this is a hang
JOINED = "decode-host-b-0"  # the joined decode worker: its host's id in its instance id
FAULT_ENV = {
    "KVSERVE_LEASE_SECONDS": str(LEASE_SECONDS),
    "KVSERVE_TRANSFER_TIMEOUT": "4",
    "KVSERVE_FAILPOINTS": f"{JOINED}:transfer.stall_first_receive",
}


class JoinedHost:
    """`kvserve join` running in the other network namespace, its output in a file."""

    def __init__(self, netns_name: str, first_host: str, bundle: Path, directory: Path) -> None:
        self.log = directory / "join.log"
        command = [str(Path(sys.executable).parent / "kvserve"), "join", first_host, "--bundle", str(bundle),
                   "--decode", "1", "--host-id", "host-b", "--no-standby"]  # fmt: skip
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", netns_name, *command],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, **CLUSTER_ENV, **FAULT_ENV}, preexec_fn=die_with_launcher(),
        )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # as Ctrl-C: its workers drain
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def two_hosts():
    if (why := netns.available()) is not None:
        pytest.skip(why)
    host = netns.SecondHost.create()
    directory = Path(tempfile.mkdtemp(prefix="kvserve-two-hosts-"))
    bundle = directory / "join.json"
    cluster = LocalCluster(
        prefill=1, decode=0, gateway_port=0, dtype="float32", log=None, supervise=True, standby=False,
        listen=host.local_address, join_bundle=bundle, host_id="host-a", store_dir=directory / "stores",
        env={**CLUSTER_ENV, **FAULT_ENV},
    )  # fmt: skip
    STARTED.append(cluster)
    joined = None
    try:
        cluster.start(timeout=180)
        joined = JoinedHost(host.netns, host.local_address, bundle, directory)
        try:
            cluster.wait_for(lambda beats: JOINED in beats, timeout=180)
        except TimeoutError:
            pytest.fail(f"{JOINED} never reported to the cluster; kvserve join said:\n{joined.output()[-3000:]}")
        yield cluster, host, joined, bundle
    finally:
        if joined is not None:
            joined.stop()
        cluster.stop()
        host.remove()


def stream(cluster: LocalCluster, prompt: str, max_tokens: int = 16):
    load = ChatLoad(cluster.gateway_url, MODEL, [prompt], max_tokens=max_tokens, timeout_s=CLIENT_LIMIT_S)
    return asyncio.run(run_streams(load))[0]


def test_the_decode_worker_on_the_joined_host_gets_its_kv_over_tcp_and_a_cut_link_ends_in_an_error_not_a_hang(
    two_hosts,
):
    cluster, host, joined, _ = two_hosts
    assert cluster.instances[JOINED].host_id == "host-b"
    assert cluster.instances["prefill-0"].host_id == "host-a"

    # 1. The first hand-off stalls on the joined worker (failpoint); the link is cut while it hangs.
    stalled = lambda: "not reading" in joined.output()  # noqa: E731
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

    # 2. Restoring the link restores service: the joined worker reports in again and serves over TCP.
    host.restore()
    cut_over = cluster.last_seen.get(JOINED, 0.0)
    cluster.wait_for(lambda hbs: cluster.last_seen.get(JOINED, 0.0) > cut_over, timeout=60)

    def serves() -> bool:
        again = stream(cluster, "Name a color.", max_tokens=8)
        return again.completed and (again.served_by or {}).get("decode_instances") == [JOINED]

    wait_until(serves, timeout=60)
    metrics = asyncio.run(_metrics(cluster.gateway_url))
    tcp_bytes = metric_value(metrics, "kvserve_transfer_bytes_total", transport="tcp", instance="prefill-0")
    assert tcp_bytes > 0, "no KV crossed the TCP data plane"


def test_a_joined_host_answers_as_one_process_does_over_tls_with_no_credential_on_a_command_line(two_hosts, smollm):
    cluster, _, joined, bundle = two_hosts
    messages = [{"role": "user", "content": "Name three things that are red."}]
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}).encode()
    request = urllib.request.Request(cluster.gateway_url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=CLIENT_LIMIT_S) as response:
        answer = json.load(response)
    assert answer["kvserve"]["decode_instances"] == [JOINED]  # the KV went to the other host
    assert answer["choices"][0]["message"]["content"] == reference(smollm, messages, 24)

    # the joined worker's data plane speaks mutual TLS: a client with the bundle's leaf gets in, one without is refused
    listening = re.search(r"transfer listener on (\S+):(\d+) \(TLS\)", joined.output())
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
    secrets_.append(json.loads(bundle.read_text())["tls"]["key"].splitlines()[1])  # a line of the key itself
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        assert not any(secret in text for secret in secrets_), f"a credential on the command line of {cmdline.parent}"
    assert not any(secret in joined.output() for secret in secrets_)
    assert oct(bundle.stat().st_mode & 0o777) == "0o600"


def _client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # peers are addresses (libs/transfer/tcp/tls.py)
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
