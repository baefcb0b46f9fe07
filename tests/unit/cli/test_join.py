"""Several hosts: `kvserve up --listen --write-join-bundle` and `kvserve join`, on stand-in
services (fake_service.py) and a real nats-server, both "hosts" on this one (the test of
three real hosts, in network namespaces, is tests/reliability/test_several_hosts.py)."""

import asyncio
import io
import json
import logging
import os
import signal
import socket
import ssl
import time

import msgspec
import nats
import pytest

from kvserve.cli import join, up
from kvserve.cli.cluster import LocalCluster, instance_tag
from kvserve.cli.join_bundle import (
    VERSION,
    BundleModel,
    BundleNats,
    BundleTls,
    JoinBundle,
    JoinBundleError,
    read_bundle,
    write_bundle,
)
from kvserve.cli.main import build_parser
from libs.common.certificates import ClusterCA, Leaf
from libs.common.nats_auth import load_credentials
from libs.common.nats_server import NatsCluster, NatsServer, Routes
from libs.common.tls import mutual_context
from libs.transfer.tcp.tls import DataPlaneTls
from tests.unit.cli.harness import FAKE, ROOT, make_cluster
from tests.unit.cli.test_cluster import settings_of


@pytest.fixture(scope="module")
def first_and_joined(model_dir, tmp_path_factory):
    bundle = tmp_path_factory.mktemp("join") / "join.json"
    first = make_cluster(model_dir, io.StringIO(), prefill=1, decode=0, listen="127.0.0.1", join_bundle=bundle,
                         host_id="host-a", nats_servers=3)  # fmt: skip (three: their routes speak TLS too)
    first.start(timeout=60)
    joined = None
    try:
        joined = LocalCluster(
            prefill=1, decode=2, store=True, member=read_bundle(bundle), member_host="127.0.0.1", listen="127.0.0.1",
            host_id="rack2.node7", model=str(model_dir), dtype="float32", log=io.StringIO(),
            modules={role: FAKE for role in ("prefill", "decode", "store")}, env={"PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        joined.start(timeout=60)
        yield first, joined, bundle
    finally:
        if joined is not None:
            joined.stop()
        first.stop()


def test_a_joined_host_runs_only_its_workers_named_for_it_and_the_first_host_sees_them(first_and_joined):
    first, joined, _ = first_and_joined
    assert joined.instance_ids == ["store-rack2-node7-0", "prefill-rack2-node7-0", "decode-rack2-node7-0",
                                   "decode-rack2-node7-1"]  # fmt: skip
    assert joined.nats_pids == [] and joined.gateway_url == ""  # the first host's nats-server and gateway serve
    first.wait_for(lambda beats: set(joined.instance_ids) <= set(beats), timeout=30)
    assert {first.instances[i].host_id for i in joined.instance_ids} == {"rack2.node7"}
    assert {first.instances[i].host_id for i in first.instance_ids} == {"host-a"}
    assert "decode-0" not in first.instances  # the first host runs none: --decode 0 with --listen


def test_workers_on_both_hosts_listen_on_the_given_address_with_tls_and_reach_the_first_hosts_nats(first_and_joined):
    first, joined, _ = first_and_joined
    for cluster in (first, joined):
        for instance_id in cluster.instance_ids:
            s = settings_of(cluster, instance_id)
            assert s["NATS_URL"] == first._nats.public_url  # no credential: those are in its credentials file
            assert s["DTYPE"] == "float32"
            if instance_id.split("-")[0] in ("prefill", "decode", "store"):
                assert s["TRANSFER_HOST"] == "127.0.0.1"
                assert s["TRANSFER_TLS_CERT"].startswith(str(cluster.runtime_dir))
            else:
                assert (s["TRANSFER_HOST"], s["TRANSFER_TLS_CERT"]) == ("-", "-")


def test_the_bundle_is_private_and_holds_role_users_and_a_leaf_of_the_clusters_ca(first_and_joined):
    first, _, bundle_path = first_and_joined
    assert bundle_path.stat().st_mode & 0o777 == 0o600
    bundle = read_bundle(bundle_path)
    assert (bundle.host, bundle.host_id, bundle.model.dtype) == ("127.0.0.1", "host-a", "float32")
    assert len(bundle.nats.ports) == 3  # a joined worker fails over between the servers as the first host's do
    assert set(bundle.nats.passwords) == {"prefill", "decode", "store", "observer"}  # no admin, no conductor, no gateway
    assert bundle.nats_urls() == first._nats.public_url
    # the leaf and the first host's own are signed by one CA: a TLS session between them works
    own = first._tls_files
    assert open(own.ca).read() == bundle.tls.ca
    tls_dir = bundle_path.parent / "leaf"
    member = DataPlaneTls(Leaf(bundle.tls.cert, bundle.tls.key, bundle.tls.ca).write(tls_dir))
    host = DataPlaneTls(own)
    _handshake(server=host.server, client=member.client)
    _handshake(server=member.server, client=host.client)
    # the joined host's users are the bundle's, one per role (its instances' ids are made there)
    _, joined, _ = first_and_joined
    creds = load_credentials(joined._nats.credentials_file("decode-rack2-node7-1"))
    assert (creds.user, creds.password) == ("decode", bundle.nats.passwords["decode"])


def test_nats_between_hosts_takes_only_clients_with_a_certificate_of_the_clusters_ca(first_and_joined, tmp_path):
    _, _, bundle_path = first_and_joined
    bundle = read_bundle(bundle_path)
    member = mutual_context(Leaf(bundle.tls.cert, bundle.tls.key, bundle.tls.ca).write(tmp_path / "member"), False)
    stranger = ClusterCA.create("rogue").issue("x")  # signed by another CA
    rogue = mutual_context(Leaf(stranger.cert, stranger.key, bundle.tls.ca).write(tmp_path / "rogue"), False)
    nameless = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # trusts the CA, presents no certificate
    nameless.check_hostname = False
    nameless.load_verify_locations(cadata=bundle.tls.ca)

    async def connects(tls: ssl.SSLContext | None) -> bool:
        async def quiet(e: Exception) -> None:
            pass

        options = {"tls": tls} if tls is not None else {}
        try:
            nc = await nats.connect(bundle.nats_urls().split(","), user="observer", password=bundle.nats.passwords["observer"],
                                    allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5,
                                    error_cb=quiet, **options)  # fmt: skip
        except Exception:
            return False
        await nc.flush(timeout=5)  # TLS 1.3: a refused client certificate shows after the handshake
        await nc.close()
        return True

    assert asyncio.run(connects(member))
    assert [asyncio.run(connects(tls)) for tls in (None, nameless, rogue)] == [False, False, False]


def test_a_bundle_without_tls_joins_over_plain_tcp_and_a_bad_bundle_is_refused_with_the_reason(tmp_path, caplog):
    good = tmp_path / "good.json"
    leaf = ClusterCA.create().issue("x")
    bundle = JoinBundle(version=VERSION, host="10.0.0.1", host_id="a",
                        nats=BundleNats(ports=[4222, 4223], passwords={u: "pw-" + u for u in
                                                                       ("prefill", "decode", "store", "observer")}),
                        model=BundleModel(spec=None, dtype="bfloat16", quantization="int4-g32"),
                        tls=BundleTls(leaf.cert, leaf.key, leaf.ca))  # fmt: skip
    write_bundle(good, bundle)
    assert read_bundle(good) == bundle
    assert bundle.nats_urls("head.lan") == "nats://head.lan:4222,nats://head.lan:4223"
    good.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        read_bundle(good)
    assert "open to other users" in caplog.text and "pw-" not in caplog.text
    plain = LocalCluster(decode=1, member=msgspec.structs.replace(bundle, tls=None), member_host="h",
                         listen="10.0.0.2", host_id="b")  # fmt: skip
    assert plain.tls is False  # the first host said --no-tls: its listeners take no TLS
    for text, reason in [
        ("{", "not JSON"),
        ('{"version": 1}', "missing required field"),
        (json.dumps({**json.loads(good.read_text()), "version": 9}), "version 9"),
        (json.dumps({**json.loads(good.read_text()), "nats": {"ports": [1], "passwords": {"decode": "p"}}}),
         "no NATS user for prefill, store, observer"),
    ]:  # fmt: skip
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(JoinBundleError, match=reason):
            read_bundle(bad)
    with pytest.raises(JoinBundleError, match="cannot read the join bundle"):
        read_bundle(tmp_path / "missing.json")


@pytest.fixture(scope="module")
def first_and_control(model_dir, tmp_path_factory):
    """A first host that writes a control-plane bundle, and a host that runs a second control plane from it."""
    directory = tmp_path_factory.mktemp("control")
    bundle = directory / "control.json"
    first = make_cluster(model_dir, io.StringIO(), prefill=1, decode=0, listen="127.0.0.1", host_id="host-a",
                         nats_servers=3, control_bundle=bundle, join_bundle=directory / "join.json", api_key="k3y")  # fmt: skip
    first.start(timeout=60)
    second, log = None, io.StringIO()
    try:
        second = make_cluster(model_dir, log, prefill=0, decode=1, store=False, member=read_bundle(bundle),
                              member_host="127.0.0.1", listen="127.0.0.1", host_id="host-b", control_plane=True)  # fmt: skip
        second.start(timeout=60)
        yield first, second, bundle, log
    finally:
        if second is not None:
            second.stop()
        first.stop()


def test_a_control_plane_host_runs_a_routed_nats_server_a_conductor_and_a_gateway_with_the_first_hosts_key(
    first_and_control,
):
    first, second, _, log = first_and_control
    assert "nats-server-host-b listening" in log.getvalue() and "no route" not in log.getvalue()  # routed, then started
    assert second.instance_ids == ["conductor-host-b-0", "decode-host-b-0", "gateway-host-b-0"]
    assert len(second.nats_pids) == 1 and second.gateway_url.startswith("http://127.0.0.1:")
    first.wait_for(lambda beats: set(second.instance_ids) <= set(beats), timeout=30)
    for instance_id in second.instance_ids:
        s = settings_of(second, instance_id)
        own, *firsts = s["NATS_URL"].split(",")
        assert own == second._nats.servers[0].public_url and ",".join(firsts) == first._nats.public_url
        assert s["NATS_IN_ORDER"] == "1"  # its own server first: the first host's only once that is out of reach
    assert settings_of(second, "gateway-host-b-0")["API_KEY"] == "k3y"
    assert settings_of(second, "conductor-host-b-0")["API_KEY"] == "-"
    assert settings_of(first, "prefill-0")["NATS_IN_ORDER"] == "0"


def test_the_control_plane_bundle_holds_every_nats_user_the_route_secret_and_the_cas_key(first_and_control):
    first, _, path, _ = first_and_control
    assert path.stat().st_mode & 0o777 == 0o600
    bundle = read_bundle(path)
    control = bundle.control
    assert {user.identity: user.password for user in control.users} == first._nats.servers[0].users
    assert {"conductor", "gateway"} <= {user.instance_id or user.role for user in control.users}  # role users too
    assert set(bundle.nats.passwords) == {"prefill", "decode", "store", "observer", "conductor", "gateway"}
    assert control.route_ports == [server.route_port for server in first._nats.servers]
    assert control.route_password == first._nats.route_password and control.api_key == "k3y"
    assert ClusterCA(bundle.tls.ca, control.ca_key).issue("x").ca == open(first._tls_files.ca).read()
    assert read_bundle(path.with_name("join.json")).control is None  # a join bundle has none of it


def test_the_control_plane_host_keeps_serving_when_every_nats_server_of_the_first_host_is_gone(first_and_control):
    first, second, _, _ = first_and_control
    for pid in first.nats_pids:
        os.kill(pid, signal.SIGKILL)
    gone = time.monotonic()
    # its services are on its own nats-server, routed to the first host's: they go on, and its watcher hears them
    second.wait_for(lambda beats: all(second.last_seen.get(i, 0.0) > gone + 2 for i in second.instance_ids), timeout=30)


def test_a_server_joining_another_cluster_knows_when_it_is_routed(tmp_path):
    first = NatsCluster(2, "127.0.0.1", directory=tmp_path, instances={"decode-0": "decode"})
    first.start()
    alone = joining = None
    try:
        users = first.servers[0].users
        routes = [f"127.0.0.1:{server.route_port}" for server in first.servers]
        joining = NatsServer(directory=tmp_path, routes=Routes(first.route_password, lambda: routes), name="joining",
                             users=users, jetstream=False).start()  # fmt: skip
        assert joining.wait_routed("observer", timeout=30)
        with socket.socket() as probe:  # a port no one listens on: no route is ever made there
            probe.bind(("127.0.0.1", 0))
            nowhere = [f"127.0.0.1:{probe.getsockname()[1]}"]
        alone = NatsServer(directory=tmp_path, routes=Routes(first.route_password, lambda: nowhere), name="alone",
                           users=users, jetstream=False).start()  # fmt: skip
        assert not alone.wait_routed("observer", timeout=1)
    finally:
        for server in (alone, joining):
            if server is not None:
                server.stop()
        first.stop()


def test_join_and_up_refuse_what_cannot_work_before_starting_anything(tmp_path, capsys):
    bundle = tmp_path / "join.json"
    leaf = ClusterCA.create().issue("x")
    write_bundle(bundle, JoinBundle(version=VERSION, host="127.0.0.1", host_id="same", model=BundleModel(None, "float32", "none"),
                                    nats=BundleNats([4222], {u: "p" for u in ("prefill", "decode", "store", "observer")}),
                                    tls=BundleTls(leaf.cert, leaf.key, leaf.ca)))  # fmt: skip
    cases = [
        (["join", "127.0.0.1", "--bundle", str(bundle)], "nothing to run here"),
        (["join", "127.0.0.1", "--bundle", str(bundle), "--decode", "1", "--host-id", "same"], "as is the first host"),
        (["join", "127.0.0.1", "--bundle", str(bundle), "--decode", "1", "--host-id", "b", "--listen", "0.0.0.0"],
         "every interface"),
        (["up", "--write-join-bundle", str(tmp_path / "j.json")], "needs --listen"),
        (["up", "--listen", "::"], "every interface"),
        (["up", "--decode", "0"], "--decode 0 needs --listen"),
        (["up", "--listen", "127.0.0.1", "--write-control-bundle", str(tmp_path / "c.json")],
         "--nats-cluster 2 or more"),
        (["join", "127.0.0.1", "--bundle", str(bundle), "--control-plane", "--host-id", "b"], "a join bundle"),
        (["join", "127.0.0.1", "--bundle", str(bundle), "--decode", "1", "--port", "0"], "only with --control-plane"),
    ]  # fmt: skip
    for argv, reason in cases:
        args = build_parser().parse_args(argv)
        assert args.run(args) == 2, argv
        assert reason in capsys.readouterr().err, argv
    assert join.address_towards("127.0.0.1") == "127.0.0.1"
    assert (instance_tag("rack2.node7"), instance_tag("é.x"), instance_tag("...")) == ("rack2-node7", "x", "host")
    assert up.unusable_listen_address("10.0.0.1") is None


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> None:
    """A TLS 1.3 handshake between the two contexts, in memory; raises ssl.SSLError when refused."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    s = server.wrap_bio(to_server, to_client, server_side=True)
    c = client.wrap_bio(to_client, to_server, server_side=False)
    for _ in range(10):
        done = 0
        for side in (c, s):
            try:
                side.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
        if done == 2:
            assert c.version() == "TLSv1.3"
            return
    raise AssertionError("the handshake did not finish")
