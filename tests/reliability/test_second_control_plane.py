"""A second control plane, so that the first host is no single point of failure. Three
hosts, each a network namespace on one bridge (the test itself is a client on the bridge):

- A runs `kvserve up --listen ADDR --nats-cluster 3 --write-join-bundle join.json
  --write-control-bundle control.json --decode 0`: three nats-servers, a conductor, the
  store, a prefill worker and a gateway, with an API key (from the environment);
- B runs `kvserve join ADDR --bundle control.json --control-plane --decode 1`: a nats-server
  routed into A's cluster, a conductor replica, a gateway and a decode worker;
- C runs `kvserve join ADDR --bundle join.json --prefill 1 --decode 1`: workers only,
  knowing only A's nats-servers.

B's gateway must serve with A's API key, and B's conductor catch up from the KV history
in A's JetStream. With streams going through B's gateway, A's link
is taken down (`ip link set down`): every stream must end with [DONE] (migrated, or a clear
error) within the client's limit, none hangs, and new requests through B must be served
by B's and C's workers while A is out of reach (C's workers move to B's nats-server, which
A's cluster told them of). Restoring A's link brings A back. No credential of the
control-plane bundle may be on a command line or in a log. Bounded: 8 streams of 24
tokens, every wait with a deadline. Skipped, with the reason, where network namespaces
cannot be made.
"""

import asyncio
import json
import re
import secrets
import tempfile
import threading
import time
from pathlib import Path

import pytest

from kvserve.cli.heartbeats import HeartbeatWatcher
from kvserve.replay.streams import ChatLoad, run_streams, streams_with_a_fault, tally
from libs.common.tls import TlsFiles, mutual_context
from tests.integration.conftest import CLUSTER_ENV, wait_until
from tests.reliability import netns

MODEL = "SmolLM2-135M-Instruct"
LEASE_SECONDS = 8
CLIENT_LIMIT_S = 90  # a stream still open after this is a hang
START_LIMIT_S = 240
NUM_STREAMS, MAX_TOKENS = 8, 24
PROMPTS = [f"Write one sentence about the number {i}." for i in range(NUM_STREAMS)]
ENV = {**CLUSTER_ENV, "KVSERVE_LEASE_SECONDS": str(LEASE_SECONDS), "KVSERVE_TRANSFER_TIMEOUT": "4"}
A_IDS = {"conductor-0", "prefill-0", "gateway-0"}
B_IDS = {"conductor-host-b-0", "gateway-host-b-0", "decode-host-b-0"}
C_IDS = {"prefill-host-c-0", "decode-host-c-0"}


class Heard:
    """Every instance's last heartbeat time, from an observer connection of the test's own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.last: dict[str, float] = {}

    def __call__(self, beat) -> None:
        with self._lock:
            self.last[beat.instance_id] = time.monotonic()

    def since(self, moment: float) -> set[str]:
        with self._lock:
            return {i for i, at in self.last.items() if at > moment}


@pytest.fixture(scope="module")
def hosts():
    if (why := netns.available()) is not None:
        pytest.skip(why)
    net = netns.Network.create(3)
    directory = Path(tempfile.mkdtemp(prefix="kvserve-control-"))
    join, control = directory / "join.json", directory / "control.json"
    api_key = secrets.token_urlsafe(24)
    address_a, address_b = net.addresses[0], net.addresses[1]
    started: list[netns.HostProcess] = []
    watcher = None
    try:
        up = ["up", "--listen", address_a, "--nats-cluster", "3", "--write-join-bundle", str(join),
              "--write-control-bundle", str(control), "--prefill", "1", "--decode", "0", "--shared-prefill", "0",
              "--host", "0.0.0.0", "--port", "0", "--host-id", "host-a", "--no-standby"]  # fmt: skip
        a = netns.HostProcess(net.hosts[0], up, directory / "host-a.log", ENV | {"KVSERVE_API_KEY": api_key})
        started.append(a)
        port_a = a.wait_for(r"kvserve is up: http://\S*:(\d+)/v1", START_LIMIT_S)[1]
        second = ["join", address_a, "--bundle", str(control), "--control-plane", "--decode", "1", "--host", "0.0.0.0",
                  "--port", "0", "--host-id", "host-b", "--no-standby"]  # fmt: skip
        b = netns.HostProcess(net.hosts[1], second, directory / "host-b.log", ENV)
        started.append(b)
        port_b = b.wait_for(r"this host's gateway: http://\S*:(\d+)/v1", START_LIMIT_S)[1]
        nats_b = b.wait_for(r"nats-server-host-b listening on nats://(\S+)", START_LIMIT_S)[1]
        third = ["join", address_a, "--bundle", str(join), "--prefill", "1", "--decode", "1", "--host-id", "host-c",
                 "--no-standby"]  # fmt: skip
        c = netns.HostProcess(net.hosts[2], third, directory / "host-c.log", ENV)
        started.append(c)
        c.wait_for(r"joined the cluster", START_LIMIT_S)

        bundle = json.loads(control.read_text())
        tls = TlsFiles(*(str(directory / f"test-{name}.pem") for name in ("cert", "key", "ca")))
        for name in ("cert", "key", "ca"):
            Path(getattr(tls, name)).write_text(bundle["tls"][name])
        password = bundle["nats"]["passwords"]["observer"]
        servers = [f"{address_a}:{port}" for port in bundle["nats"]["ports"]] + [nats_b]
        heard = Heard()
        watcher = HeartbeatWatcher(",".join(f"nats://observer:{password}@{server}" for server in servers), heard,
                                   tls=mutual_context(tls, server=False))  # fmt: skip
        watcher.start()
        assert watcher.subscribed.wait(30) and watcher.error is None, watcher.error
        wait_until(lambda: A_IDS | B_IDS | C_IDS <= heard.since(0.0), 120)
        yield {"net": net, "a": a, "b": b, "c": c, "heard": heard, "api_key": api_key, "control": control,
               "url_a": f"http://{address_a}:{port_a}", "url_b": f"http://{address_b}:{port_b}"}  # fmt: skip
    finally:
        for host in reversed(started):
            host.stop()
        if watcher is not None:
            watcher.stop()
        net.remove()


def stream(base_url: str, api_key: str | None, prompt: str, max_tokens: int = 16):
    load = ChatLoad(base_url, MODEL, [prompt], max_tokens=max_tokens, api_key=api_key, timeout_s=CLIENT_LIMIT_S)
    return asyncio.run(run_streams(load))[0]


def test_the_second_gateway_serves_with_the_first_hosts_api_key(hosts):
    refused = stream(hosts["url_b"], None, "Name a color.")
    assert refused.status == 401, refused
    served = stream(hosts["url_b"], hosts["api_key"], "What is the capital of France?")
    assert served.completed and served.text, served
    assert stream(hosts["url_a"], hosts["api_key"], "Name a color.").completed


def test_the_second_conductor_catches_up_from_the_kv_history_in_the_first_hosts_jetstream(hosts):
    # its nats-server keeps no stream: the history is the first host's, reached over the routes
    caught_up = r"\[conductor-host-b-0\].*caught up from the KV history"
    wait_until(lambda: re.search(caught_up, hosts["b"].output()) is not None, 60)


def test_cutting_the_first_hosts_link_mid_stream_ends_every_stream_and_the_second_control_plane_serves_on(hosts):
    net, heard, api_key = hosts["net"], hosts["heard"], hosts["api_key"]
    load = ChatLoad(hosts["url_b"], MODEL, PROMPTS, max_tokens=MAX_TOKENS, api_key=api_key, timeout_s=CLIENT_LIMIT_S)

    cut_at = time.monotonic()
    outcomes = asyncio.run(streams_with_a_fault(load, lambda: net.cut(0), NUM_STREAMS // 2))
    for outcome in outcomes:
        assert outcome.done or outcome.errored_cleanly, f"stream {outcome.index} did not end: {outcome}"
        assert outcome.completed or outcome.error is not None, outcome
        assert outcome.ended_at - outcome.started_at < CLIENT_LIMIT_S
    assert tally(outcomes).completed >= 1, tally(outcomes).line()

    # With A out of reach, B and C carry the cluster: C's workers have moved to B's nats-server.
    ended = time.monotonic()
    wait_until(lambda: C_IDS <= heard.since(ended), 90)
    assert not A_IDS & heard.since(cut_at + 2 * LEASE_SECONDS), "A was heard through its cut link"

    def served_without_a() -> bool:
        again = stream(hosts["url_b"], api_key, "Name a color.", max_tokens=8)
        used = set((again.served_by or {}).get("prefill_instances", [])) | set(
            (again.served_by or {}).get("decode_instances", []))  # fmt: skip
        return again.completed and not used & A_IDS

    wait_until(served_without_a, 120)

    # Restoring the link brings A back: heard again, and its gateway serves.
    net.restore(0)
    restored = time.monotonic()
    wait_until(lambda: A_IDS <= heard.since(restored), 120)
    wait_until(lambda: stream(hosts["url_a"], api_key, "Name a color.", max_tokens=8).completed, 120)


def test_no_credential_of_the_control_plane_bundle_is_on_a_command_line_or_in_a_log(hosts):
    bundle = json.loads(hosts["control"].read_text())
    control = bundle["control"]
    secrets_ = [user["password"] for user in control["users"]] + [control["route_password"], hosts["api_key"]]
    secrets_ += list(bundle["nats"]["passwords"].values())
    secrets_.append(control["ca_key"].splitlines()[1])  # a line of the CA's key itself
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        assert not any(secret in text for secret in secrets_), f"a credential on the command line of {cmdline.parent}"
    for host in ("a", "b", "c"):
        assert not any(secret in hosts[host].output() for secret in secrets_), f"a credential in host {host}'s log"
    assert oct(hosts["control"].stat().st_mode & 0o777) == "0o600"
