"""NATS users and permissions against a real nats-server: no credentials, no connection;
each role publishes and subscribes only where it must (the server refuses the rest and
the message never reaches anyone); an instance with a user of its own, only on its own
subjects; no secret on nats-server's command line, in a log, or in a process that does
not use it."""

import asyncio
import json
import logging
import os
import signal
import stat
from pathlib import Path
from urllib.parse import urlsplit

import nats
import pytest

from libs.common import nats_auth
from libs.common.nats_flush import flush
from libs.common.nats_server import NatsServer
from libs.common.service import Service
from libs.common.settings import ServiceSettings
from libs.protocol import subjects
from tests.integration.conftest import start_cluster, wait_until_async

WAIT = 10.0  # seconds any single expected event may take


@pytest.fixture(scope="module")
def server():
    with NatsServer() as server:
        yield server


class Client:
    """One user's connection, remembering every error the server sent it."""

    def __init__(self, user: str, role: str | None = None) -> None:
        self.user = user
        self.role = role or user  # an instance's user: its role
        self.errors: list[Exception] = []
        self.nc: nats.NATS | None = None
        self._probes = 0
        self._error = asyncio.Event()

    async def connect(self, server: NatsServer) -> "Client":
        async def on_error(e: Exception) -> None:
            self.errors.append(e)
            self._error.set()

        credentials = nats_auth.load_credentials(server.credentials_file(self.user))
        inbox = nats_auth.inbox_prefix(self.role, None if self.role == self.user else self.user)
        self.nc = await nats.connect(server.public_url, **credentials.connect_options(), error_cb=on_error,
                                     inbox_prefix=inbox, allow_reconnect=False)  # fmt: skip
        return self

    def refused(self, subject: str) -> bool:
        quoted = f'"{subject}"'.lower()  # nats-py lowercases the server's error
        return any("permissions violation" in str(e) and quoted in str(e) for e in self.errors)

    async def settled(self) -> None:
        """Return once the server has judged everything sent so far. (A flush is not enough:
        nats-py writes its PING ahead of the commands still queued.) The probe is a publish
        no user but admin may make; the server answers in order, so its refusal comes last."""
        assert self.user != "admin"
        self._probes += 1
        probe = f"kvserve.probe.{self._probes}"
        await self.nc.publish(probe, b"")
        while not self.refused(probe):
            self._error.clear()
            await asyncio.wait_for(self._error.wait(), WAIT)

    async def may_publish(self, subject: str) -> bool:
        await self.nc.publish(subject, b"x")
        await self.settled()
        return not self.refused(subject)

    async def may_subscribe(self, subject: str) -> bool:
        sub = await self.nc.subscribe(subject)
        await self.settled()
        refused = self.refused(subject)
        if not refused:
            await sub.unsubscribe()
        return not refused

    async def close(self) -> None:
        await self.nc.close()


@pytest.fixture
async def clients(server):
    connected = {i.user: await Client(i.user).connect(server) for i in server.identities if i.user != "admin"}
    yield connected
    for client in connected.values():
        await client.close()


async def test_a_client_without_credentials_or_with_a_wrong_password_cannot_connect(server):
    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    for options in ({}, {"user": "gateway", "password": "not-the-password"}, {"token": "a-guess"}):
        errors.clear()
        with pytest.raises(nats.errors.Error):
            await nats.connect(server.public_url, **options, error_cb=on_error, allow_reconnect=False,
                               max_reconnect_attempts=0, connect_timeout=WAIT)  # fmt: skip
        assert any("authorization violation" in str(e).lower() for e in errors), errors


# (subject, the users that may publish on it); every other user must be refused.
PUBLISHERS = [
    (subjects.tokens("req-1", "decode-0"), {"prefill", "decode"}),  # a role's user: under any instance's name
    (subjects.prefill_submit("prefill-0"), {"gateway"}),
    (subjects.decode_prefill("decode-0"), {"gateway"}),
    (subjects.CONDUCTOR_ADMIT, {"gateway"}),
    (subjects.CANCEL, {"gateway"}),
    (subjects.decode_reserve("decode-0"), {"prefill"}),
    (subjects.decode_admit("decode-0"), {"prefill"}),
    (subjects.store_op("store-0", "put"), {"prefill"}),
    (subjects.kv_events("store-0"), {"prefill", "store"}),
    (subjects.heartbeat("gateway", "gateway-0"), {"gateway"}),
    (subjects.heartbeat("store", "store-0"), {"store"}),
    # a reply to a requester's inbox: the services that answer its requests, even across a NATS
    # restart (when nats-server has forgotten which replies they owe); reading it stays the owner's
    ("_INBOX.prefill.abc.1", {"gateway", "conductor", "prefill", "decode", "store"}),
    ("_INBOX.admin.abc.1", set()),
]
# (subject, the users that may subscribe to it)
SUBSCRIBERS = [
    (subjects.request_tokens("req-1"), {"gateway"}),
    (subjects.tokens("req-1", "decode-0"), {"gateway"}),
    ("kvserve.tokens.>", set()),  # a request's tokens, from the instances that name themselves
    ("kvserve.>", set()),
    (subjects.prefill_submit("prefill-0"), {"prefill"}),
    (subjects.PREFILL_SUBMIT_ALL, {"prefill"}),
    (subjects.CONDUCTOR_ADMIT, {"conductor"}),
    (subjects.decode_admit("decode-0"), {"decode"}),
    (subjects.store_op("store-0", "get"), {"store"}),
    (subjects.KV_EVENTS_ALL, {"conductor"}),
    (subjects.HEARTBEAT_ALL, {"gateway", "conductor", "observer"}),
    ("_INBOX.>", set()),
    ("_INBOX.gateway.>", {"gateway"}),
    (">", set()),
]


@pytest.mark.parametrize(("subject", "allowed"), PUBLISHERS, ids=[s for s, _ in PUBLISHERS])
async def test_only_the_roles_that_need_it_may_publish(clients, subject, allowed):
    granted = {user for user, client in clients.items() if await client.may_publish(subject)}
    assert granted == allowed


@pytest.mark.parametrize(("subject", "allowed"), SUBSCRIBERS, ids=[s for s, _ in SUBSCRIBERS])
async def test_only_the_roles_that_need_it_may_subscribe(clients, subject, allowed):
    granted = {user for user, client in clients.items() if await client.may_subscribe(subject)}
    assert granted == allowed


async def test_a_refused_token_chunk_never_reaches_the_gateway(clients):
    gateway, store, prefill = clients["gateway"], clients["store"], clients["prefill"]
    received: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_chunk(msg) -> None:
        received.put_nowait(msg.data)

    await gateway.nc.subscribe(subjects.request_tokens("req-2"), cb=on_chunk)
    await gateway.settled()
    # the store (and the gateway itself) try to write into the answer; then a prefill worker does
    await store.nc.publish(subjects.tokens("req-2", "prefill-0"), b"forged by the store")
    await store.settled()
    assert store.refused(subjects.tokens("req-2", "prefill-0"))
    await prefill.nc.publish(subjects.tokens("req-2", "prefill-0"), b"from prefill")
    assert await asyncio.wait_for(received.get(), WAIT) == b"from prefill"  # the first and only chunk
    assert received.empty()


async def test_a_refused_subscription_sees_no_prompt(clients):
    store, gateway, prefill = clients["store"], clients["gateway"], clients["prefill"]
    seen: list[bytes] = []
    submitted: asyncio.Queue[bytes] = asyncio.Queue()

    async def spy(msg) -> None:
        seen.append(msg.data)

    async def on_submit(msg) -> None:
        submitted.put_nowait(msg.data)

    await store.nc.subscribe(subjects.PREFILL_SUBMIT_ALL, cb=spy)
    await store.settled()
    assert store.refused(subjects.PREFILL_SUBMIT_ALL)
    await prefill.nc.subscribe(subjects.prefill_submit("prefill-0"), cb=on_submit)
    await prefill.settled()
    await gateway.nc.publish(subjects.prefill_submit("prefill-0"), b"a secret prompt")
    assert await asyncio.wait_for(submitted.get(), WAIT) == b"a secret prompt"
    await store.settled()  # anything the server had sent the store arrives before this answer
    assert seen == []


async def test_a_role_answers_requests_on_their_reply_subject_only(clients):
    """Request/reply between roles: the prefill worker's private inbox, the store's
    permission to answer (and to answer only what it was asked)."""
    store, prefill = clients["store"], clients["prefill"]

    async def answer(msg) -> None:
        await msg.respond(b"stats")

    await store.nc.subscribe(subjects.store_op("store-0", "stats"), cb=answer)
    await store.settled()
    reply = await prefill.nc.request(subjects.store_op("store-0", "stats"), b"?", timeout=WAIT)
    assert reply.data == b"stats"
    assert not any("permissions violation" in str(e) and "probe" not in str(e) for e in store.errors + prefill.errors)


async def test_the_secrets_are_in_private_files_and_never_on_the_command_line(server):
    users = [identity.user for identity in server.identities]
    files = [server.config_file] + [server.credentials_file(user) for user in users]
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700, path.parent
    assert stat.S_IMODE(server.config_file.parent.parent.stat().st_mode) == 0o700
    passwords = [json.loads(server.credentials_file(user).read_text())["password"] for user in users]
    assert all(password in server.config_file.read_text() for password in passwords)
    with open(f"/proc/{server.pid}/cmdline", "rb") as f:
        command_line = f.read().decode()
    own = server.config_file.with_name(f"{server.name}.conf")  # its own configuration, which includes the users'
    assert str(own) in command_line  # the path only
    assert f'include "{server.config_file.name}"' in own.read_text()
    assert stat.S_IMODE(own.stat().st_mode) == 0o600
    assert not any(password in command_line for password in passwords)


@pytest.mark.parametrize("given", ["credentials file", "URL"])
async def test_a_service_logs_neither_its_credentials_nor_its_url(caplog, given):
    """A service given its password in a credentials file, or in its URL (for people who
    run their own NATS), that loses NATS and reconnects says where, never with what."""
    with NatsServer() as server:
        password = json.loads(server.credentials_file("store").read_text())["password"]
        if given == "URL":
            where = dict(nats_url=server.url_for("store"))
        else:
            where = dict(nats_url=server.public_url, nats_credentials=str(server.credentials_file("store")))
        settings = ServiceSettings(role="store", instance_id="store-a", host_id="h", heartbeat_interval=3600.0, **where)
        service = Service(settings)
        caplog.set_level(logging.DEBUG)
        running = asyncio.create_task(service.run())
        try:
            await wait_until_async(lambda: "store-a ready" in caplog.text, WAIT, "the service to start")
            os.kill(server.pid, signal.SIGKILL)
            await wait_until_async(lambda: "disconnected from NATS" in caplog.text, WAIT, "the service to notice")
            await asyncio.to_thread(server.restart)
            await wait_until_async(lambda: "reconnected to NATS at" in caplog.text, WAIT, "the service to reconnect")
        finally:
            service.stopping.set()
            await running
    assert f"reconnected to NATS at 127.0.0.1:{server.port}" in caplog.text
    assert password not in caplog.text


# --- a user per instance --------------------------------------------------------------
INSTANCES = {"gateway-0": "gateway", "conductor-0": "conductor", "prefill-0": "prefill", "decode-0": "decode",
             "decode-1": "decode", "store-0": "store", "store-1": "store"}  # fmt: skip


@pytest.fixture(scope="module")
def instance_server():
    with NatsServer(instances=INSTANCES) as server:
        yield server


@pytest.fixture
async def instances(instance_server):
    connected = {user: await Client(user, role).connect(instance_server) for user, role in INSTANCES.items()}
    yield connected
    for client in connected.values():
        await client.close()


# (subject, the instances that may publish on it)
INSTANCE_PUBLISHERS = [
    (subjects.tokens("req-1", "decode-0"), {"decode-0"}),
    (subjects.tokens("req-1", "decode-1"), {"decode-1"}),
    (subjects.tokens("req-1", "prefill-0"), {"prefill-0"}),
    (subjects.kv_events("store-0"), {"store-0"}),
    (subjects.kv_events("store-1"), {"store-1"}),
    (subjects.kv_events("prefill-0"), {"prefill-0"}),
    (subjects.decode_reserve("decode-1"), {"prefill-0"}),
    (subjects.store_op("store-1", "put"), {"prefill-0"}),
    (subjects.heartbeat("decode", "decode-0"), {"decode-0"}),
    (subjects.heartbeat("decode", "decode-1"), {"decode-1"}),
]
# (subject, the instances that may subscribe to it)
INSTANCE_SUBSCRIBERS = [
    (subjects.decode_reserve("decode-0"), {"decode-0"}),
    (subjects.decode_reserve("decode-1"), {"decode-1"}),
    (subjects.DECODE_RESERVE_ALL, set()),
    (subjects.decode_admit("decode-1"), {"decode-1"}),
    (subjects.decode_release("decode-1"), {"decode-1"}),
    (subjects.decode_prefill("decode-1"), {"decode-1"}),
    (subjects.prefill_submit("prefill-0"), {"prefill-0"}),
    (subjects.store_op("store-1", "get"), {"store-1"}),
    (subjects.kv_snapshot("store-1"), {"store-1"}),
    (subjects.metrics("decode-1"), {"decode-1"}),
    (subjects.request_tokens("req-1"), {"gateway-0"}),
    (subjects.KV_EVENTS_ALL, {"conductor-0"}),
    ("_INBOX.prefill.prefill-0.>", {"prefill-0"}),
    ("_INBOX.prefill.>", set()),
]


@pytest.mark.parametrize(("subject", "allowed"), INSTANCE_PUBLISHERS, ids=[s for s, _ in INSTANCE_PUBLISHERS])
async def test_an_instance_publishes_only_under_its_own_name(instances, subject, allowed):
    granted = {user for user, client in instances.items() if await client.may_publish(subject)}
    assert granted == allowed


@pytest.mark.parametrize(("subject", "allowed"), INSTANCE_SUBSCRIBERS, ids=[s for s, _ in INSTANCE_SUBSCRIBERS])
async def test_an_instance_subscribes_only_to_its_own_subjects(instances, subject, allowed):
    granted = {user for user, client in instances.items() if await client.may_subscribe(subject)}
    assert granted == allowed


async def test_a_decode_instance_neither_reads_another_ones_reservations_nor_writes_its_tokens(instances):
    gateway, prefill, decode0, decode1 = (instances[i] for i in ("gateway-0", "prefill-0", "decode-0", "decode-1"))
    stolen: list[bytes] = []
    received: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
    reserved: asyncio.Queue[bytes] = asyncio.Queue()

    async def spy(msg) -> None:
        stolen.append(msg.data)

    async def on_chunk(msg) -> None:
        received.put_nowait((msg.subject, msg.data))

    async def on_reserve(msg) -> None:
        reserved.put_nowait(msg.data)

    await decode1.nc.subscribe(subjects.decode_reserve("decode-0"), cb=spy)
    await decode1.settled()
    assert decode1.refused(subjects.decode_reserve("decode-0"))
    await decode0.nc.subscribe(subjects.decode_reserve("decode-0"), cb=on_reserve)
    await decode0.settled()
    await gateway.nc.subscribe(subjects.request_tokens("req-3"), cb=on_chunk)
    await gateway.settled()

    await prefill.nc.publish(subjects.decode_reserve("decode-0"), b"req-3's prompt")
    assert await asyncio.wait_for(reserved.get(), WAIT) == b"req-3's prompt"
    await decode1.nc.publish(subjects.tokens("req-3", "decode-0"), b"forged by decode-1")
    await decode1.settled()
    assert decode1.refused(subjects.tokens("req-3", "decode-0"))
    await decode0.nc.publish(subjects.tokens("req-3", "decode-0"), b"from decode-0")
    assert await asyncio.wait_for(received.get(), WAIT) == (subjects.tokens("req-3", "decode-0"), b"from decode-0")
    await decode1.settled()  # anything the server had sent decode-1 arrives before this answer
    assert stolen == [] and received.empty()


async def test_a_store_cannot_publish_another_stores_kv_events(instances):
    conductor, store0, store1 = instances["conductor-0"], instances["store-0"], instances["store-1"]
    received: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()

    async def on_events(msg) -> None:
        received.put_nowait((msg.subject, msg.data))

    await conductor.nc.subscribe(subjects.KV_EVENTS_ALL, cb=on_events)
    await conductor.settled()
    await store1.nc.publish(subjects.kv_events("store-0"), b"store-0 evicted everything")
    await store1.settled()
    assert store1.refused(subjects.kv_events("store-0"))
    await store0.nc.publish(subjects.kv_events("store-0"), b"store-0's events")
    assert await asyncio.wait_for(received.get(), WAIT) == (subjects.kv_events("store-0"), b"store-0's events")
    assert received.empty()


# --- kvserve up ----------------------------------------------------------------------
API_KEY = "the-api-key-of-this-test"
NATS_SECRET = "a-nats-secret-in-the-launchers-environment"


@pytest.fixture(scope="module")
def keyed_cluster():
    """A cluster started from a shell that holds secrets (an API key, a NATS secret), with an API key."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVSERVE_API_KEY", API_KEY)
        env.setenv("KVSERVE_NATS_SECRET", NATS_SECRET)
        cluster = start_cluster(api_key=API_KEY)
    yield cluster
    cluster.stop()


def environ(pid: int) -> dict[str, str]:
    return dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)


def test_a_local_cluster_serves_with_each_instance_its_own_user_and_nothing_refused(keyed_cluster):
    """Every service runs as its own instance's NATS user, given by a file, with no secret in
    its environment or command line but its own; a request end to end (admission, prefill,
    store, hand-off, tokens, KV events) needs nothing NATS refuses."""
    from openai import OpenAI

    cluster = keyed_cluster
    client = OpenAI(base_url=cluster.gateway_url + "/v1", api_key=API_KEY, max_retries=0)
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
    )
    assert out.choices[0].message.content
    secrets = {urlsplit(cluster.nats_url).password: "admin"}
    for instance_id, pid in cluster.pids.items():
        env = environ(pid)
        credentials = nats_auth.load_credentials(env["KVSERVE_NATS_CREDENTIALS"])
        assert credentials.user == instance_id
        assert "@" not in env["KVSERVE_NATS_URL"]
        secrets[credentials.password] = instance_id
    for instance_id, pid in cluster.pids.items():
        exposed = Path(f"/proc/{pid}/environ").read_text() + Path(f"/proc/{pid}/cmdline").read_text()
        assert not [owner for secret, owner in secrets.items() if secret in exposed], instance_id
        assert NATS_SECRET not in exposed, instance_id
        assert (API_KEY in exposed) == (instance_id == "gateway-0"), instance_id  # the gateway alone checks it
        assert not any("NATS refused" in line for line in cluster.logs(instance_id)), cluster.logs(instance_id)
    for name, pid in (("nats-server", cluster.nats_pid), ("watchdog", cluster.reaper_pid)):
        exposed = Path(f"/proc/{pid}/environ").read_text()
        assert API_KEY not in exposed and NATS_SECRET not in exposed, name
        assert not any(secret in exposed for secret in secrets), name


async def test_a_nats_cluster_routes_messages_and_keeps_route_and_user_secrets_off_command_lines():
    from libs.common.nats_auth import ROUTE_USER
    from libs.common.nats_server import NatsCluster

    cluster = NatsCluster(3).start()
    try:
        servers = cluster.servers
        route_password = servers[0].routes.password
        for server in servers:
            config = server.config_file.with_name(f"{server.name}.conf")
            assert stat.S_IMODE(config.stat().st_mode) == 0o600
            assert route_password in config.read_text()
            with open(f"/proc/{server.pid}/cmdline", "rb") as f:
                command_line = f.read().decode()
            assert route_password not in command_line and "@" not in command_line
        # a message published through one server reaches a subscriber on another
        gateway, conductor = (json.loads(cluster.credentials_file(u).read_text()) for u in ("gateway", "conductor"))
        sub_nc = await nats.connect(servers[2].public_url, user="conductor", password=conductor["password"])
        pub_nc = await nats.connect(servers[0].public_url, user="gateway", password=gateway["password"])
        try:
            sub = await sub_nc.subscribe(subjects.CONDUCTOR_ADMIT)
            await flush(sub_nc)

            deadline = asyncio.get_running_loop().time() + WAIT
            while True:  # published again until the routes are up: a deadline, no guess
                await pub_nc.publish(subjects.CONDUCTOR_ADMIT, b"x")
                try:
                    assert (await sub.next_msg(timeout=0.2)).data == b"x"
                    break
                except nats.errors.TimeoutError:
                    assert asyncio.get_running_loop().time() < deadline, "no route carried the message"
        finally:
            await sub_nc.close()
            await pub_nc.close()
        # a client is no route: the route user's password opens no client connection
        with pytest.raises(nats.errors.Error):
            await nats.connect(servers[1].public_url, user=ROUTE_USER, password=route_password, allow_reconnect=False,
                               max_reconnect_attempts=0, connect_timeout=WAIT)  # fmt: skip
    finally:
        cluster.stop()
